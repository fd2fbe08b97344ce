"""The planner's peak per rank: the static memory (weights, gradients, optimizer state,
the device part of the prompt state and its gradients, GDN checkpoints) plus the largest
phase's working set (capture, replay, exact mode's recompute, scoring). Torch-free.

Its own module because it composes every other section: `memory.py`'s plans and
`offload.py`'s (which reads memory's), so that no two planner modules import each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..defaults import GRADIENT_BUCKET_BYTES
from .config import Basis
from .memory import CapturePlan, ReplayPlan, StatePlan, WalkPlan, WeightPlan, replicated_grad_elements
from .generate import GeneratePlan
from .offload import OffloadPlan
from .vision import VisionPlan


def largest_gradient_bucket(s: Basis) -> float:
    """Bytes of the largest flat bucket (`collectives.in_buckets`: `torch.cat` of up to
    32 MiB of gradients, or one larger gradient alone) the replicated gradients' collective
    holds: the embeddings' (or lm_head's) [vocab, hidden], or one layer's fused routed
    experts [E, 2I, H] where every rank holds them whole; under LoRA its adapters'."""
    c, a = s.config, s.arch
    largest = 0 if c.lora_rank else a.vocab * a.hidden
    if a.experts and not (c.lora_rank or c.expert_parallel or c.shard_params):
        largest = max(largest, a.experts * (2 if a.gated_mlp else 1) * a.moe_intermediate * a.hidden)
    return min(replicated_grad_elements(s) * s.b, max(GRADIENT_BUCKET_BYTES, largest * s.b))


@dataclass(frozen=True)
class Peak:
    """The peak per rank: static memory plus the largest phase's working set, bytes.

    Fields:
        static: weights, gradients, optimizer state, gathered weights, state (device part),
            state gradients and GDN checkpoints.
        phases: what each phase holds beyond `static` ('capture', 'replay', exact mode's
            'recompute', 'score' with score passes, 'generate' with `generate`, 'vision'
            with images, 'gradients' for W > 1 without a divided walk: the broadcast of the
            replicated gradients after backward, one flat bucket, no FSDP2 layer gathered:
            the rehearsal found the planner 1.15x there, `--shard-params` detached).
        phase / peak / fits: the largest phase, static + its bytes, and peak + reserve <= gpu_memory.
    """

    static: float
    phases: dict
    phase: str
    peak: float
    fits: bool


def plan_peak(s: Basis, state: StatePlan, weights: WeightPlan, replay: ReplayPlan, capture: CapturePlan,
              walk: WalkPlan, offload: OffloadPlan, score: float, vision: VisionPlan | None = None,
              generate: GeneratePlan | None = None) -> Peak:
    """The static memory, each phase's working set, and the largest. `vision`: images in
    the prompt (their tower, rows, and the largest image's working set, 'vision').
    `generate`: the rollout's decode ('generate'), before the step's backward: no state
    gradients yet, parameter gradients only from an earlier group (`grads_during_capture`)."""
    c, w = s.config, weights
    static = (w.param_bytes + w.grad_bytes + w.optimizer_bytes + w.gathered + offload.state_gpu
              + offload.state_grad_gpu + state.checkpoints + walk.kept_outputs + (vision.static if vision else 0.0))
    kept = walk.kept_bytes
    # what each phase holds beyond the static memory (capture may run before any gradient exists)
    # exact mode allocates the state gradients after capture (before it only to keep chunk graphs)
    later = offload.state_grad_gpu if s.exact and not c.keep_graph_bytes else 0
    phases = {"capture": capture.working + kept - (0 if c.grads_during_capture else w.grad_bytes) - later,
              "replay": replay.working + kept}
    if s.exact:  # the walk frees the kept graphs first; a chunk is recomputed only after all of them
        phases["recompute"] = max(kept + (walk.transient if walk.kept_chunks else 0),
                                  walk.working if walk.kept_chunks < walk.chunks else 0)
    divided_walk = s.W > 1 and walk.divided
    if s.W > 1:  # the replicated gradients' collective after backward (`parallel.gradients`), one flat bucket
        bucket = largest_gradient_bucket(s)
        if divided_walk:  # partial_gradients: replay's set aside, the walk's partials in fresh buffers, then summed
            during = walk_reached_grad_elements(s) * s.b + walk.working + w.gathered_grads
            after = replicated_grad_elements(s) * s.b + bucket - w.gathered  # every partial, the first bucket;
            phases["recompute"] = max(during, after)  # FSDP2 has resharded every layer by then
        else:  # replicate_gradients: the first rank's broadcast; FSDP2 has resharded every layer by then
            phases["gradients"] = bucket - w.gathered
    if w.gathered_grads:  # FSDP2's backward buffers (shard_params), beside the two gathered layers (static)
        phases.update(fsdp2_backward_phases(phases, replay, w, s.exact and not divided_walk))
    if c.score_passes:
        phases["score"] = score
    if generate is not None:
        phases["generate"] = (generate.working - (0 if c.grads_during_capture else w.grad_bytes)
                              - (offload.state_grad_gpu if s.exact else 0))
    if vision is not None:  # one image's tower at capture (and, exact, its backward after the walk)
        phases["vision"] = vision.working
    phase = max(phases, key=phases.get)
    peak = static + phases[phase]
    return Peak(static=static, phases=phases, phase=phase, peak=peak, fits=peak + c.reserve <= c.gpu_memory)


def walk_reached_grad_elements(s: Basis) -> int:
    """Of `replicated_grad_elements`, those a divided walk's backward reaches, whose fresh
    partials (`parallel.gradients.partial_gradients`) are alive during the walk: all but
    lm_head and the final norm (no loss on the prompt's own tokens), which get theirs only
    when the walk ends (a clone, or zeros). LoRA's adapters are all in the layers.
    Found by rehearsing tiny qwen3's exact walk under FSDP2 at W = 3: planned 1.19x the
    rehearsal, its lm_head's partial counted through the walk."""
    return replicated_grad_elements(s) - (0 if s.config.lora_rank else s.params.lm_head + s.arch.hidden)


def fsdp2_backward_phases(phases: dict, replay: ReplayPlan, w: WeightPlan, exact: bool) -> dict:
    """Replay's and the walk's working sets under FSDP2 (`parallel.sharding.shard_model`).
    In a layer's backward FSDP2 holds four layer-sized buffers: the layer's gathered weights
    and the next layer's all-gather output (its backward prefetch; the two gathered layers
    of the static memory), the layer's unsharded gradients (autograd's, before the
    reduce-scatter), and the flat reduce-scatter input of the layer before it, which FSDP2
    keeps until this layer's reduce (`w.gathered_grads`: the last two). At the logits none
    of them: no layer is gathered yet, and FSDP2 drops the last reduce-scatter input when
    each backward ends (its final callback), so the previous branch's is gone.
    Measured (bench/fsdp2_fit_attribution.py, W = 2, gloo, a 22 MB layer): those four
    buffers at the step's peak, and no more."""
    kept = phases["replay"] - replay.working
    layers = replay.working if replay.layers_working is None else replay.layers_working
    out = {"replay": kept + max(layers + w.gathered_grads, replay.working - w.gathered)}
    if exact:  # an undivided walk (a divided one counts them in `plan_peak`)
        out["recompute"] = phases["recompute"] + w.gathered_grads
    return out
