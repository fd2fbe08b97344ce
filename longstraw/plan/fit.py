"""The planner's search for a configuration that fits (`longstraw plan --fit`,
`ls.fit_config`): the fastest setting of the execution options whose peak per rank fits
the GPU's memory minus the reserve. Torch-free.

The space (each option the caller did not pin):
  * memory savers that cost time: layer-wise recompute (replay and the exact walk), state
    offload (`state_device="cpu"`), exact mode's snapshots on host, expert parallelism,
    parameter sharding (FSDP2), a replicated capture (`divide_capture=False`: chunked,
    where a divided capture holds a rank's share of each layer at once), a replicated
    exact walk (`divide_walk=False`: no gathered rows of the chunk's other ranks);
  * sizes: replay pieces (`branch_chunk_size`) and the capture chunk (`chunk_size`,
    512 to 16,384: exact mode's recurrent snapshots shrink as P / chunk);
  * exact mode's `keep_attention_outputs` and `keep_graph_bytes`, which spend spare memory
    to save the walk's attention forward and its whole recomputed forward;
  * `mode`, only when it is free (detached is always the faster).

How (a few dozen `estimate` calls, not the product of every option): every combination of
the on/off savers is planned once at the largest pieces and chunk (its fastest setting,
a lower bound on its time) and at the smallest pieces with every chunk (its leanest: the
peak falls with the pieces, but not with the chunk, since exact mode's recurrent snapshots
grow as P / chunk); a combination none of whose leanest settings fits is dropped. The rest are taken fastest first; each is
scanned from the largest pieces and chunk down to the first that fits, and the scan
stops when the next combination's lower bound is no faster than the best fit found.
The chosen plan then takes the largest capture chunk that raises neither its peak nor its
time (`free_larger_chunk`). Exact mode then tries to keep attention outputs, and capture
graphs in the memory left over.

"Fastest" is the planner's `estimated_time_s` (compute + communication by the overlap
rule of `comm.py`). Nothing fits: `NoFit` names the binding term (the leanest plan's peak
phase and its largest part) and the smallest changes that fit: more GPUs, a smaller P, a
GPU preset with more memory.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .arch import architecture, human_bytes, load_model_config, parse_bytes
from .. import defaults as d
from .config import PlanConfig, resolve
from .estimate import estimate
from .memory import batches_replay
from .gpus import load_gpus

SEARCHED = ("mode", "branch_chunk_size", "chunk_size", "recompute_layers", "offload_state", "offload_snapshots",
            "expert_parallel", "shard_params", "keep_graph_bytes", "keep_attention_outputs", "divide_capture",
            "divide_walk", "share_response_prefixes", "replay_batch")
"""The PlanConfig fields the search may set."""

PIECES = (8192, 4096, 2048, 1024, 512, 256)
CHUNKS = (16384, 8192, 4096, 2048, 1024, 512)
USUAL_CHUNK_MAX = 4096
"""The search scans chunks up to this (and the given one) first, largest first: a larger
capture chunk does not make the planner's step faster and holds a larger working set.
Exact mode then tries the larger ones of `CHUNKS`, smallest first, where none of those
fits: its recurrent snapshots shrink as P / chunk. Detached mode never (no snapshots)."""


def chunks_of(c: PlanConfig, chunks: list) -> list:
    """The chunks of `chunks` the search scans for configuration `c`, in scan order."""
    usual = [ch for ch in chunks if ch <= USUAL_CHUNK_MAX or ch == c.chunk_size]
    if c.mode != "exact":
        return usual or chunks
    return usual + sorted(set(chunks) - set(usual))


@dataclass
class Fit:
    """The chosen configuration.

    Fields:
        config: the PlanConfig that fits (every searched field explicit).
        report: its `estimate`.
        options: per option the search turned on (or changed): bytes saved and seconds
            it costs against the same plan without it (negative: it saves time).
        evaluated: plans estimated by the search.
    """

    config: PlanConfig
    report: dict
    options: list = field(default_factory=list)
    evaluated: int = 0


@dataclass
class NoFit:
    """Nothing fits: the binding term and the smallest changes that would fit.

    Fields:
        binding: the leanest plan's peak phase and its largest term, as text.
        suggestions: the changes that fit, as `longstraw plan` flags.
        leanest: the leanest plan's `estimate` (the smallest peak the search can reach).
        evaluated: plans estimated.
        changes: the same changes as PlanConfig fields, one dict each ({"gpus": 4,
            "shard_params": True}, {"prompt_tokens": 524288}, {"gpu": "h200"}), for callers
            that say them in their own terms (`ls.fit_config`: ExecConfig fields).
        leanest_config: the PlanConfig of `leanest`.
        smallest_memory: the least `gpu_memory` (bytes, the reserve included) at which
            the search fits, every pinned field kept.
    """

    binding: str
    suggestions: list
    leanest: dict
    evaluated: int = 0
    changes: list = field(default_factory=list)
    leanest_config: PlanConfig | None = None
    smallest_memory: int = 0


def _budget(c: PlanConfig) -> int:
    return c.gpu_memory - c.reserve


def _is_moe(model, c: PlanConfig) -> bool:
    return bool(resolve(model, replace(c, expert_parallel=False)).arch.experts)


def _savers(model, base: PlanConfig, pinned: set) -> list[dict]:
    """Every combination of the on/off options (and mode) the caller left free."""
    exact_ok = "mode" not in pinned or base.mode == "exact"
    choices = {}
    if "mode" not in pinned:
        choices["mode"] = ["detached", "exact"]
    if "recompute_layers" not in pinned:
        choices["recompute_layers"] = [False, True]
    if "offload_state" not in pinned:
        choices["offload_state"] = [False, True]
    if "offload_snapshots" not in pinned and exact_ok:
        choices["offload_snapshots"] = [None, True]
    if "expert_parallel" not in pinned and base.gpus >= 2 and _is_moe(model, base):
        choices["expert_parallel"] = [False, True]
    if "shard_params" not in pinned and base.gpus >= 2:
        choices["shard_params"] = [False, True]
    if "divide_capture" not in pinned and base.gpus >= 2:  # a divided capture holds a rank's share of a
        choices["divide_capture"] = [True, False]           # layer at once: at 10M tokens more than a chunk
    if "divide_walk" not in pinned and base.gpus >= 2 and exact_ok:  # a replicated walk holds no gathered rows
        choices["divide_walk"] = [True, False]
    if "share_response_prefixes" not in pinned and base.tree is not None:  # the caller says the responses
        choices["share_response_prefixes"] = [True, False]                 # share prefixes: tree or flat
    names = list(choices)
    combos = [dict(zip(names, values)) for values in itertools.product(*(choices[n] for n in names))]
    return [c for c in combos if not (c.get("mode", base.mode) == "detached"
                                      and (c.get("offload_snapshots") or c.get("divide_walk") is False))]


class _Planner:
    """`estimate` with a memo, counting calls."""

    def __init__(self, model):
        self.model, self.memo = model, {}

    def __call__(self, c: PlanConfig) -> dict:
        key = repr(c)
        if key not in self.memo:
            self.memo[key] = estimate(self.model, c)
        return self.memo[key]


def _fits(r: dict, budget: int) -> bool:
    return r["peak_bytes_per_rank"] <= budget


def search(model, base: PlanConfig, pinned=()) -> Fit | NoFit:
    """The fastest configuration of `base` (its `pinned` fields kept) whose peak fits
    `base.gpu_memory - base.reserve`, or `NoFit`."""
    pinned = set(pinned)
    plan, budget = _Planner(model), _budget(base)
    R = base.response_tokens
    pieces = ([base.branch_chunk_size] if "branch_chunk_size" in pinned else
              [None] + [p for p in PIECES if p < R])
    chunks = [base.chunk_size] if "chunk_size" in pinned else sorted(set(CHUNKS) | {base.chunk_size}, reverse=True)
    candidates = []  # (lower-bound time, combo)
    for combo in _savers(model, base, pinned):
        cfg = replace(base, **combo)
        if cfg.offload_state and cfg.keep_graph_bytes:
            continue
        mine = chunks_of(cfg, chunks)
        if not any(_fits(plan(replace(cfg, branch_chunk_size=pieces[-1], chunk_size=ch)), budget)
                   for ch in reversed(mine)):  # the smallest chunk first: usually the leanest
            continue
        fast = plan(replace(cfg, branch_chunk_size=pieces[0], chunk_size=mine[0]))
        candidates.append((fast["estimated_time_s"], combo))
    candidates.sort(key=lambda x: x[0])
    fitting, fastest = [], float("inf")  # (time, config, report): each combo's first fitting pieces and chunk
    for bound, combo in candidates:
        if bound > fastest * (1 + TIME_TIE):
            break
        cfg = replace(base, **combo)
        for p, ch in itertools.product(pieces, chunks_of(cfg, chunks)):
            c = replace(cfg, branch_chunk_size=p, chunk_size=ch)
            r = plan(c)
            if _fits(r, budget):
                fitting.append((r["estimated_time_s"], c, r))
                fastest = min(fastest, r["estimated_time_s"])
                break
    if not fitting:
        return _no_fit(model, base, pinned, plan, pieces, chunks)
    _, c, r = _simplest_of_the_fastest(fitting, R, base.prompt_tokens)
    if "chunk_size" not in pinned:
        c, r = free_larger_chunk(plan, c, r)
    # kept attention outputs and capture graphs: not with generate, whose capture (the state the
    # step reuses) keeps neither
    if c.mode == "exact" and not c.offload_state and not c.generate and "keep_attention_outputs" not in pinned:
        outputs = replace(c, keep_attention_outputs=True)  # the walk without a second attention over the prompt
        ro = plan(outputs)
        if _fits(ro, budget) and ro["estimated_time_s"] < r["estimated_time_s"]:
            c, r = outputs, ro
    if c.mode == "exact" and not c.offload_state and not c.generate and "keep_graph_bytes" not in pinned:
        spare = budget - r["peak_bytes_per_rank"]
        for share in (1.0, 0.5, 0.25):  # kept capture graphs in the memory left over
            kept = replace(c, keep_graph_bytes=int(spare * share) + c.keep_graph_bytes)
            rk = plan(kept)
            if _fits(rk, budget) and rk["estimated_time_s"] < r["estimated_time_s"]:
                c, r = _with_slack(plan, kept, rk), rk
                break
    c, r = batched_replay(model, plan, c, r, budget, pinned)
    return Fit(config=c, report=r, options=_option_costs(base, c, r, plan, pinned), evaluated=len(plan.memo))


TIME_TIE = 0.02
"""`search`: configurations planned within 2% of the fastest count as equally fast (the
planner's time model cannot tell them apart), and the simplest of them is chosen:
the fewest branch pieces, then the fewest capture chunks. GLM-5.2 on 32 ranks at the
paper's P planned pieces of 256 without layer recompute 0.6% faster than whole branches
with it: 32 times the replay's passes (and its rehearsal's ops) for a gain the model
cannot resolve."""


def _simplest_of_the_fastest(fitting: list, response_tokens: int, prompt_tokens: int) -> tuple:
    """The (time, config, report) of `fitting` within TIME_TIE of the fastest that replays in
    the fewest pieces and captures in the fewest chunks (then the fastest)."""
    fastest = min(t for t, _, _ in fitting)
    tied = [f for f in fitting if f[0] <= fastest * (1 + TIME_TIE)]
    return min(tied, key=lambda f: (-(-response_tokens // (f[1].branch_chunk_size or response_tokens)),
                                    -(-prompt_tokens // f[1].chunk_size), f[0]))


def free_larger_chunk(plan, c: PlanConfig, r: dict) -> tuple[PlanConfig, dict]:
    """The chosen plan at the largest capture chunk of `CHUNKS` above its own (and below P)
    whose plan is no higher at its peak and within TIME_TIE of its time; else the plan.

    The scan takes the largest chunk up to `USUAL_CHUNK_MAX` that fits, since a larger one
    holds a larger working set for no planned speed. Where another phase sets the peak
    (replay, the walk), the larger chunk's working set costs nothing, and it is simpler:
    P / chunk fewer capture and walk passes, fewer collectives a layer (a divided walk's
    gathers), fewer recurrent snapshots. Qwen3.6-27B exact on 8 H20s at the paper's P:
    chunks of 4,096 -> 8,192 at the same 70.30 GiB peak (replay's) and the same time; 16,384
    would lift the walk (70.36 GiB) above replay."""
    best = (c, r)
    for ch in sorted(x for x in CHUNKS if c.chunk_size < x < c.prompt_tokens):
        cand = replace(c, chunk_size=ch)
        rc = plan(cand)
        if (rc["peak_bytes_per_rank"] <= r["peak_bytes_per_rank"]
                and rc["estimated_time_s"] <= r["estimated_time_s"] * (1 + TIME_TIE)):
            best = (cand, rc)
    return best


REPLAY_BATCHES = (2, 4)
"""`replay_batch` values the search tries besides 1 and G (`batched_replay`)."""


def batched_replay(model, plan, c: PlanConfig, r: dict, budget: int, pinned) -> tuple[PlanConfig, dict]:
    """The chosen plan with the largest `replay_batch` of (G, 4, 2) that still fits, where
    the branches run in one piece on one rank and every mixer takes a batch (attention, MLA,
    GDN: not Mamba2 or KDA). The planned time counts FLOPs, which a batch does not change;
    a batch was measured faster on CPU (bench/results/replay_batch_*.csv: fewer, larger
    matmuls and less Python per branch), so the largest that fits is taken."""
    one_piece = (c.branch_chunk_size or c.response_tokens) >= c.response_tokens
    takes = batches_replay(architecture(load_model_config(model)[1]))
    stated = replace(c, replay_batch=int(r["replay_batch"]))  # the rule's choice (None), stated: what was planned
    if "replay_batch" in pinned or not one_piece or not takes or c.gpus > 1 or c.tree is not None or c.group < 2:
        return stated, r
    for b in sorted({c.group, *(x for x in REPLAY_BATCHES if x < c.group)}, reverse=True):
        rb = plan(replace(c, replay_batch=b))
        if _fits(rb, budget):
            return replace(c, replay_batch=b), rb
    return stated, r


GRAPH_SLACK = 0.05
"""A fit that keeps capture graphs sets `keep_graph_bytes` this share above the planned
graphs' bytes where that plans the same kept chunks and peak: the engine keeps what fits
its own measurement of a chunk's graph (chunk 0's saved tensors), which ran above the
planner's figure (tiny qwen3, fp32, P = 8,192, chunk 4,096: over 370 MB measured, 365 MB
planned), and a budget of exactly the planned bytes then kept one chunk fewer than planned
(`bench/results/exact_outputs_fit_pg_dense_loaded.csv`). The runtime reserve covers the slack."""


def _with_slack(plan, cfg: PlanConfig, r: dict) -> PlanConfig:
    """`cfg` with `keep_graph_bytes` raised to (1 + GRAPH_SLACK) x its planned kept graphs,
    where that plans the same kept chunks and the same peak; else `cfg`."""
    n = r["kept_graph_chunks"]
    if not n:
        return cfg
    slack = replace(cfg, keep_graph_bytes=max(cfg.keep_graph_bytes, int(r["kept_graph_bytes"] * (1 + GRAPH_SLACK))))
    rs = plan(slack)
    same = rs["kept_graph_chunks"] == n and rs["peak_bytes_per_rank"] == r["peak_bytes_per_rank"]
    return slack if same else cfg


def _leanest(plan, cfg: PlanConfig, pieces, chunks) -> tuple[PlanConfig, dict]:
    """`cfg` at its smallest pieces and the chunk of the smallest peak, and its plan."""
    leanest = None
    for ch in chunks_of(cfg, chunks):
        c = replace(cfg, branch_chunk_size=pieces[-1], chunk_size=ch)
        r = plan(c)
        if leanest is None or r["peak_bytes_per_rank"] < leanest[1]["peak_bytes_per_rank"]:
            leanest = (c, r)
    return leanest


def _option_costs(base: PlanConfig, chosen: PlanConfig, r: dict, plan, pinned: set) -> list[dict]:
    """Per free field the search set away from PlanConfig's default (recompute: away from
    off): the same plan with that field at its default, against the chosen one."""
    default = replace(PlanConfig(prompt_tokens=base.prompt_tokens), recompute_layers=False)
    out = []
    for name in SEARCHED:
        value, was = getattr(chosen, name), getattr(default, name)
        if name in pinned or value == was:
            continue
        other = plan(replace(chosen, **{name: was}))
        out.append({"option": name, "value": value, "bytes_saved": other["peak_bytes_per_rank"] - r["peak_bytes_per_rank"],
                    "time_cost_s": r["estimated_time_s"] - other["estimated_time_s"],
                    "without_fits": _fits(other, _budget(chosen))})
    return out


def _binding(r: dict) -> str:
    """The leanest plan's peak, named by phase and its largest part."""
    parts = {"weights": r["param_bytes"], "optimizer state": r["optimizer_bytes"], "gradients": r["grad_bytes"],
             "prompt state on the device": r["state_bytes_on_gpu_per_rank"],
             "state gradients": r["state_grad_bytes_per_rank"],
             "recurrent snapshots": r["exact_checkpoint_bytes_per_rank"],
             "gathered weights": r["gathered_param_bytes"]}
    phase = r["peak_phase"]
    working = r["peak_bytes_per_rank"] - r["static_bytes_per_rank"]
    parts[f"{phase} working set"] = working
    largest = max(parts, key=parts.get)
    return (f"{phase}: peak {human_bytes(r['peak_bytes_per_rank'])} even with every option on, > "
            f"{human_bytes(r['gpu_memory_bytes'] - r['reserve_bytes'])} (memory - reserve); largest term: {largest} "
            f"{human_bytes(parts[largest])} (static {human_bytes(r['static_bytes_per_rank'])} + {phase} working "
            f"{human_bytes(working)})")


def _no_fit(model, base: PlanConfig, pinned: set, plan, pieces, chunks) -> NoFit:
    """The binding term of the leanest plan and the smallest changes that fit."""
    lean_combo = {}
    for combo in _savers(model, base, pinned):  # the leanest combination: the smallest lean peak
        if combo.get("offload_state", base.offload_state) and base.keep_graph_bytes:
            continue
        c, r = _leanest(plan, replace(base, **combo), pieces, chunks)
        if not lean_combo or r["peak_bytes_per_rank"] < lean_combo["r"]["peak_bytes_per_rank"]:
            lean_combo = {"c": c, "r": r}
    lean, r = lean_combo["c"], lean_combo["r"]
    budget, suggestions, changes = _budget(base), [], []
    w = base.gpus * 2
    spread = {k: True for k in ("shard_params",) if k not in pinned}  # more GPUs: weights shard over them too
    if "expert_parallel" not in pinned and _is_moe(model, base):
        spread["expert_parallel"] = True
    while w <= 4096:  # more GPUs (the state shards over them)
        try:
            if _fits(plan(replace(lean, gpus=w, **spread)), budget):
                suggestions.append(f"--gpus {w}" + "".join(f" --{k.replace('_', '-')}" for k in spread))
                changes.append({"gpus": w, **spread})
                break
        except Exception:  # a config the planner refuses at this W
            pass
        w *= 2
    p = base.prompt_tokens // 2
    while p >= 1024 and p > lean.images * (lean.image_tokens + 2):  # a smaller prompt (that holds its images)
        if _fits(plan(replace(lean, prompt_tokens=p)), budget):
            suggestions.append(f"--prompt-tokens {p} (P halved until it fits)")
            changes.append({"prompt_tokens": p})
            break
        p //= 2
    for name, spec in sorted(load_gpus().items(), key=lambda kv: parse_bytes(kv[1].memory)):  # another GPU
        c = replace(lean, gpu_memory=spec.memory)
        if c.gpu_memory <= base.gpu_memory:
            continue
        if _fits(plan(c), c.gpu_memory - c.reserve):
            suggestions.append(f"--gpu {name} ({human_bytes(c.gpu_memory)})")
            changes.append({"gpu": name})
    smallest = math.ceil(r["peak_bytes_per_rank"]) + base.reserve  # the leanest plan fits from here on
    return NoFit(binding=_binding(r), suggestions=suggestions, leanest=r, evaluated=len(plan.memo), changes=changes,
                 leanest_config=lean, smallest_memory=smallest)


# ----------------------------------------------------------------------------
# what the chosen configuration is, as flags and as an ExecConfig


def flags(c: PlanConfig) -> list[str]:
    """The `longstraw plan` flags of every searched field's chosen value (explicit, so
    passed back they plan the same peak)."""
    onoff = {True: "on", False: "off"}
    out = ["--mode", c.mode, "--chunk-size", str(c.chunk_size)]
    if c.branch_chunk_size is not None:
        out += ["--branch-chunk-size", str(c.branch_chunk_size)]
    if c.recompute_layers is not None:
        out += ["--recompute-layers", onoff[c.recompute_layers]]
    if c.offload_snapshots is not None:
        out += ["--offload-snapshots", onoff[c.offload_snapshots]]
    out += [flag for name, flag in (("offload_state", "--offload-state"), ("expert_parallel", "--expert-parallel"),
                                    ("shard_params", "--shard-params")) if getattr(c, name)]
    if not c.divide_capture:
        out.append("--replicate-capture")
    if not c.divide_walk and c.mode == "exact":
        out.append("--replicate-walk")
    if c.tree is not None and not c.share_response_prefixes:
        out.append("--flat-responses")
    if c.keep_graph_bytes:
        out += ["--keep-graph-bytes", str(c.keep_graph_bytes)]
    if c.shard_block_size is not None:
        out += ["--shard-block-size", str(c.shard_block_size)]
    if c.keep_attention_outputs:
        out.append("--keep-attention-outputs")
    return out


def exec_config(c: PlanConfig) -> dict:
    """The `ExecConfig(...)` fields of the chosen plan (parameter sharding is FSDP2's
    `fully_shard`, outside ExecConfig: reported as 'fsdp2')."""
    return {"mode": c.mode, "chunk_size": c.chunk_size, "branch_chunk_size": c.branch_chunk_size,
            "attention_block_size": c.attention_block_size, "logits_chunk_size": c.logits_chunk_size,
            "recompute_layers": c.recompute_layers, "offload_snapshots": c.offload_snapshots,
            "state_device": "cpu" if c.offload_state else None, "expert_parallel": c.expert_parallel,
            "context_parallel": c.gpus > 1, "keep_graph_bytes": c.keep_graph_bytes,
            "keep_attention_outputs": c.keep_attention_outputs, "divide_capture": c.divide_capture, "divide_walk": c.divide_walk,
            "shard_block_size": c.shard_block_size, "share_response_prefixes": c.share_response_prefixes,
            "replay_batch": c.replay_batch}


def exec_config_text(c: PlanConfig) -> str:
    """`ExecConfig(...)` as Python source, fields away from ExecConfig's defaults only."""
    default = {"mode": d.MODE, "chunk_size": d.CHUNK_SIZE, "branch_chunk_size": d.BRANCH_CHUNK_SIZE,
               "attention_block_size": d.ATTENTION_BLOCK_SIZE, "logits_chunk_size": d.LOGITS_CHUNK_SIZE,
               "recompute_layers": d.RECOMPUTE_LAYERS, "offload_snapshots": d.OFFLOAD_SNAPSHOTS,
               "state_device": None, "expert_parallel": False, "context_parallel": False,
               "keep_graph_bytes": d.KEEP_GRAPH_BYTES, "keep_attention_outputs": d.KEEP_ATTENTION_OUTPUTS,
               "divide_capture": d.DIVIDE_CAPTURE,
               "divide_walk": d.DIVIDE_WALK, "shard_block_size": None,
               "share_response_prefixes": d.SHARE_RESPONSE_PREFIXES, "replay_batch": d.REPLAY_BATCH}
    fields = ", ".join(f"{k}={v!r}" for k, v in exec_config(c).items() if v != default[k])
    return f"ExecConfig({fields})" + ("  + FSDP2 fully_shard of the decoder layers" if c.shard_params else "")


def fit_report(result: Fit | NoFit) -> dict:
    """The report's "fit" entry (or "fit": None with "binding" and "suggestions")."""
    if isinstance(result, NoFit):
        return {"fit": None, "binding": result.binding, "suggestions": result.suggestions,
                "smallest_gpu_memory_bytes": result.smallest_memory, "evaluated": result.evaluated}
    c, r = result.config, result.report
    return {"fit": {"flags": flags(c), "exec_config": exec_config(c), "fsdp2": c.shard_params,
                    "peak_bytes_per_rank": int(r["peak_bytes_per_rank"]), "time_s": float(r["estimated_time_s"]),
                    "options": result.options, "evaluated": result.evaluated}}


def format_fit(result: Fit | NoFit) -> str:
    """The text report's fit section."""
    if isinstance(result, NoFit):
        lines = ["  FIT: nothing fits", f"    binding: {result.binding}",
                 f"    smallest --gpu-memory that fits: {result.smallest_memory} ({result.smallest_memory / 2**30:.4g} "
                 f"GiB, the --reserve included; every flag given kept)"]
        lines += [f"    would fit: {s}" for s in result.suggestions] or ["    no change tried fits"]
        return "\n".join(lines)
    c, r = result.config, result.report
    lines = [f"  FIT: {' '.join(flags(c))}",
             f"    {exec_config_text(c)}",
             f"    peak {human_bytes(r['peak_bytes_per_rank'])} per rank (during {r['peak_phase']}), time "
             f"{r['estimated_time_s']:,.1f} s ({result.evaluated} plans searched)"]
    for o in result.options:
        lines.append(f"    {o['option']}={o['value']!r}: saves {human_bytes(o['bytes_saved'])}, costs "
                     f"{o['time_cost_s']:+,.1f} s" + ("" if o["without_fits"] else " (needed to fit)"))
    return "\n".join(lines)
