"""One GRPO step (or one prompt pass) on a tiny model, CPU, float32: LongStraw's modes
against the Hugging Face baselines, every measurement in a fresh subprocess.

Methods (`--methods`)
---------------------
* `detached`: `Engine(model, ExecConfig(chunk_size=C)).step(group)`: capture the prompt
  once under no_grad, replay the G branches one at a time against the detached state.
* `exact`: the same with `mode="exact"` and `chunk_size=--exact-chunk-size` (default
  1024): the full-sequence gradient, by recomputing capture chunks in reverse. Its peak
  is one chunk's autograd graph, so the chunk must be well below P.
  Its `keep_attention_outputs` is the default (None): on CPU's fused kernel it keeps the
  outputs (`defaults.keeps_attention_outputs`; `kept_attention_bytes` > 0 in the row).
* `exact_outputs`: exact mode with `keep_attention_outputs=True`: capture keeps each
  attention layer's output and LSE, and the walk runs attention's backward from them
  instead of attending over the prompt again.
* `exact_recompute`: exact mode with `keep_attention_outputs=False`: the walk attends over
  the prompt again (the default before the kept outputs were).
* `exact_kept`: exact mode with `keep_graph_bytes=--keep-graph-bytes` (default: all):
  capture keeps the chunks' graphs that fit and the reverse walk recomputes only the rest.
* `exact_fit_pg`: exact mode with the `ExecConfig` that `ls.fit_config(model,
  memory_budget=B, mode="exact", prompt_tokens=P, group=G, response_tokens=R)` returns, B =
  Prefix Grouper's peak above the model measured earlier in the same invocation (the
  median of its runs so far at this P and G: list `prefix_grouper` before it), or that of
  `--fit-budget-from` (e.g. `batched`, for the families Prefix Grouper does not run). "At equal
  memory, faster": the search may spend B on kept capture graphs. It runs before the clock.
* `exact_blockwise`: exact mode with the fused flash kernels off (`ops/flash.FUSED_ENABLED
  = False`): every attention through the blockwise torch kernel, as before the fused path.
* `naive`: per branch, one full-sequence HF forward + backward over prompt + response
  (`tests.reference.hf_full_logprobs`, logits_to_keep=R+1), that branch's share of the
  DAPO loss, backward, free: G sequential full sequences.
* `batched`: all G sequences (prompt + response, equal lengths, no padding) in ONE
  batched HF forward + backward (logits_to_keep=R+1), the group's DAPO loss: what TRL does.
* `prefix_grouper` (dense families only): the published exact shared-prefix method
  (PyPI `prefix-grouper`, `bench/requirements.txt`): one packed sequence
  [prompt, r_1, ..., r_G] through HF with its registered `prefix_grouper_attention`;
  the prompt runs once with autograd, every response attends to it. Its attention
  kwarg `prefix_grouper_attn_func` names the HF attention function it calls; it was
  written for `flash_attention_2` (2-D padding mask, causal aligned bottom-right), which
  has no CPU build, so we register an SDPA function with those semantics (see
  `_fa2_semantics_sdpa`). The lm_head runs only on the response positions (as
  logits_to_keep does for the other baselines).
* `capture`: `engine.capture(group.prompt)` alone (prompt[:-1], no grad).
* `hf_forward`: HF's own no-grad forward of the same prompt[:-1]:
  `model.model(ids, use_cache=False)` under `torch.no_grad()`.

The baselines' log-probs and loss come from `tests/reference.py` (`hf_full_logprobs`,
`reference_grpo_loss`) so they never drift from what the tests check.

Measurement (as bench/bench_dense.py)
-------------------------------------
Each measurement is one subprocess (`--worker`): torch.set_num_threads(2) (env BENCH_THREADS), build
`longstraw.tiny.tiny_model(family, dtype=float32)` and
`tests.reference.uniform_group(4096, P, G, R, seed=0)`, gc.collect(), read RSS
(`rss_after_model`), run the method (time.perf_counter), read the peak RSS (ru_maxrss);
`peak_above_model = peak_rss - rss_after_model`. The driver never imports torch, so it
puts no floor under its children's ru_maxrss. Before each measurement the driver waits
until no other benchmark / test process runs (command lines matching
`bench_dense|/tmp/diag|pytest`, or another bench_step worker) and the 1-minute load
average is below 1.2. While a worker runs, the driver polls its RSS and kills it above
`--kill-rss-gib` (default 20 GiB; the machine has 24).

A measurement predicted (by extrapolating this CSV's earlier rows of the same family,
method and R along P or G) to need more than `--max-mem-gib` (16) or `--max-time-s`
(300 s) is skipped and recorded with the reason.

`--live-peak` adds, per measurement, one more fresh process that reruns it under
`torch.profiler(profile_memory=True)` for the peak of live torch tensors (allocator-
and runtime-neutral). `--dsa-timing` (glm_moe_dsa) times `indexer_topk` and the sparse
attention (forward and backward) in capture and replay by wrapping them in the worker.

Each measurement appends one CSV row to `--out` (with the machine); the driver prints a
table, ratios against `--ratio-to` (same family, P, G), and ends with one JSON line.

Usage:
    .venv/bin/python bench/bench_step.py --family qwen3_5 --methods detached exact naive \\
        --prompt-tokens 8192 --groups 2 8 --response-tokens 128 --out bench/out/hybrid_8k.csv
    .venv/bin/python bench/bench_step.py --selfcheck    # baselines agree with each other (small P)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `tests.reference` (the baselines) and `longstraw`
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model, machine_busy_s, mem_total, own_cpu_s, peak_rss, status_bytes  # noqa: E402  (torch-free)

METHODS = ("detached", "exact", "exact_outputs", "exact_recompute", "exact_kept", "exact_fit_pg", "exact_blockwise", "naive", "batched", "prefix_grouper",
           "capture", "hf_forward")
LONGSTRAW_STEPS = ("detached", "exact", "exact_outputs", "exact_recompute", "exact_kept", "exact_fit_pg", "exact_blockwise")
DENSE_FAMILIES = ("qwen3",)
THREADS = int(os.environ.get("BENCH_THREADS", "2"))  # torch threads per worker (1: a core of its own beside another job)
VOCAB = 4096
MIB, GIB = 2**20, 2**30
BUSY_PATTERN = re.compile(r"bench_dense|/tmp/diag|pytest")
PLAN_MODEL = {"qwen3": "tiny-qwen3",
              "qwen3_5": os.path.join(REPO, "bench", "results", "tiny_qwen3_5_config.json"),
              "glm_moe_dsa": os.path.join(REPO, "bench", "results", "tiny_glm_moe_dsa_config.json")}


# ============================================================================
# worker (one measurement, fresh process)


def _exec_kwargs(args, method: str) -> dict:
    if method == "exact_fit_pg":  # what fit_config chose (the worker fits before the clock starts)
        return dict(args.fit_exec)
    exact = method.startswith("exact")
    kw = {"chunk_size": args.exact_chunk_size if exact else args.chunk_size,
          "attention_block_size": args.attention_block_size, "logits_chunk_size": args.logits_chunk_size,
          "branch_chunk_size": args.branch_chunk_size}
    if exact:
        kw["mode"] = "exact"
    if method == "exact_kept":
        kw["keep_graph_bytes"] = args.keep_graph_bytes
    if getattr(args, "replay_batch", None) is not None:
        kw["replay_batch"] = args.replay_batch
    if method in ("exact_outputs", "exact_recompute"):
        kw["keep_attention_outputs"] = method == "exact_outputs"
    return kw


def _dapo_share(slots, group, grpo):
    from tests.reference import reference_grpo_loss

    return reference_grpo_loss(slots, group, loss_type=grpo.loss_type, epsilon_low=grpo.epsilon_low,
                               epsilon_high=grpo.epsilon_high, num_tokens=group.response_tokens)


def naive_step(model, group, grpo):
    """G full-sequence HF forwards + backwards, one branch at a time (graph freed between).
    Branch i's share of the group loss: `reference_grpo_loss` with branch i's live
    log-probs in slot i and constants elsewhere (same advantages, same divisor)."""
    import torch

    from tests.reference import hf_full_logprobs

    kept = []
    for i, response in enumerate(group.responses):
        logp = hf_full_logprobs(model, group.prompt, response, grpo.temperature)  # (R,) with graph
        slots = [logp if j == i else torch.zeros(r.numel(), dtype=logp.dtype) for j, r in enumerate(group.responses)]
        _dapo_share(slots, group, grpo).backward()
        kept.append(logp.detach())
        del logp, slots
    with torch.no_grad():
        return float(_dapo_share(kept, group, grpo)), {}


def batched_step(model, group, grpo):
    """All G prompt + response sequences in one batch [G, P + R] (TRL): one forward with
    logits_to_keep = R + 1, the group loss, one backward."""
    import torch

    from tests.reference import gather_logprobs

    lens = {int(r.numel()) for r in group.responses}
    assert len(lens) == 1, "batched: equal response lengths (no padding) only"
    r_len = lens.pop()
    ids = torch.stack([torch.cat([group.prompt, r]) for r in group.responses])  # (G, P + R)
    logits = model(ids, logits_to_keep=r_len + 1).logits[:, :-1]  # (G, R, V)
    logps = [gather_logprobs(logits[i], r, grpo.temperature) for i, r in enumerate(group.responses)]
    loss = _dapo_share(logps, group, grpo)
    loss.backward()
    return float(loss.detach()), {}


_FA2_LIKE = "longstraw_bench_fa2_semantics_sdpa"


def _fa2_semantics_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """HF's SDPA attention with flash_attention_2's calling convention, which prefix-grouper
    assumes: `attention_mask` is a 2-D [batch, keys] padding mask (True = token) and the
    causal mask is aligned bottom-right when there are fewer queries than keys (the
    responses' queries see the whole prompt, then their own causal part). Equal lengths:
    no padding, so the padding mask is all True (asserted)."""
    import torch

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        assert attention_mask.dim() == 2 and bool(attention_mask.all()), "padding is not supported here"
    lq, lk = query.shape[2], key.shape[2]
    kwargs.pop("is_causal", None)
    if lq == lk:  # the prompt part: plain causal (is_causal=True, torch's fused kernel)
        return sdpa_attention_forward(module, query, key, value, None, *args, is_causal=True, **kwargs)
    pos_q = torch.arange(lk - lq, lk, device=query.device)
    allowed = torch.arange(lk, device=query.device)[None, :] <= pos_q[:, None]  # (Lq, Lk) bottom-right causal
    return sdpa_attention_forward(module, query, key, value, allowed[None, None], *args, is_causal=False, **kwargs)


def prefix_grouper_step(model, group, grpo):
    """prefix-grouper (PyPI `prefix-grouper`) through its public API: `PrefixGrouper(group_info)`
    describes one packed sequence [prompt (P), r_1 (R), ..., r_G (R)]; the model runs with
    `attn_implementation="prefix_grouper_attention"` (registered by
    `prefix_grouper.utils.register_transformers.register_attention`) and the kwargs
    `prefix_grouper=..., prefix_grouper_attn_func=...`; `split_output(..., include_prefix_last=1)`
    gives each response's hidden states [G, R + 1, d] with the prompt's last position in
    front. Positions restart at P for every response."""
    import torch
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from tests.reference import gather_logprobs

    register_attention()
    AttentionInterface.register(_FA2_LIKE, _fa2_semantics_sdpa)
    # prefix-grouper ignores the mask HF builds; register none, so HF does not build an [L, L] one
    AttentionMaskInterface.register("prefix_grouper_attention", lambda *a, **k: None)
    model.set_attn_implementation("prefix_grouper_attention")

    p_len = int(group.prompt.numel())
    r_lens = [int(r.numel()) for r in group.responses]
    pg = PrefixGrouper([[p_len, *r_lens]], device=group.prompt.device)
    ids = torch.cat([group.prompt, *group.responses])[None]  # (1, P + sum R)
    pos = torch.cat([torch.arange(p_len)] + [torch.arange(p_len, p_len + n) for n in r_lens])[None]
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False, prefix_grouper=pg,
                         prefix_grouper_attn_func=_FA2_LIKE).last_hidden_state  # (1, L, d)
    _, _, suffix_h, suffix_mask = pg.split_output(hidden, include_prefix_last=1)  # (G, R + 1, d)
    assert bool(suffix_mask.all())
    logits = model.lm_head(suffix_h[:, :-1])  # (G, R, V): position t predicts response token t
    logps = [gather_logprobs(logits[i], r, grpo.temperature) for i, r in enumerate(group.responses)]
    loss = _dapo_share(logps, group, grpo)
    loss.backward()
    return float(loss.detach()), {}


def fit_exec(model, args) -> dict:
    """exact_fit_pg: `fit_config(model, memory_budget=B, mode="exact")` at this run's P, G,
    R, where B (`--fit-budget-bytes`) is Prefix Grouper's peak above the model measured
    earlier in the same invocation; the chosen ExecConfig as keyword arguments."""
    from dataclasses import fields

    import longstraw as ls

    cfg = ls.fit_config(model, memory_budget=int(args.fit_budget_bytes), prompt_tokens=args.worker_p,
                        group=args.worker_g, response_tokens=args.response_tokens, mode="exact")
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def longstraw_step(model, group, grpo, exec_kwargs):
    import longstraw as ls

    result = ls.Engine(model, ls.ExecConfig(**exec_kwargs)).step(group, grpo)
    return result.loss, result.metrics


def capture_only(model, group, exec_kwargs):
    import longstraw as ls

    state = ls.Engine(model, ls.ExecConfig(**exec_kwargs)).capture(group.prompt)
    nbytes = state.nbytes()
    del state
    return None, {"state_bytes": float(nbytes)}


def hf_forward_only(model, group):
    import torch

    with torch.no_grad():
        out = model.model(group.prompt[:-1][None], use_cache=False)
        del out
    return None, {}


def run_method(method, model, group, args):
    import longstraw as ls

    grpo = ls.GRPOConfig()
    if method == "exact_blockwise":  # exact mode through the blockwise torch kernel only (no fused flash)
        import longstraw.ops.flash as flash

        flash.FUSED_ENABLED = False
    if method in LONGSTRAW_STEPS:
        return longstraw_step(model, group, grpo, _exec_kwargs(args, method))
    if method == "naive":
        return naive_step(model, group, grpo)
    if method == "batched":
        return batched_step(model, group, grpo)
    if method == "prefix_grouper":
        return prefix_grouper_step(model, group, grpo)
    if method == "capture":
        return capture_only(model, group, _exec_kwargs(args, method))
    if method == "hf_forward":
        return hf_forward_only(model, group)
    raise ValueError(method)


def _install_dsa_timers() -> dict:
    """Wrap the DSA ops (indexer top-k; sparse attention forward and backward) with timers,
    split by phase (capture: inside Engine.capture; reverse: exact mode's walk back over the
    prompt; replay: the rest of the step, i.e. the branches)."""
    import longstraw.engine.engine as eng
    import longstraw.ops.dsa as dsa

    acc = {"phase": "replay"}

    def add(key, dt):
        k = f"{acc['phase']}_{key}"
        acc[k] = acc.get(k, 0.0) + dt

    topk_fn = dsa.indexer_topk

    def timed_topk(*a, **k):
        t0 = time.perf_counter()
        out = topk_fn(*a, **k)
        add("indexer_topk_s", time.perf_counter() - t0)
        n_q, n_keys = a[0].shape[0], sum(int(s.shape[0]) for s, _ in a[2]) + a[0].shape[0]
        add("indexer_calls", 1)
        add("indexer_query_key_pairs", float(n_q) * n_keys)
        if acc["phase"] == "replay":  # prompt rows a replayed query attends to
            valid = out >= 0
            add("topk_rows_selected", float(valid.sum()))
            add("topk_queries", float(out.shape[0]))
        return out

    dsa.indexer_topk = timed_topk
    cls = dsa.SparseLatentAttention
    fwd, bwd = cls.forward, cls.backward

    def timed_fwd(ctx, *a):
        t0 = time.perf_counter()
        out = fwd(ctx, *a)
        add("sparse_attn_fwd_s", time.perf_counter() - t0)
        return out

    def timed_bwd(ctx, *a):
        t0 = time.perf_counter()
        out = bwd(ctx, *a)
        add("sparse_attn_bwd_s", time.perf_counter() - t0)
        return out

    cls.forward, cls.backward = staticmethod(timed_fwd), staticmethod(timed_bwd)
    capture_fn = eng.Engine.capture

    def timed_capture(self, *a, **k):
        acc["phase"] = "capture"
        try:
            return capture_fn(self, *a, **k)
        finally:
            acc["phase"] = "replay"

    eng.Engine.capture = timed_capture
    walk_fn = eng.Engine.walk_back

    def timed_walk_back(self, *a, **k):
        if k.get("desc", "reverse") != "reverse":  # a branch's pieces: part of replay
            return walk_fn(self, *a, **k)
        acc["phase"] = "reverse"  # exact mode's reverse walk over the prompt chunks
        try:
            return walk_fn(self, *a, **k)
        finally:
            acc["phase"] = "replay"

    eng.Engine.walk_back = timed_walk_back
    return acc


def plan_run(family: str, mode: str, P: int, G: int, R: int, exec_kwargs: dict, *, first_group: bool,
             self_attention: str = "flash") -> tuple[dict, int]:
    """The capacity planner's report for one measured run (fp32, the run's chunk sizes), and
    what it predicts the process holds above the loaded model: its peak minus the weights
    (loaded before the baseline RSS) and the Adam state (no optimizer runs). `first_group`:
    the run starts from zero gradients (PlanConfig.grads_during_capture=False)."""
    from longstraw.plan import PlanConfig, estimate

    kw = exec_kwargs
    cfg = PlanConfig(prompt_tokens=P, group=G, response_tokens=R, mode=mode, dtype="float32",
                     chunk_size=kw["chunk_size"], attention_block_size=kw["attention_block_size"],
                     logits_chunk_size=kw["logits_chunk_size"], branch_chunk_size=kw["branch_chunk_size"],
                     self_attention=self_attention, grads_during_capture=not first_group,
                     keep_graph_bytes=kw.get("keep_graph_bytes", 0), recompute_layers=kw.get("recompute_layers"),
                     keep_attention_outputs=kw.get("keep_attention_outputs"), fused_backward=True)  # CPU's kernel
    r = estimate(PLAN_MODEL[family], cfg)
    return r, r["peak_bytes_per_rank"] - r["param_bytes"] - r["optimizer_bytes"]


def planner_prediction(args, method: str, params_model: int) -> dict:
    """The capacity planner's figures for this measurement (fp32, no optimizer)."""
    if method not in ("detached", "exact", "exact_outputs", "exact_recompute", "exact_kept", "exact_fit_pg"):
        return {}
    r, held = plan_run(args.family, "detached" if method == "detached" else "exact", args.worker_p, args.worker_g, args.response_tokens,
                       _exec_kwargs(args, method), first_group=False, self_attention=args.plan_self_attention)
    return {"plan_peak_bytes": r["peak_bytes_per_rank"], "plan_param_bytes": r["param_bytes"],
            "plan_grad_bytes": r["grad_bytes"], "plan_optimizer_bytes": r["optimizer_bytes"],
            "plan_state_bytes": r["state_bytes_per_rank"], "plan_state_grad_bytes": r["state_grad_bytes_per_rank"],
            "plan_checkpoint_bytes": r["exact_checkpoint_bytes_per_rank"],
            "plan_replay_working_bytes": r["replay_working_bytes"],
            "plan_capture_working_bytes": r["capture_working_bytes"],
            "plan_recompute_working_bytes": r["recompute_working_bytes"], "plan_peak_phase": r["peak_phase"],
            "plan_held_bytes": held, "plan_num_parameters": r["num_parameters"], "model_num_parameters": params_model}


def worker(args) -> dict:
    import gc

    import torch

    torch.set_num_threads(THREADS)
    from longstraw.tiny import TINY_CONFIGS, tiny_model
    from tests.reference import uniform_group

    method, P, G = args.worker_method, args.worker_p, args.worker_g
    model = tiny_model(args.family, dtype=torch.float32)
    group = uniform_group(VOCAB, P, G, args.response_tokens, seed=0)
    dsa = _install_dsa_timers() if args.dsa_timing else None
    if method == "exact_fit_pg":  # the planner's search runs before the clock starts
        args.fit_exec = fit_exec(model, args)
    if args.warmup:  # fault in the code paths (file-backed pages) before the baseline; drop its grads
        run_method(method, model, uniform_group(VOCAB, min(P, 512), G, args.response_tokens, seed=1), args)
        for p in model.parameters():
            p.grad = None
    gc.collect()
    if args.live_peak_worker:
        from live_peak import live_tensor_peak

        peak = live_tensor_peak(lambda: run_method(method, model, group, args))
        return {"live_tensor_peak": peak}
    rss_after_model = status_bytes("VmRSS")
    peak_before = peak_rss()
    anon0, file0 = status_bytes("RssAnon"), status_bytes("RssFile")
    load_1m = os.getloadavg()[0]
    busy0, own0 = machine_busy_s(), own_cpu_s()
    t0 = time.perf_counter()
    loss, metrics = run_method(method, model, group, args)
    step_time = time.perf_counter() - t0
    own_cpu = own_cpu_s() - own0
    foreign = max(0.0, machine_busy_s() - busy0 - own_cpu)
    peak = peak_rss()
    row = {
        "family": args.family, "method": method, "P": P, "G": G, "R": args.response_tokens, "dtype": "float32",
        "rss_after_model": rss_after_model, "peak_before_step": peak_before, "peak_rss": peak,
        "vm_hwm": status_bytes("VmHWM"), "peak_above_model": peak - rss_after_model,
        "baseline_hid_peak": peak_before >= peak, "rss_file_growth": status_bytes("RssFile") - file0,
        "rss_anon_retained": status_bytes("RssAnon") - anon0,
        "step_time_s": step_time, "cpu_time_s": own_cpu, "foreign_cpu_s": foreign, "loadavg_1m_before": load_1m,
        "time_capture_s": metrics.get("time_capture_s"), "time_replay_s": metrics.get("time_replay_s"),
        "time_reverse_s": metrics.get("time_reverse_s"), "state_bytes": metrics.get("state_bytes"),
        "state_grad_bytes": metrics.get("state_grad_bytes"), "loss": loss,
        "grad_bytes_allocated": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                    if p.grad is not None),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "warmup": bool(args.warmup),
        "malloc_env": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")),
    }
    if method in LONGSTRAW_STEPS + ("capture",):
        kw = _exec_kwargs(args, method)
        row.update(chunk_size=kw["chunk_size"], attention_block_size=kw["attention_block_size"],
                   logits_chunk_size=kw["logits_chunk_size"], branch_chunk_size=kw["branch_chunk_size"],
                   keep_graph_bytes=kw.get("keep_graph_bytes", 0), recompute_layers=kw.get("recompute_layers"),
                   keep_attention_outputs=kw.get("keep_attention_outputs"),
                   replay_batch=metrics.get("replay_batch", kw.get("replay_batch", 1)))  # the engine's choice
    if method == "exact_fit_pg":
        row["fit_budget_bytes"] = int(args.fit_budget_bytes)
        row["kept_chunks"] = metrics.get("kept_graph_chunks")
    if method in LONGSTRAW_STEPS:
        row["kept_attention_bytes"] = metrics.get("kept_attention_bytes")
    if args.family == "glm_moe_dsa":
        row["index_topk"] = TINY_CONFIGS["glm_moe_dsa"]["index_topk"]
    if dsa is not None:
        row.update({f"dsa_{k}": v for k, v in dsa.items() if k != "phase"})
    if args.grad_out:
        torch.save(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]), args.grad_out)
    try:
        row.update(planner_prediction(args, method, sum(p.numel() for p in model.parameters())))
    except Exception as exc:  # the planner is informational here
        row["plan_error"] = repr(exc)
    return row


def selfcheck(args) -> dict:
    """The baselines agree with each other and with exact mode (float32, small P): loss and
    gradient of naive, batched, prefix_grouper (dense), exact."""
    import torch

    torch.set_num_threads(THREADS)
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    out = {}
    for family in args.selfcheck_families:
        methods = ["naive", "batched", "exact"] + (["prefix_grouper"] if family in DENSE_FAMILIES else [])
        grads, losses = {}, {}
        for m in methods:
            model = tiny_model(family, dtype=torch.float32)
            group = uniform_group(VOCAB, 300, 3, 17, seed=1)
            sub = argparse.Namespace(**{**vars(args), "family": family})
            losses[m] = run_method(m, model, group, sub)[0]
            grads[m] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).double()
        ref = grads["naive"]
        out[family] = {m: {"loss": losses[m], "loss_naive": losses["naive"],
                           "grad_rel_diff_vs_naive": float((grads[m] - ref).norm() / ref.norm())} for m in methods}
    return out


# ============================================================================
# driver (no torch here)


def machine_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu, mem = cpu_model(), mem_total()
    return {"cpu": cpu, "nproc": os.cpu_count(), "threads": THREADS, "mem_total": mem,
            "python": platform.python_version(), "torch": ver("torch"), "transformers": ver("transformers"),
            "prefix_grouper": ver("prefix-grouper"), **code_info(REPO, short=True)}


def _other_heavy_processes() -> list[str]:
    me = os.getpid()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if BUSY_PATTERN.search(cmd) or ("bench_step.py" in cmd and "--worker" in cmd):
            found.append(f"{pid}: {cmd[:120]}")
    return found


def wait_for_quiet(max_wait_s: float, load_limit: float = 1.2) -> tuple[float, str]:
    """Wait until no other benchmark/test process runs and the 1-min load average is below
    load_limit. Returns (seconds waited, '' or why we stopped waiting)."""
    t0 = time.time()
    while True:
        others = _other_heavy_processes()
        load = os.getloadavg()[0]
        if not others and load < load_limit:
            return time.time() - t0, ""
        if time.time() - t0 > max_wait_s:
            return time.time() - t0, f"gave up waiting: load {load:.2f}, others {others}"
        time.sleep(5)


def run_worker(cmd: list[str], timeout_s: float, kill_rss: int) -> tuple[str, str, str]:
    """Run a worker, polling its RSS; returns (status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    t0, status, max_seen = time.time(), "ok", 0
    import threading

    out_chunks, err_chunks = [], []
    readers = [threading.Thread(target=lambda s=s, c=c: c.append(s.read()), daemon=True)
               for s, c in ((proc.stdout, out_chunks), (proc.stderr, err_chunks))]
    for r in readers:
        r.start()
    while proc.poll() is None:
        rss = status_bytes("VmRSS", proc.pid)
        max_seen = max(max_seen, rss)
        if rss > kill_rss:
            proc.kill()
            status = f"killed: RSS {rss / GIB:.1f} GiB > {kill_rss / GIB:.0f} GiB"
            break
        if time.time() - t0 > timeout_s:
            proc.kill()
            status = f"killed: ran past {timeout_s:.0f} s"
            break
        time.sleep(0.25)
    proc.wait()
    for r in readers:
        r.join()
    if status == "ok" and proc.returncode != 0:
        status = f"failed: exit {proc.returncode}"
    return status, "".join(out_chunks), "".join(err_chunks)


def _worker_cmd(args, method, P, G, live=False) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--family", args.family, "--worker-method", method,
           "--worker-p", str(P), "--worker-g", str(G), "--response-tokens", str(args.response_tokens),
           "--chunk-size", str(args.chunk_size), "--exact-chunk-size", str(args.exact_chunk_size),
           "--keep-graph-bytes", str(args.keep_graph_bytes), "--attention-block-size", str(args.attention_block_size),
           "--logits-chunk-size", str(args.logits_chunk_size), "--plan-self-attention", args.plan_self_attention]
    if args.branch_chunk_size:
        cmd += ["--branch-chunk-size", str(args.branch_chunk_size)]
    if args.replay_batch is not None:
        cmd += ["--replay-batch", str(args.replay_batch)]
    if args.dsa_timing and not live:
        cmd.append("--dsa-timing")
    if args.warmup:
        cmd.append("--warmup")
    if live:
        cmd.append("--live-peak-worker")
    if method == "exact_fit_pg":
        cmd += ["--fit-budget-bytes", str(args.fit_budget_bytes)]
    return cmd


CSV_FIELDS = [
    "tag", "family", "method", "P", "G", "R", "rep", "status", "note", "dtype", "chunk_size", "attention_block_size",
    "logits_chunk_size", "branch_chunk_size", "replay_batch", "keep_graph_bytes", "recompute_layers", "keep_attention_outputs",
    "fit_budget_bytes", "kept_chunks", "kept_attention_bytes", "rss_after_model", "peak_before_step", "peak_rss", "vm_hwm",
    "peak_above_model", "live_tensor_peak", "baseline_hid_peak", "rss_file_growth", "rss_anon_retained",
    "step_time_s", "time_capture_s", "time_replay_s", "time_reverse_s", "state_bytes", "state_grad_bytes",
    "grad_bytes_allocated", "param_bytes", "loss", "cpu_time_s", "foreign_cpu_s", "loadavg_1m_before",
    "waited_s", "index_topk", "dsa_capture_indexer_topk_s", "dsa_capture_sparse_attn_fwd_s",
    "dsa_replay_indexer_topk_s", "dsa_replay_sparse_attn_fwd_s", "dsa_replay_sparse_attn_bwd_s",
    "dsa_replay_topk_rows_selected", "dsa_replay_topk_queries", "dsa_replay_indexer_query_key_pairs",
    "dsa_capture_indexer_query_key_pairs", "dsa_reverse_indexer_topk_s", "dsa_reverse_sparse_attn_fwd_s",
    "dsa_reverse_sparse_attn_bwd_s", "plan_peak_bytes", "plan_held_bytes", "plan_param_bytes",
    "plan_grad_bytes", "plan_optimizer_bytes", "plan_state_bytes", "plan_state_grad_bytes", "plan_checkpoint_bytes",
    "plan_replay_working_bytes", "plan_capture_working_bytes", "plan_recompute_working_bytes", "plan_peak_phase",
    "plan_num_parameters", "model_num_parameters", "plan_error", "cpu", "threads", "torch", "transformers",
    "git_rev", "longstraw_dirty", "timestamp", "warmup", "malloc_env",
]


def _read_csv(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _append_csv(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path)
    if not new:  # an older file with other columns: rewrite it with today's header first
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != CSV_FIELDS:
            old = _read_csv(path)
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
                w.writeheader()
                w.writerows(old)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def predict(history: list[dict], family: str, method: str, R: int, P: int, G: int) -> tuple[float, float] | None:
    """(peak bytes, seconds) of (method, P, G) extrapolated from earlier ok rows of the same
    family / method / R at the same G (along P) or the same P (along G): peak affine in the
    varying size through the two largest points, time a power law (exponent clamped to
    [1, 2]). None when fewer than two such points exist."""
    def num(r, k):
        try:
            return float(r[k])
        except (KeyError, TypeError, ValueError):
            return None

    ok = [r for r in history if r.get("status") == "ok" and r.get("family") == family and r.get("method") == method
          and int(r["R"]) == R]
    best = None
    for axis, fixed, x in (("P", ("G", G), P), ("G", ("P", P), G)):
        pts = {}
        for r in ok:
            if int(r[fixed[0]]) == fixed[1] and int(r[axis]) < x:
                xi = int(r[axis])
                pk, t = num(r, "peak_above_model"), num(r, "step_time_s")
                if pk is None or t is None:
                    continue
                old = pts.get(xi)
                pts[xi] = (pk if old is None else max(pk, old[0]), t if old is None else min(t, old[1]))
        if len(pts) < 2:
            continue
        (x1, (m1, t1)), (x2, (m2, t2)) = sorted(pts.items())[-2:]
        slope = (m2 - m1) / (x2 - x1)
        mem = m2 + max(slope, 0.0) * (x - x2)
        b = math.log(max(t2, 1e-6) / max(t1, 1e-6)) / math.log(x2 / x1) if x2 != x1 else 1.0
        tm = t2 * (x / x2) ** min(2.0, max(1.0, b))
        best = (mem, tm) if best is None else (max(best[0], mem), max(best[1], tm))
    return best


def fmt_mib(v) -> str:
    try:
        return f"{float(v) / MIB:9.1f}"
    except (TypeError, ValueError):
        return f"{'-':>9s}"


def fmt_s(v) -> str:
    try:
        return f"{float(v):8.2f}"
    except (TypeError, ValueError):
        return f"{'-':>8s}"


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (family, method, P, G): median peak, fastest time (and that run's phases)."""
    by = {}
    for r in rows:
        by.setdefault((r["family"], r["method"], int(r["P"]), int(r["G"])), []).append(r)
    out = []
    for key, rs in by.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            out.append(dict(rs[-1], repeats=len(rs)))
            continue
        best = dict(min(ok, key=lambda r: float(r["step_time_s"])))
        best["peak_above_model"] = _median([float(r["peak_above_model"]) for r in ok])
        best["peak_above_model_all"] = [float(r["peak_above_model"]) for r in ok]
        best["step_time_all"] = [float(r["step_time_s"]) for r in ok]
        best["repeats"] = len(ok)
        out.append(best)
    return out


def measure(args, info: dict, rows: list[dict], method: str, P: int, G: int, rep: int) -> bool:
    """One measurement of `method` at (P, G) in a fresh worker (waiting for a quiet machine,
    rerun when contended): its row appended to `--out` and to `rows`, a line printed.
    False when it was skipped or failed (the driver then drops it from later rounds)."""
    R = args.response_tokens
    base = {"tag": args.tag, "family": args.family, "method": method, "P": P, "G": G, "R": R,
            "rep": rep, "dtype": "float32", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **{k: info[k] for k in ("cpu", "threads", "torch", "transformers", "git_rev",
                                    "longstraw_dirty")}}
    if method == "prefix_grouper" and args.family not in DENSE_FAMILIES:
        row = {**base, "status": "not applicable",
               "note": "prefix-grouper groups attention only; GDN/MLA layers are not supported"}
        _append_csv(args.out, row)
        rows.append(row)
        print(f"  {method:14s} P={P:<6d} G={G:<2d} not applicable", flush=True)
        return False
    if method == "exact_fit_pg":  # the budget: Prefix Grouper's peak above the model, measured in this run
        pg = [float(r["peak_above_model"]) for r in rows if r["method"] == args.fit_budget_from and r["P"] == P
              and r["G"] == G and r["status"] == "ok"]
        if not pg:
            row = {**base, "status": "skipped", "note": f"exact_fit_pg needs a {args.fit_budget_from} row of this P "
                                                        f"and G earlier in the same run (list it first)"}
            _append_csv(args.out, row)
            rows.append(row)
            print(f"  {method:14s} P={P:<6d} G={G:<2d} skipped: {row['note']}", flush=True)
            return False
        args.fit_budget_bytes = int(_median(pg))
    guess = predict(_read_csv(args.out) + rows, args.family, method, R, P, G)
    if guess and (guess[0] > args.max_mem_gib * GIB or guess[1] > args.max_time_s):
        row = {**base, "status": "skipped",
               "note": f"predicted {guess[0] / GIB:.1f} GiB, {guess[1]:.0f} s (limits "
                       f"{args.max_mem_gib:g} GiB, {args.max_time_s:g} s)"}
        _append_csv(args.out, row)
        rows.append(row)
        print(f"  {method:14s} P={P:<6d} G={G:<2d} skipped: {row['note']}", flush=True)
        return False
    for attempt in range(1 + args.retry_contended):
        waited, why = wait_for_quiet(args.wait_max_s)
        status, out, err = run_worker(_worker_cmd(args, method, P, G), args.timeout_s,
                                      int(args.kill_rss_gib * GIB))
        row = {**base, "status": status, "waited_s": round(waited, 1), "note": why}
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if status == "ok" and lines:
            row.update(json.loads(lines[-1]))
        else:
            tail = err.strip().splitlines()[-3:]
            row["note"] = (why + " " + " | ".join(tail)).strip()[:500]
            break
        if row["foreign_cpu_s"] <= 0.1 * row["step_time_s"]:
            break
        row["note"] = (f"other processes used {row['foreign_cpu_s']:.1f} cpu-s during the step"
                       + ("; rerun" if attempt < args.retry_contended else "; kept")).strip()
        print(f"  {method:14s} P={P:<6d} G={G:<2d} [{rep}] contended ({row['note']})", flush=True)
    if status == "ok" and args.live_peak:
        wait_for_quiet(args.wait_max_s)
        s2, out2, _ = run_worker(_worker_cmd(args, method, P, G, live=True), args.timeout_s,
                                 int(args.kill_rss_gib * GIB))
        l2 = [ln for ln in out2.splitlines() if ln.startswith("{")]
        if s2 == "ok" and l2:
            row["live_tensor_peak"] = json.loads(l2[-1])["live_tensor_peak"]
    _append_csv(args.out, row)
    rows.append(row)
    if status == "ok":
        extra = ""
        if row.get("time_capture_s") is not None:
            extra = (f" capture {float(row['time_capture_s']):.2f}s replay "
                     f"{float(row['time_replay_s']):.2f}s")
            if row.get("time_reverse_s"):
                extra += f" reverse {float(row['time_reverse_s']):.2f}s"
        if row.get("live_tensor_peak"):
            extra += f" live {float(row['live_tensor_peak']) / MIB:.1f} MiB"
        print(f"  {method:14s} P={P:<6d} G={G:<2d} [{rep}] peak above model "
              f"{row['peak_above_model'] / MIB:8.1f} MiB  time {row['step_time_s']:8.2f} s{extra}"
              f"  (other cpu {row['foreign_cpu_s']:.1f} s, waited {waited:.0f} s)", flush=True)
        return True
    print(f"  {method:14s} P={P:<6d} G={G:<2d} [{rep}] {status}: {row['note'][:300]}", flush=True)
    return False



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_5", choices=("qwen3", "qwen3_5", "glm_moe_dsa"))
    p.add_argument("--methods", nargs="+", default=["detached", "naive"], choices=METHODS)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192], help="P values")
    p.add_argument("--groups", type=int, nargs="+", default=[2], help="G values")
    p.add_argument("--response-tokens", type=int, default=128, help="R")
    p.add_argument("--chunk-size", type=int, default=4096, help="ExecConfig.chunk_size (detached, capture)")
    p.add_argument("--exact-chunk-size", type=int, default=1024,
                   help="ExecConfig.chunk_size for exact mode (its peak is one chunk's graph: keep it well below P)")
    p.add_argument("--keep-graph-bytes", type=int, default=1 << 40,
                   help="ExecConfig.keep_graph_bytes of method exact_kept (default: every chunk's graph is kept)")
    p.add_argument("--attention-block-size", type=int, default=1024)
    p.add_argument("--logits-chunk-size", type=int, default=1024)
    p.add_argument("--branch-chunk-size", type=int, default=None)
    p.add_argument("--replay-batch", type=int, default=None,
                   help="ExecConfig.replay_batch for every LongStraw arm but exact_fit_pg (default: ExecConfig's)")
    p.add_argument("--repeat", type=int, default=1, help="rounds: every method once per round, alternating (median peak, min time)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "out", "step.csv"), help="CSV to append rows to")
    p.add_argument("--tag", default="", help="label stored in every row of this invocation")
    p.add_argument("--ratio-to", default="detached", help="method the printed ratios divide by")
    p.add_argument("--max-mem-gib", type=float, default=16.0, help="skip a measurement predicted above this")
    p.add_argument("--max-time-s", type=float, default=300.0, help="skip a measurement predicted above this")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="kill a worker after this long")
    p.add_argument("--kill-rss-gib", type=float, default=20.0, help="kill a worker whose RSS exceeds this")
    p.add_argument("--wait-max-s", type=float, default=3600.0, help="wait at most this long for a quiet machine")
    p.add_argument("--retry-contended", type=int, default=2,
                   help="rerun a measurement up to N times when other processes used > 10%% of its wall time")
    p.add_argument("--live-peak", action="store_true", help="also measure the live-tensor peak (extra process)")
    p.add_argument("--warmup", action="store_true",
                   help="run the method once at P = 512 before the baseline RSS (gradients dropped after)")
    p.add_argument("--dsa-timing", action="store_true", help="time the DSA ops in capture / replay (glm_moe_dsa)")
    p.add_argument("--plan-self-attention", default="flash", choices=("flash", "dense", "fused-nograd"))
    p.add_argument("--selfcheck", action="store_true", help="check the baselines against each other, small P")
    p.add_argument("--selfcheck-families", nargs="+", default=["qwen3", "qwen3_5"])
    # internal
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--live-peak-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-method", help=argparse.SUPPRESS)
    p.add_argument("--worker-p", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-g", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grad-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fit-budget-from", default="prefix_grouper", choices=METHODS,
                   help="exact_fit_pg's budget: this method's peak above the model, measured earlier in the run")
    p.add_argument("--fit-budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.selfcheck:
        print(json.dumps(selfcheck(args)))
        return 0

    info = machine_info()
    R = args.response_tokens
    print(f"bench_step | tiny {args.family}, float32, CPU {info['cpu']} ({info['nproc']} cores), {THREADS} threads, "
          f"torch {info['torch']}, transformers {info['transformers']}, longstraw {info['git_rev']}"
          + (" (+uncommitted longstraw/)" if info["longstraw_dirty"] else ""))
    print(f"methods {args.methods} | P {args.prompt_tokens} | G {args.groups} | R {R} | chunk {args.chunk_size} "
          f"(exact {args.exact_chunk_size}) | attention block {args.attention_block_size} | logits chunk "
          f"{args.logits_chunk_size} | branch chunk {args.branch_chunk_size} | repeat {args.repeat}", flush=True)

    rows, dead = [], set()  # dead: (P, G, method) skipped or failed, not rerun in later rounds
    for P in args.prompt_tokens:
        for G in args.groups:
            for rep in range(args.repeat):  # alternating rounds: every method once per round
                for method in args.methods:
                    if (P, G, method) not in dead and not measure(args, info, rows, method, P, G, rep):
                        dead.add((P, G, method))
    agg = aggregate(rows)
    print()
    hdr = (f"{'method':14s} {'P':>7s} {'G':>3s} {'status':>8s} {'peak>model MiB':>15s} {'state MiB':>9s} "
           f"{'time s':>8s} {'capture':>8s} {'replay':>8s} {'reverse':>8s} {'x peak':>7s} {'x time':>7s}")
    print(hdr)
    print("-" * len(hdr))
    base = {(r["P"], r["G"]): r for r in agg if r["method"] == args.ratio_to and r["status"] == "ok"}
    for r in sorted(agg, key=lambda r: (int(r["P"]), int(r["G"]), METHODS.index(r["method"]))):
        b = base.get((r["P"], r["G"]))
        xp = xt = f"{'-':>7s}"
        if b is not None and r["status"] == "ok":
            xp = f"{float(r['peak_above_model']) / float(b['peak_above_model']):7.2f}"
            xt = f"{float(r['step_time_s']) / float(b['step_time_s']):7.2f}"
            r["peak_ratio_to_" + args.ratio_to] = float(r["peak_above_model"]) / float(b["peak_above_model"])
            r["time_ratio_to_" + args.ratio_to] = float(r["step_time_s"]) / float(b["step_time_s"])
        ok = r["status"] == "ok"
        print(f"{r['method']:14s} {int(r['P']):7d} {int(r['G']):3d} {r['status'][:8]:>8s} "
              f"{fmt_mib(r.get('peak_above_model') if ok else None):>15s} {fmt_mib(r.get('state_bytes')):>9s} "
              f"{fmt_s(r.get('step_time_s') if ok else None)} {fmt_s(r.get('time_capture_s'))} "
              f"{fmt_s(r.get('time_replay_s'))} {fmt_s(r.get('time_reverse_s'))} {xp} {xt}")
    print(f"(x peak / x time: against {args.ratio_to} at the same P and G; repeats: median peak, fastest time)")
    print(f"rows appended to {os.path.relpath(os.path.abspath(args.out), os.getcwd())}")
    print(json.dumps({"bench": "step", "family": args.family, "machine": info, "R": R,
                      "exec": {"chunk_size": args.chunk_size, "exact_chunk_size": args.exact_chunk_size,
                               "attention_block_size": args.attention_block_size,
                               "logits_chunk_size": args.logits_chunk_size,
                               "branch_chunk_size": args.branch_chunk_size},
                      "rows": agg}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
