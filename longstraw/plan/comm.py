"""The planner's communication in the time: per phase of a step (capture, replay, exact
mode's reverse walk, the gradient sums at the end), the bytes the busiest rank receives
on each link class, the seconds they take, and the rule by which they join the compute
time. Torch-free.

Link classes (`PlanConfig`, or a `gpu` preset: `plan/gpus.py`):
  * intra-node (NVLink / Infinity Fabric, `intra_node_gbs`) for a group of at most
    `gpus_per_node` ranks; inter-node (`inter_node_gbs` per GPU) for a larger one: a ring
    or all-to-all over more than one node is bounded by its slowest hop;
  * host (`host_bandwidth_gbs`): offload staging.

What is counted, bytes received per rank:
  * context parallelism (W ranks): capture's K/V / latent broadcasts and GDN relays
    (`traffic.divided_capture_traffic`), the divided walk's gathers and its gradient sum
    (`traffic.divided_walk_traffic`), and replay's log-sum-exp merges: per attention (MLA)
    layer and replayed token, the partial output and LSE of every other rank's shard,
    all-reduced (2 (W-1)/W x heads x (v_dim + 1) x fp32), per forward (x2 with layer
    recompute, +1 per score pass);
  * expert parallelism: the MoE combines, split by phase (`experts.expert_phase_traffic`);
  * FSDP2 (`shard_params`, every decoder layer `fully_shard`-ed): per pass over the
    layers, (W-1)/W of their non-expert weights all-gathered or of their gradients
    reduce-scattered. As `parallel.sharding.shard_model` wraps them (every layer resharded
    after each forward, under one root), measured on gloo (tests/comm_worker.py) and
    rehearsed (tests/rehearsal/test_against_plan.py): capture gathers each layer once;
    in replay every piece's forward gathers a layer and its backward gathers it again
    (the forward resharded it), every held piece's no-grad forward once more: G (3 x
    pieces - 1) passes of gathers (+1 per score pass), and G x pieces of reduce-scatters;
    the walk two gathers (recompute, backward) and one reduce-scatter per walk chunk.
    FSDP2's backward prefetch gathers a layer or two more per step than that (measured
    17 layer gathers for 16 at G = 2 one piece, 66 for 64 at three pieces: under 6%),
    not counted. (Before the rehearsal's check the planner counted replay's gathers as
    G x pieces - 1 and the walk's as one per chunk, as with layers wrapped without a root,
    which FSDP2 never reshards after forward: half the gathers of `shard_model`; before
    the gloo check, a gather per capture chunk and 2-3 per piece, one reduce-scatter per
    step, and a layer as the whole model's weights over the layer count);
  * the replicated gradients made the first rank's (`parallel.gradients.replicate_gradients`,
    after a step whose walk is not divided: detached mode, a replicated walk): one broadcast
    of the gradients every rank holds alike (`replicated_grad_bytes`) and a 16-byte layout
    check from every other rank (all-gather); a divided walk sums them in its own traffic;
  * data parallelism (`data_parallel` > 1): one ring all-reduce of the trainable
    gradients per step (all but the DSA indexers', which get none), 2 (D-1)/D x their
    bytes (`parallel.data.reduce_gradients` also all-gathers one 8-byte presence flag per
    trainable tensor and a 16-byte layout check, not counted);
  * offload staging: `offload.plan_offload`'s traffic over the host link.

Overlap rule (stated, not measured): collectives the engine runs *inside* a layer's
compute and waits for (context-parallel merges / gathers, expert combines, the
data-parallel all-reduce at the end) are **added** to the phase's compute time; transfers
that are prefetched while the previous layer computes (FSDP2's weight all-gathers and
reduce-scatters, the offload stager's copies) **overlap** it: a phase takes
max(compute + blocking, prefetched). Offload staging overlaps the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import count_parameters, indexer_parameters
from .config import Basis
from .experts import (expert_elements, expert_phase_traffic, expert_slice, fsdp2_expert_padding, layer_elements,
                      weight_bytes)
from .traffic import candidate_bytes_per_query


def link(c, ranks: int) -> tuple[str, float]:
    """(link class, effective GB/s) of a group of `ranks` GPUs."""
    if ranks <= c.gpus_per_node:
        return "intra_node", c.intra_node_gbs
    return "inter_node", c.inter_node_gbs


def replay_merge_bytes_per_token(s: Basis, recompute: bool, score_passes: int) -> float:
    """Bytes a rank receives per replayed token for the log-sum-exp merges of every
    attention / MLA layer over the sharded prompt (0 on one rank), ring all-reduces of
    2 (W-1)/W of, in the accumulation dtype, per layer:

        attention   autograd pass (forward + backward): 2 H (Dv + 1); a layer recompute
                    adds H (Dv + 2); a score pass H (Dv + 1)
        MLA         autograd pass: H (kv_lora + 2) forward, and in backward the absorbed
                    queries' gradient H (kv_lora + rope) in the MODEL dtype
                    (`SumGradAcrossRanks`); recompute adds H (kv_lora + 2); a score pass
                    H (kv_lora + 1)

    (H heads, Dv the value head dim; MLA merges in the latent space. Until stop 55 MLA's
    autograd pass read 2 (H (kv_lora + 1) + kv_lora) in the accumulation dtype, fitted on a
    model where 2 kv_lora = H rope: 1.29x GLM-5.2's rehearsed replay bytes.) A sparse DSA layer
    with its own indexer (top-k K below the prompt's positions) also agrees on the global
    top-k of every rank's candidates per forward (`mla_decode.prompt_candidates`,
    `parallel.topk.global_topk`): `candidate_bytes_per_query(W, K)`, 2 (W-1)/W (4 + 16 x
    64 + K (4 + 4)) + (W-1) 4, flat in W but for the last term (it was an all-gather of
    (W-1) K (4 + 4)). Fitted to the engine's `comm_bytes_replay` on gloo at
    W = 2 and 3 (tests/test_plan_comm.py; the DSA candidates and the expert combines:
    tests/comm_worker.py's `check_expert_and_gradient_bytes`)."""
    W, arch = s.W, s.arch
    if W == 1:
        return 0.0
    per, per_model_dtype = 0.0, 0.0
    for layer in arch.layers:
        if layer.mixer == "attention" and layer.window is None:
            h, d = arch.heads, arch.head_dim
            per += 2 * h * (d + 1)
        elif layer.mixer == "mla":
            h, d = arch.heads, arch.kv_lora_rank
            per += h * (d + 2)  # the merge of (o, lse) and the max of lse
            per_model_dtype += h * (d + arch.rope_dim)  # backward: the absorbed queries' gradient, summed
        else:
            continue
        per += (h * (d + 2) if recompute else 0) + score_passes * h * (d + 1)
    candidates = 0.0
    if arch.index_topk and arch.index_topk < s.P - 1:  # sparse: top-k below the prompt's positions
        forwards = 1 + (1 if recompute else 0) + score_passes
        candidates = candidate_bytes_per_query(W, arch.index_topk) * forwards * arch.count(mixer="mla", indexer=True)
    return 2 * (W - 1) / W * (per * s.acc + per_model_dtype * s.b) + candidates


def held_merge_bytes_per_token(s: Basis) -> float:
    """Bytes a rank receives per token of a held piece: replay in pieces runs every piece
    but the last once more without autograd into the branch's state (`engine/replay.py`),
    one forward's merges (H (Dv + 2) per attention layer, H (kv_lora + 2) per MLA layer, as
    a recompute; measured for attention, MLA taken alike) and DSA candidates."""
    return replay_merge_bytes_per_token(s, True, 0) - replay_merge_bytes_per_token(s, False, 0)


def replicated_grad_bytes(s: Basis, grad_bytes: float) -> float:
    """The trainable gradients every rank of a context-parallel group holds alike: LoRA's
    adapters; under FSDP2 (which reduce-scatters the sharded layers itself) the embeddings
    and lm_head; else every gradient on the rank (`grad_bytes`) but its expert slices and
    the DSA indexers' (trained by no loss here: no gradient)."""
    c, params = s.config, s.params
    if c.lora_rank:
        return params.lora * s.b
    if c.shard_params:
        return (params.embedding + params.lm_head + s.arch.hidden) * s.b  # and the final norm
    experts = expert_elements(s.arch) * expert_slice(s.arch, s.W) if c.expert_parallel else 0.0
    return grad_bytes - (experts + indexer_parameters(s.arch)) * s.b


def padded_lora_elements(s: Basis) -> int:
    """LoRA's adapter elements as FSDP2 holds them over W ranks: each parameter's first
    dimension padded to a multiple of W (A [r, in]: r = 8 on 32 ranks is 4x its rows)."""
    c = s.config
    return count_parameters(s.arch, c.lora_rank, c.lora_targets, pad_to=s.W).lora if c.lora_rank else 0


def fsdp_pass_bytes(s: Basis) -> float:
    """Bytes one pass over the FSDP2-sharded decoder layers gathers, whole: each layer's
    weights (under expert parallelism but its routed experts) and LoRA's adapters (padded,
    `padded_lora_elements`), summed layer by layer. GLM-5.2's dense and MoE layers differ:
    counted as the largest layer each, its first 4 layers' replay gathers were planned
    1.13x the rehearsal's."""
    experts = not s.config.expert_parallel
    layers = (layer_elements(s.arch, layer, experts=experts) for layer in s.arch.layers)
    padding = weight_bytes(fsdp2_expert_padding(s.arch, s.W) * s.W, 0, s.wdt, s.b) if experts else 0.0
    return sum(weight_bytes(linear, other, s.wdt, s.b) for linear, other in layers) + padding + padded_lora_elements(s) * s.b


def sharded_layer_grad_bytes(s: Basis) -> float:
    """The whole (unsharded) gradients of the FSDP2-sharded decoder layers, what one backward
    pass reduce-scatters: LoRA's adapters (padded as FSDP2 pads them: the planner's 0.48x
    of GLM-5.2's rehearsed replay reduce-scatter before), or every layer parameter but the
    routed experts (expert parallelism keeps them apart) and the DSA indexers (no gradient)."""
    c, params = s.config, s.params
    if c.lora_rank:
        return padded_lora_elements(s) * s.b
    experts = expert_elements(s.arch) if c.expert_parallel else 0
    padding = 0 if c.expert_parallel else fsdp2_expert_padding(s.arch, s.W) * s.W  # FSDP2's padded [E, ..]
    return (params.total - params.embedding - params.lm_head - s.arch.hidden - experts + padding
            - indexer_parameters(s.arch)) * s.b


@dataclass(frozen=True)
class CommPlan:
    """Per phase: bytes by link class and kind, blocking / prefetched seconds, compute
    seconds and the phase's time by the overlap rule; the step's total, all transfer
    seconds (`comm_s`, overlapped or not) and the exposed ones (`exposed_s`: the total
    less the compute, the time communication adds)."""

    phases: dict
    total_s: float
    comm_s: float
    exposed_s: float
    rule: str

    def as_dict(self) -> dict:
        return {"phases": self.phases, "total_s": self.total_s, "comm_s": self.comm_s, "exposed_s": self.exposed_s,
                "rule": self.rule}


RULE = ("per phase: max(compute + blocking collectives (context-parallel merges / gathers, expert combines, "
        "data-parallel all-reduce), prefetched transfers (FSDP gathers / reduce-scatters)); offload staging "
        "overlaps the whole step")


def plan_comm(s: Basis, *, capture_comm: float, walk_comm: float, divided_capture: bool, divided_walk: bool,
              recompute: bool, walk_recompute: bool, n_chunks: int, walk_chunks: int,
              grad_bytes: float, compute: dict, offload_s: float, offload_bytes: float = 0.0) -> CommPlan:
    """The step's communication by phase, and its time by the overlap rule.

    Args:
        capture_comm / walk_comm: context-parallel bytes of capture and of the divided walk.
        n_chunks / walk_chunks: capture chunks (unused: FSDP2 gathers once) and walk chunks.
        grad_bytes: the trainable gradients' bytes on the rank.
        compute: seconds of compute per phase ('capture', 'replay', 'walk').
        offload_s / offload_bytes: the offload traffic's seconds and bytes over the host link.
    """
    c, W, G, R = s.config, s.W, s.G, s.R
    cp_class, cp_gbs = link(c, W)
    experts = expert_phase_traffic(s, divided_capture=divided_capture, divided_walk=divided_walk, recompute=recompute)
    pieces = -(-R // min(R, c.branch_chunk_size or R))
    piece = min(R, c.branch_chunk_size or R)
    held = (R - 1) // piece * piece  # tokens of every piece but the last, forwarded once more without autograd
    merges = replay_merge_bytes_per_token(s, recompute, c.score_passes) * G * R + held_merge_bytes_per_token(s) * G * held
    # FSDP2: a pass over the layers gathers (W-1)/W of their non-expert weights (`fsdp_pass_bytes`);
    # a backward pass reduce-scatters (W-1)/W of their gradients (module docstring)
    sharded = c.shard_params and W > 1
    per_pass = fsdp_pass_bytes(s) * (W - 1) / W if sharded else 0.0
    rs_pass = sharded_layer_grad_bytes(s) * (W - 1) / W if sharded else 0.0
    backward = {"replay": G * pieces, "walk": walk_chunks if s.exact else 0}
    passes = {"capture": 1, "replay": G * (3 * pieces - 1) + c.score_passes, "walk": 2 * backward["walk"]}
    dp_class, dp_gbs = link(c, W * c.data_parallel)
    gradients = grad_bytes - (0.0 if c.lora_rank else indexer_parameters(s.arch) * s.b / (W if c.shard_params else 1))
    dp = 2 * (c.data_parallel - 1) / c.data_parallel * gradients if c.data_parallel > 1 else 0.0  # DSA indexers: none
    replicas = replicated_grad_bytes(s, grad_bytes) + 16 * (W - 1) if W > 1 and not divided_walk else 0.0
    kinds = {
        "capture": {"context_parallel": capture_comm, "expert_parallel": experts["capture"],
                    "fsdp_gather": per_pass * passes["capture"]},
        "replay": {"context_parallel": merges, "expert_parallel": experts["replay"],
                   "fsdp_gather": per_pass * passes["replay"], "fsdp_reduce_scatter": rs_pass * backward["replay"]},
        "walk": {"context_parallel": walk_comm, "expert_parallel": experts["walk"],
                 "fsdp_gather": per_pass * passes["walk"], "fsdp_reduce_scatter": rs_pass * backward["walk"]},
        "gradients": {"context_parallel": replicas, "data_parallel": dp},
    }
    phases, total, comm_total = {}, 0.0, 0.0
    for name, by_kind in kinds.items():
        blocking = (by_kind.get("context_parallel", 0.0) + by_kind.get("expert_parallel", 0.0)) / (cp_gbs * 1e9)
        blocking += by_kind.get("data_parallel", 0.0) / (dp_gbs * 1e9)
        prefetched = (by_kind.get("fsdp_gather", 0.0) + by_kind.get("fsdp_reduce_scatter", 0.0)) / (cp_gbs * 1e9)
        seconds = compute.get(name, 0.0)
        time = max(seconds + blocking, prefetched)
        links = {cp_class: sum(v for k, v in by_kind.items() if k != "data_parallel")}
        if by_kind.get("data_parallel"):
            links[dp_class] = links.get(dp_class, 0.0) + by_kind["data_parallel"]
        phases[name] = {"bytes": by_kind, "bytes_by_link": links, "compute_s": seconds, "blocking_s": blocking,
                        "prefetched_s": prefetched, "time_s": time}
        total += time
        comm_total += blocking + prefetched
    phases["offload"] = {"bytes_by_link": {"host": offload_bytes}, "time_s": offload_s}
    step = max(total, offload_s)
    busy = sum(compute.values())
    return CommPlan(phases=phases, total_s=step, comm_s=comm_total + offload_s, exposed_s=step - busy, rule=RULE)
