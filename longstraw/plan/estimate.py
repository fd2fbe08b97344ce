"""The capacity planner's estimate of one GRPO step: memory per rank (static + the largest
working set of capture, replay, recompute) and time from FLOPs, composed from sections
that each return a dataclass:

    config.resolve   -> Basis        the model's architecture, dtype bytes, the deal
    memory.plan_*    -> StatePlan, WeightPlan, ReplayPlan, CapturePlan, WalkPlan,
                        OffloadPlan, Peak
    timing.plan_time -> Timing       (tree_cost.tree_timing, .plan_tree_replay: PlanConfig.tree)
    report           -> the flat dict (and `format_report`, its table)

The architecture side (configs, presets, parameter counts) is in `arch.py`; communication
in `traffic.py`. Torch-free."""

from __future__ import annotations

from ..parallel.deal import walk_chunk_bounds
from .config import PlanConfig, resolve
from .memory import plan_capture, plan_replay, plan_state, plan_walk, plan_weights, score_working
from .offload import plan_offload
from .peak import plan_peak
from .report import build_report
from .comm import plan_comm
from .timing import plan_time
from .tree import takes_tree_path
from .tree_cost import plan_tree_replay, tree_report, tree_timing
from .vision import plan_vision, vision_report
from .generate import generate_report, plan_generate


def walk_chunk_count(s, walk) -> int:
    """Exact mode's walk chunks: a divided walk's cut (`parallel.deal.walk_chunk_bounds`: a
    short last chunk in which some rank owns no block joins the one before), else P - 1 in
    chunks of `walk.chunk`."""
    if walk.divided:
        return len(walk_chunk_bounds(s.P - 1, s.config.chunk_size, s.W, s.block,
                                     bool(s.arch.count(mixer="gdn"))))
    return -(-max(s.P - 1, 1) // walk.chunk)


def estimate(model, config: PlanConfig) -> dict:
    """Plan one GRPO step of `model` (preset name, config.json path, or config dict).

    Returns a flat dict of figures (bytes, FLOPs, seconds, booleans) plus 'breakdown',
    'inputs' and 'assumptions'. Memory figures named *_per_rank, and param / grad /
    optimizer / working bytes, are what one rank holds.
    """
    s = resolve(model, config)
    state = plan_state(s)
    weights = plan_weights(s)
    tree = takes_tree_path(config)  # the engine's tree path
    replay = plan_tree_replay(s, state) if tree else plan_replay(s, state)
    capture = plan_capture(s)
    walk = plan_walk(s, capture, replay.graph_tok)
    score = score_working(s)
    offload = plan_offload(s, state, replay, capture)
    vision = plan_vision(s)
    generate = plan_generate(s)
    peak = plan_peak(s, state, weights, replay, capture, walk, offload, score, vision, generate)
    timing = plan_time(s, divided=capture.divided, divided_walk=walk.divided, walk_chunk=walk.chunk,
                       held=replay.held, chunks=walk.chunks, kept_chunks=walk.kept_chunks, offload=offload.figures,
                       recompute=replay.recompute, walk_recompute=walk.recompute,
                       kept_outputs=bool(walk.kept_outputs))
    if tree:  # each shared segment once, plus a forward per segment with children
        timing = tree_timing(s, timing)
    thr = timing.throughput
    comm = plan_comm(s, capture_comm=capture.comm, walk_comm=walk.comm, divided_capture=capture.divided,
                     divided_walk=walk.divided, recompute=replay.recompute, walk_recompute=walk.recompute,
                     n_chunks=walk.chunks, walk_chunks=walk_chunk_count(s, walk) if s.exact else 0,
                     grad_bytes=weights.grad_bytes,
                     compute={"capture": timing.flops_capture / thr, "replay": s.G * timing.flops_branch / thr,
                              "walk": timing.flops_exact_extra / thr if s.exact else 0.0},
                     offload_s=timing.t_transfer,
                     offload_bytes=offload.figures["traffic_bytes"] if offload.figures else 0.0)
    report = build_report(s, state, weights, replay, capture, walk, offload, score, peak, timing)
    report.update(vision_report(vision))
    report.update(generate_report(generate))
    if vision is not None:
        report["assumptions"] += list(vision.assumptions)
    report["comm"] = comm.as_dict()
    report["estimated_time_s_compute"] = report["estimated_time_s"]
    report["estimated_time_s"] = comm.total_s
    report["gpu"] = config.gpu
    return {**report, "tree": tree_report(s)} if config.tree else report
