"""Worker processes for tests/parallel/test_experts.py (spawned, gloo, CPU, float64).

Each rank builds the same tiny MoE model twice: one copy keeps every expert (context
parallelism as today, the replicated MoE), the other is built into an expert-parallel
engine (each rank keeps its slice of the experts). Step (loss and every gradient, the
experts' gathered from their owners), score and greedy generation must agree to 1e-9.
"""

from __future__ import annotations

import copy

import torch

import longstraw as ls
from longstraw.parallel.experts import SHARD_ATTR, expert_bounds
from tests.distributed_worker import CASES, _init, all_gather_tensors
from tests.reference import assert_grads_close, float64_throughout, grads_of, random_group, tiny_family

KW = dict(chunk_size=6, attention_block_size=4, shard_block_size=3)
# three layers, so that an MoE layer's capture output reaches a later layer's state
MODELS = {"glm_sparse": CASES["glm_sparse"],  # GLM-5 (glm_moe_dsa), sparse DSA: layers 1-2 MoE
          "qwen3_moe": lambda: tiny_family("qwen3_moe", num_hidden_layers=3),  # layers 1-2 MoE
          "mixtral": lambda: tiny_family("mixtral", num_hidden_layers=3),
          "qwen3_moe_batched": lambda: _batched(tiny_family("qwen3_moe", num_hidden_layers=3))}


def _batched(model):
    """HF's batched_mm experts forward (grouped_mm, the GPU default, takes no float64)."""
    model.config._experts_implementation = "batched_mm"
    return model


def whole_grads(model) -> dict:
    """Every parameter's gradient; an expert slice's gathered from every rank into the
    whole [E, ..] gradient (a rank whose experts no token chose contributes zeros)."""
    out = {}
    for name, p in model.named_parameters():
        shard = getattr(p, SHARD_ATTR, None)
        if shard is None:
            out[name] = None if p.grad is None else p.grad.detach().clone()
            continue
        lo, hi, experts, world = shard
        most = max(b - a for a, b in (expert_bounds(experts, world, r) for r in range(world)))
        mine = torch.zeros(most, *p.shape[1:], dtype=p.dtype)
        if p.grad is not None:
            mine[: hi - lo] = p.grad
        parts = all_gather_tensors(mine)
        out[name] = torch.cat([part[: b - a] for part, (a, b) in
                               zip(parts, (expert_bounds(experts, world, r) for r in range(world)))])
    return out


def run_expert_parallel(rank: int, world: int, init_file: str, cases: list[str], modes: list[str],
                        divide: bool = True, flag_dir: str | None = None) -> None:
    """`cases` against the replicated MoE (see the module docstring); with `flag_dir`, the
    refusals of `refusals` first, in the same processes."""
    _init(rank, world, init_file)
    try:
        if flag_dir is not None:
            refusals(rank, flag_dir)
        for name in cases:
            model = MODELS[name]()
            sharded = copy.deepcopy(model)
            group = random_group(97, 23, [5, 1, 7], seed=3)
            kw = dict(KW, context_parallel=True, divide_capture=divide, divide_walk=divide)
            with float64_throughout(model):
                for mode in modes:
                    model.zero_grad(set_to_none=True)
                    sharded.zero_grad(set_to_none=True)
                    want = ls.Engine(model, ls.ExecConfig(mode=mode, **kw)).step(group)
                    engine = ls.Engine(sharded, ls.ExecConfig(mode=mode, expert_parallel=True, **kw))
                    got = engine.step(group)
                    assert abs(got.loss - want.loss) <= 1e-9 * abs(want.loss) + 1e-13, (name, mode)
                    assert_grads_close(whole_grads(sharded), grads_of(model), 1e-9)
                _check_slices(sharded, world, rank)
                ref = ls.Engine(model, ls.ExecConfig(**kw))
                for a, b in zip(engine.score(group), ref.score(group)):
                    assert (a - b).abs().max() <= 1e-9, (name, a, b)
                greedy = dict(num_samples=2, max_new_tokens=6, temperature=0.0)
                mine, theirs = engine.generate(group.prompt, **greedy), ref.generate(group.prompt, **greedy)
                for a, b, la, lb in zip(mine.responses, theirs.responses, mine.logprobs, theirs.logprobs):
                    assert torch.equal(a, b), (name, a, b)
                    assert (la - lb).abs().max() <= 1e-9, (name, la, lb)
    finally:
        torch.distributed.destroy_process_group()


def _check_slices(model, world: int, rank: int) -> None:
    """Each rank holds only its experts [r E // W, (r+1) E // W) of each MoE layer."""
    from longstraw.models.experts import experts_modules

    found = experts_modules(model)
    assert found
    for _, module in found:
        lo, hi, experts, _ = module._longstraw_experts
        assert (lo, hi) == expert_bounds(experts, world, rank) and module.num_experts == hi - lo
        for p in module.parameters(recurse=False):
            assert p.shape[0] == hi - lo, p.shape


def refusals(rank: int, flag_dir: str) -> None:
    """Fewer experts than ranks, and a model without experts: a ConfigError when the
    engine is built, on every rank, before any work, and the model is left whole (each
    rank writes its message to flag_dir)."""
    model = tiny_family("qwen3_moe", num_experts=2)  # 2 experts for 3 ranks
    before = [p.shape for p in model.parameters()]
    try:
        ls.Engine(model, ls.ExecConfig(context_parallel=True, expert_parallel=True))
    except ls.ConfigError as exc:
        open(f"{flag_dir}/rank{rank}.err", "w").write(str(exc))
    assert [p.shape for p in model.parameters()] == before
    try:
        ls.Engine(CASES["dense"](), ls.ExecConfig(context_parallel=True, expert_parallel=True))
    except ls.ConfigError as exc:
        open(f"{flag_dir}/rank{rank}.dense", "w").write(str(exc))
