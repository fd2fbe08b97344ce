"""The planner's report: the assumptions its figures rest on, the flat dict `estimate`
returns (every key and value as `tests/test_plan.py` and `longstraw plan --json` read
them), and the human-readable table of `longstraw plan`. Torch-free."""

from __future__ import annotations

from dataclasses import asdict

from .arch import BACKWARD_FACTOR, human_bytes
from .config import Basis
from .experts import expert_report
from .memory import CapturePlan, ReplayPlan, StatePlan, WalkPlan, WeightPlan
from .offload import OffloadPlan
from .peak import Peak
from .timing import Timing

# ----------------------------------------------------------------------------
# assumptions


def step_assumptions(s: Basis, capture: CapturePlan, walk: WalkPlan, replay: ReplayPlan, state=None) -> list[str]:
    """The assumptions about state, passes, FLOPs and time (after those of the weights and offload)."""
    c, P, p_rank, exact, dtype, rb, acc = s.config, s.P, s.p_rank, s.exact, s.dtype, s.rb, s.acc
    divided, divided_walk, walk_chunk, gk = capture.divided, walk.divided, walk.chunk, c.gdn_kernel
    return [
        f"state counted for all P = {P:,} prompt positions (capture keeps P - 1); per-token state sharded in "
        f"blocks of {s.block} dealt round-robin: {p_rank:,} positions on the fullest rank; constant "
        "(recurrent / window) state replicated" + ("; exact mode keeps every sliding-window position and one GDN "
                                                   "snapshot per chunk of the whole prompt on every rank"
                                                   if exact else ""),
        f"state in {dtype}; GDN recurrent state in {'fp64' if rb == 8 else 'fp32'}"
        + ("; state gradients in fp32" if exact and acc == 4 else ""),
        ("replay working = one piece's graph with each layer recomputed in backward (T tokens x hidden bytes per "
         "layer, kept through the forward, + one layer's activations) " if replay.recompute else
         "replay working = one piece's autograd graph (T tokens x activation bytes per token, all layers) ")
        + "+ the larger of the blockwise-attention and chunked-logits working sets",
        *([("exact walk: each decoder layer recomputed in backward (a chunk keeps every layer's input, the live "
            "graph one layer's; one more forward per chunk)" if walk.recompute else
            "exact walk: one chunk's whole autograd graph (every layer)")
           + ("; GDN snapshots but the latest in host memory, one staged back per walk chunk; their gradients: "
              "two per layer at a time" if state.snapshots and state.snapshots["offload"] else
              "; GDN snapshots on the device; their gradients: two per layer at a time")] if exact else []),
        "self-attention of a piece / chunk: " + {
            "dense": "plain torch everywhere ([heads, T, T] fp32 scores + probs per attention layer; today's code "
                     "on CUDA)",
            "fused-nograd": "a fused kernel without autograd (capture), plain torch with autograd (today's code "
                            "on CPU)",
            "flash": "a fused kernel everywhere (O(T) kept)"}[c.self_attention],
        f"FLOPs: 2 x active matmul params x tokens + attention QK/PV; backward = {BACKWARD_FACTOR:g} x forward; "
        "capture x1, replay x(1 + backward) per branch (+ x1 per score pass; pieces add a no-grad forward of the "
        "held tokens), exact adds a backward of the prompt forward plus a recomputed forward of every chunk whose "
        "graph is not kept",
        f"compute time = one rank's FLOPs / {c.throughput_tflops:g} TFLOP/s effective (communication: `comm`): "
        + ("capture divided (each prompt token on one rank; GDN transitions (Dk+Dv)/Dv of a plain pass), "
           if divided else "capture replicated except attention over the prompt state (divided by W), ")
        + (f"the exact reverse walk divided (each prompt token on one rank; each walk chunk's own causal attention, "
           f"{walk_chunk:,} tokens, and GDN conv + recurrence on every rank), " if divided_walk else
           "the exact reverse walk replicated except attention over the prompt state (divided by W), "
           if exact else "")
        + "replay replicated except attention over the prompt state (divided by W)",
        f"GDN kernel: {gk} " + ("(ops/gated_delta.py, fp32 arithmetic)" if gk == "torch" else
                                "(flash-linear-attention; working set estimated, not measured)"),
        "capture " + ("counted with the parameter gradients allocated (any group after the first of a batch)"
                      if c.grads_during_capture else
                      "counted before any parameter gradient exists (first group after zero_grad(set_to_none))"),
        f"fits = peak + reserve ({human_bytes(c.reserve)}) <= gpu_memory",
    ]


# ----------------------------------------------------------------------------
# the returned dict


def _model_keys(s: Basis, weights: WeightPlan) -> dict:
    """The report's model and parameter figures."""
    arch, params = s.arch, s.params
    return {
        "model": s.name,
        "model_type": arch.model_type,
        "mode": s.config.mode,
        "dtype": s.dtype,
        "weight_dtype": s.wdt,
        "num_layers": len(arch.layers),
        "layer_counts": {k: v for k, v in {
            "full_attention": arch.count(mixer="attention", window=None),
            "sliding_attention": sum(l.mixer == "attention" and l.window is not None for l in arch.layers),
            "gated_deltanet": arch.count(mixer="gdn") if arch.recurrent == "gdn" else 0,
            "kimi_delta_attention": arch.count(mixer="gdn") if arch.recurrent == "kda" else 0,
            "mamba2": arch.count(mixer="gdn") if arch.recurrent == "mamba2" else 0,
            "mla": arch.count(mixer="mla"),
            "dsa_indexer": arch.count(indexer=True),
            "moe": arch.count(mlp="moe")}.items() if v},
        "num_parameters": params.total,
        "num_active_parameters": params.active,
        "num_parameters_published": s.preset.get("num_parameters"),
        "trainable_parameters": weights.trainable,
        "lora_parameters": params.lora,
    }


def _memory_keys(s: Basis, state: StatePlan, weights: WeightPlan, replay: ReplayPlan, capture: CapturePlan,
                 walk: WalkPlan, offload: OffloadPlan, score: float, peak: Peak) -> dict:
    """The report's memory figures per rank, bytes."""
    st, exact, c = state.sizes, s.exact, s.config
    return {
        "state_bytes_per_token": st["per_token"],
        "state_bytes_fixed": st["fixed"],
        "state_bytes_total": state.total,
        "state_bytes_per_rank": state.rank,
        "state_bytes_on_gpu_per_rank": offload.state_gpu,
        "state_bytes_host_per_rank": offload.state_host,
        "state_grad_bytes_per_rank": state.grad,
        "exact_checkpoint_bytes_per_rank": state.checkpoints,
        "param_bytes": int(weights.param_bytes),
        "grad_bytes": int(weights.grad_bytes),
        "optimizer_bytes": int(weights.optimizer_bytes),
        "gathered_param_bytes": int(weights.gathered),
        "gathered_grad_bytes": int(weights.gathered_grads),
        "replay_working_bytes": int(replay.working),
        "replay_recompute_layers": replay.recompute,
        "replay_batch": replay.batch,
        "capture_working_bytes": int(capture.working),
        "recompute_working_bytes": int(walk.working),
        "chunk_graph_bytes": int(walk.chunk_graph) if exact else 0,
        "kept_graph_chunks": walk.kept_chunks,
        "kept_graph_bytes": int(walk.kept_bytes),
        "kept_attention_bytes_per_rank": int(walk.kept_outputs),
        "recomputed_chunks": walk.chunks - walk.kept_chunks if exact else 0,
        "walk_recompute_layers": walk.recompute,
        "exact_snapshots": state.snapshots,
        "score_working_bytes": int(score),
        "static_bytes_per_rank": int(peak.static),
        "peak_bytes_per_rank": int(peak.peak),
        "peak_phase": peak.phase,
        "gpu_memory_bytes": c.gpu_memory,
        "reserve_bytes": c.reserve,
        "fits": bool(peak.fits),
    }


def build_report(s: Basis, state: StatePlan, weights: WeightPlan, replay: ReplayPlan, capture: CapturePlan,
                 walk: WalkPlan, offload: OffloadPlan, score: float, peak: Peak, timing: Timing) -> dict:
    """The flat dict `estimate` returns, plus 'breakdown', 'offload', 'inputs' and 'assumptions'."""
    c, t, exact, figures = s.config, timing, s.exact, offload.figures
    thr = t.throughput
    return {
        **_model_keys(s, weights),
        **_memory_keys(s, state, weights, replay, capture, walk, offload, score, peak),
        "divided_capture": bool(capture.divided),
        "divided_walk": bool(walk.divided),
        "walk_chunk_tokens": walk.chunk if exact else 0,
        "capture_comm_bytes_per_rank": capture.comm,
        "walk_comm_bytes_per_rank": walk.comm,
        **expert_report(s, divided_capture=capture.divided, divided_walk=walk.divided, recompute=replay.recompute),
        "flops_capture": t.flops_capture,
        "flops_replay_per_branch": t.flops_branch,
        "flops_exact_extra": t.flops_exact_extra,
        "estimated_time_s_detached": t.t_detached,
        "estimated_time_s_exact": t.t_exact,
        "estimated_time_s": max(t.t_exact if exact else t.t_detached, t.t_transfer),
        "offload_host_bytes_per_rank": offload.state_host,
        "offload_slot_bytes_per_rank": figures["slot_bytes"] if figures else 0,
        "offload_traffic_bytes_per_step": figures["traffic_bytes"] if figures else 0,
        "offload_transfer_time_s": t.t_transfer,
        "offload_decode_bytes_per_token": figures["decode_bytes_per_token"] if figures else 0,
        "breakdown": {
            "state": {k: v for k, v in state.sizes.items() if k not in ("per_token", "fixed")},
            "replay": {"piece_tokens": replay.T, "held_branch_tokens": replay.held,
                       "recompute_layers": replay.recompute,
                       "graph_bytes_per_token": replay.graph_tok, "graph_bytes": replay.graph,
                       "attention_working_bytes": replay.attention, "logits_working_bytes": replay.logits,
                       "branch_state_bytes": replay.branch_state},
            "capture": {"chunk_tokens": capture.C, "working_bytes": capture.working},
            "phase_peak_bytes": {k: int(peak.static + v) for k, v in peak.phases.items()},
            "time_s": {"capture": t.flops_capture / thr, "replay_per_branch": t.flops_branch / thr,
                       "exact_extra": t.flops_exact_extra / thr},
        },
        "offload": figures,
        "inputs": {**asdict(c), "dtype": s.dtype, "weight_dtype": s.wdt},
        "assumptions": [*weights.assumptions, *offload.assumptions, *step_assumptions(s, capture, walk, replay, state)],
    }


# ----------------------------------------------------------------------------
# text report


def _offload_rows(r: dict) -> list[tuple[str, str]]:
    """The report's state offload rows."""
    i, o, hb = r["inputs"], r["offload"], human_bytes
    return [
        ("offload: host memory per rank", hb(r["offload_host_bytes_per_rank"]) + " (per-token rows"
         + (" + their fp32 gradients)" if r["mode"] == "exact" else ")")),
        ("offload: device slots", hb(r["offload_slot_bytes_per_rank"]) + " (2 layers' rows, 1 if one is staged"
         + (" + gradients)" if r["mode"] == "exact" else ")")),
        ("offload: traffic per step", hb(r["offload_traffic_bytes_per_step"])
         + f" = {r['offload_transfer_time_s']:,.1f} s at {i['host_bandwidth_gbs']:g} GB/s  (H2D "
         + ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in o["h2d_bytes"].items()) + "; D2H "
         + ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in o["d2h_bytes"].items()) + ")"),
        ("offload: decode traffic per token", hb(r["offload_decode_bytes_per_token"])),
    ]


def _comm_rows(r: dict) -> list:
    """The time with communication, per phase (`comm.plan_comm`)."""
    i, rows = r["inputs"], []
    if r.get("gpu"):
        rows.append(("gpu preset", f"{r['gpu']}: {human_bytes(i['gpu_memory'])}, {i['throughput_tflops']:.1f} "
                                   f"TFLOP/s effective, links {i['intra_node_gbs']:g} / {i['inter_node_gbs']:g} "
                                   f"GB/s intra / inter-node, host {i['host_bandwidth_gbs']:g} GB/s (effective)"))
    for name, ph in r["comm"]["phases"].items():
        if name == "offload" or not (ph.get("compute_s") or ph.get("blocking_s") or ph.get("prefetched_s")):
            continue
        links = ", ".join(f"{human_bytes(v).split(' (')[0]} {k}" for k, v in ph["bytes_by_link"].items() if v)
        rows.append((f"  {name}", f"{ph['time_s']:,.1f} s = compute {ph['compute_s']:,.1f} + blocking comm "
                                  f"{ph['blocking_s']:,.1f} (prefetched {ph['prefetched_s']:,.1f})"
                                  + (f"; {links}" if links else "")))
    rows.append(("TIME with communication", f"{r['estimated_time_s']:,.1f} s  ({r['comm']['rule']})"))
    return rows


def format_report(r: dict) -> str:
    """The human-readable table of an `estimate` result."""
    i = r["inputs"]
    hb = human_bytes
    rows = [
        ("model", f"{r['model']} ({r['model_type']}, {r['num_layers']} layers: "
                  + ", ".join(f"{v} {k}" for k, v in r["layer_counts"].items()) + ")"),
        ("parameters", f"{r['num_parameters'] / 1e9:,.3f}B counted ({r['num_active_parameters'] / 1e9:,.3f}B active)"
         + (f"; published {r['num_parameters_published'] / 1e9:,.3f}B" if r["num_parameters_published"] else "")),
        ("trainable", f"{r['trainable_parameters']:,}" + (" (LoRA)" if i["lora_rank"] else " (full)")),
        ("step", f"P={i['prompt_tokens']:,}  G={i['group']}  R={i['response_tokens']:,}  mode={r['mode']}  "
                 f"W={i['gpus']}  dtype={r['dtype']}  weights={r['weight_dtype']}"),
        None,
        ("state per prompt token", f"{r['state_bytes_per_token']:,} B"),
        ("state, constant in P", hb(r["state_bytes_fixed"])),
        ("state, whole prompt", hb(r["state_bytes_total"])),
        ("state per rank", hb(r["state_bytes_per_rank"])),
    ]
    if i["offload_state"]:
        rows += _offload_rows(r)
    if i.get("images"):
        rows += [("images", f"{i['images']} x {i['image_tokens']:,} tokens: tower {r['vision_parameters'] / 1e6:,.1f}M "
                            f"params, {hb(r['vision_static_bytes'])} held (weights"
                            + (", grads, Adam" if not i["lora_rank"] else "") + ", rows), "
                            f"{hb(r['vision_working_bytes'])} for one image's tower")]
    rows += [
        None,
        ("weights per rank", hb(r["param_bytes"])),
        ("gradients per rank", hb(r["grad_bytes"])),
        ("optimizer per rank", hb(r["optimizer_bytes"])),
    ]
    if r["mode"] == "exact":
        rows += [("state gradient per rank", hb(r["state_grad_bytes_per_rank"])
                  + (" (its per-token part in host memory)" if i["offload_state"] else "")),
                 ("recurrent checkpoints per rank", hb(r["exact_checkpoint_bytes_per_rank"]))]
    rows += [
        ("working: capture (divided, layer by layer)" if r["divided_capture"] else "working: capture (1 chunk)",
         hb(r["capture_working_bytes"])),
        ("working: replay (1 branch)", hb(r["replay_working_bytes"])),
    ]
    if r["mode"] == "exact":
        rows.append(("working: recompute (1 chunk" + (", divided)" if r["divided_walk"] else ")"),
                     hb(r["recompute_working_bytes"])))
        if r["kept_graph_chunks"]:
            rows.append((f"kept capture graphs ({r['kept_graph_chunks']} of "
                         f"{r['kept_graph_chunks'] + r['recomputed_chunks']} chunks)", hb(r["kept_graph_bytes"])))
        if r["kept_attention_bytes_per_rank"]:
            rows.append(("kept attention outputs and LSEs", hb(r["kept_attention_bytes_per_rank"])))
    if r["gathered_param_bytes"]:
        rows.append(("gathered weights (FSDP2, 2 layers)", hb(r["gathered_param_bytes"])))
    if r.get("gathered_grad_bytes"):
        rows.append(("FSDP2 backward buffers (2 layers' grads, in replay / walk)", hb(r["gathered_grad_bytes"])))
    rows += [
        ("static per rank", hb(r["static_bytes_per_rank"])),
        ("PEAK per rank", f"{hb(r['peak_bytes_per_rank'])}  (during {r['peak_phase']})"),
        ("  each phase", ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in r["breakdown"]["phase_peak_bytes"].items())
         + ("" if i["grads_during_capture"] else "  (capture before any gradient exists)")),
        ("fits", f"{'yes' if r['fits'] else 'NO'}  (peak + {hb(r['reserve_bytes'])} reserve vs "
                 f"{hb(r['gpu_memory_bytes'])})"),
        None,
        ("capture traffic per rank", hb(r["capture_comm_bytes_per_rank"])),
        ("exact walk traffic per rank", hb(r["walk_comm_bytes_per_rank"]) if r["divided_walk"] else
         "not modelled (no divided walk)"),
        *([("expert-parallel traffic per rank", f"{hb(r['expert_comm_bytes_per_rank'])}  "
            f"({r['experts']['experts_per_rank']} of {r['experts']['experts']} experts per rank)")]
          if r["expert_parallel"] else []),
        ("time, detached", f"{r['estimated_time_s_detached']:,.1f} s"),
        ("time, exact", f"{r['estimated_time_s_exact']:,.1f} s"),
        ("  at", f"{i['throughput_tflops']:g} TFLOP/s effective per rank x {i['gpus']} rank(s)"),
    ]
    if i["offload_state"]:
        rows.append(("  offload transfer", f"{r['offload_transfer_time_s']:,.1f} s at {i['host_bandwidth_gbs']:g} "
                                           "GB/s (overlaps the step)"))
    if "comm" in r:
        rows += _comm_rows(r)
    width = max(len(row[0]) for row in rows if row)
    lines = [f"  {row[0]:<{width}}  {row[1]}" if row else "" for row in rows]
    lines += ["", "  assumptions:"] + [f"    - {a}" for a in r["assumptions"]]
    return "\n".join(lines)
