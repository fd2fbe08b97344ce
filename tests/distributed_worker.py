"""Worker processes for tests/parallel/test_distributed.py (spawned, gloo, CPU, float64).

Each rank runs every case with context parallelism and compares its loss and every
parameter gradient with a single-process run of the same engine in the same
process. A mismatch raises, which fails the spawning test.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

import longstraw as ls
from tests.reference import (
    assert_grads_close,
    FLOAT32_INTERNALS,
    FLOAT64,
    compare_step,
    float64_hybrid,
    float64_norms,
    grads_of,
    hf_cached_logprobs,
    hf_full_logprobs,
    masked_group,
    random_group,
    float64_internals,
    float64_throughout,
    tiny_falcon_h1,
    tiny_family,
    tiny_hybrid,
    tiny_kimi,
    tiny_mamba,
    tiny_mla,
    tiny_model,
    tree_group,
)

CASES = {
    "dense": lambda: tiny_model("qwen3"),
    "hybrid": lambda: tiny_hybrid("qwen3_5"),
    "mla": lambda: tiny_mla("deepseek_v3"),
    "glm": lambda: tiny_mla("glm_moe_dsa", index_topk=64),
    "glm_sparse": lambda: tiny_mla("glm_moe_dsa"),  # index_topk 8 < P: global top-k across ranks
    "dsv32_sparse": lambda: tiny_mla("deepseek_v32"),
    # dense MLPs in every layer: no float32 MoE router (HF routes in float32)
    "mla_mlp": lambda: tiny_mla("deepseek_v3", first_k_dense_replace=3),
    "glm_sparse_mlp": lambda: tiny_mla("glm_moe_dsa", first_k_dense_replace=3),
    "dsv32_sparse_mlp": lambda: tiny_mla("deepseek_v32", first_k_dense_replace=3),
    "next": lambda: tiny_hybrid("qwen3_next"),
    "hybrid_moe": lambda: tiny_hybrid("qwen3_5_moe"),
    # part 1 of the model families (float64 internals: `float64_internals`); the windowed
    # ones with a window longer than the sequence (a shorter one: `run_windowed`)
    "qwen3_moe": lambda: tiny_family("qwen3_moe"),
    "glm4_moe": lambda: tiny_family("glm4_moe"),
    "mixtral": lambda: tiny_family("mixtral"),
    "phi3": lambda: tiny_family("phi3"),  # longrope
    "minimax_m2": lambda: tiny_family("minimax_m2"),  # partial rotary
    "gpt_oss": lambda: tiny_family("gpt_oss", sliding_window=64),  # attention sinks
    "gemma3": lambda: tiny_family("gemma3_text", sliding_window=64),
    "nemotron_h": lambda: tiny_mamba("nemotron_h"),  # Mamba2 + attention + MLP / MoE blocks
    "bamba": lambda: tiny_mamba("bamba"),
    "kimi_linear": lambda: tiny_kimi(),  # KDA + NoPE MLA + MoE
    "falcon_h1": lambda: tiny_falcon_h1(),  # attention and Mamba2 side by side
}
FAMILY_CASES = ("qwen3_moe", "glm4_moe", "mixtral", "phi3", "minimax_m2", "gpt_oss", "gemma3")
MAMBA_CASES = ("nemotron_h", "bamba")
PART2_CASES = ("kimi_linear", "falcon_h1")  # model families part 2 (float64 internals)
HYBRIDS = ("hybrid", "next", "hybrid_moe")
# Most comparisons run under `float64_throughout` (HF's float32 norms, routers and GDN
# kernel cast to float64 on both sides) and are held to FLOAT64. The plain, divided-capture
# and divided-walk cases keep HF's own internals (`_kept_internals`): under the float64
# casts, a rank left without a block at W = 3 sent a float64 buffer where its peers
# expected float32 (gloo: "Received data size doesn't match"), a mode the engine never
# sees. There the MoE models with HF's float32 routers (FLOAT32_ROUTERS: a divided walk
# routes a rank's own rows rather than the whole chunk's, ~1e-7 apart and by how much
# depending on the CPU's vector width) are held to FLOAT32_INTERNALS, the rest to FLOAT64.
FLOAT32_ROUTERS = ("mla", "glm", "glm_sparse", "dsv32_sparse", "next", "hybrid_moe")


def _kept_internals(name: str, model):
    """HF's float32 internals kept (but the hybrids' GDN kernel and norms in float64, as
    before), and the families of part 1 / 2 under float64_internals as they always were."""
    name = name.removesuffix(SELECT_BLOCKS)
    if name in HYBRIDS:
        return float64_hybrid(model)
    if name in FAMILY_CASES + MAMBA_CASES + PART2_CASES:
        return float64_internals()
    return contextlib.nullcontext()


def _bound(name: str) -> float:
    return FLOAT32_INTERNALS if name.removesuffix(SELECT_BLOCKS) in FLOAT32_ROUTERS else FLOAT64


PG_TIMEOUT_S = 300
"""The process groups' timeout: generous, so that a rank slow to start on a loaded machine
never aborts a test (the failure tests check which error each rank raised, not its time)."""


def spawn_each(fn, nprocs: int, args: tuple, timeout_s: float) -> list[int]:
    """Spawn `nprocs` ranks of fn(rank, *args) and join each one by itself (up to
    `timeout_s`, then killed); return their exit codes. (mp.spawn's own join terminates the
    other ranks as soon as one fails, which races the report a surviving rank is about
    to write.)"""
    from tests.ranks import spawn

    ctx = spawn(fn, args=args, nprocs=nprocs, join=False)
    for proc in ctx.processes:
        proc.join(timeout=timeout_s)
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    return [proc.exitcode for proc in ctx.processes]


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    torch.set_num_threads(1)


def on_one_rank_each(thunks: list) -> list:
    """`[f() for f in thunks]` on every rank, each f run on one rank only (thunk i on rank
    i % W) and its result all-gathered (pickled: losses, gradient dicts, tensors): the
    single-process references every rank compares its context-parallel result with, at
    1/W of the cost of every rank computing all of them (which had been more than half of
    a rank's time). Each f must build what it needs (seeded models, groups): a result must
    not depend on which rank computed it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: f() for i, f in enumerate(thunks) if i % world == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    merged = {i: result for part in parts for i, result in part.items()}
    return [merged[i] for i in range(len(thunks))]


def run_cases(rank: int, world: int, init_file: str, cases: list[str], modes: list[str]) -> None:
    _init(rank, world, init_file)
    try:
        if "planner" in cases:
            check_planner(world)
        models: dict = {}
        steps = [(name, mode) for name in cases if name != "planner" for mode in modes]
        want = on_one_rank_each([lambda n=name, m=mode: _case_step(models, n, m, False) for name, mode in steps])
        for (name, mode), (want_loss, want_grads, total) in zip(steps, want):
            with _select_blocks(name):
                loss, grads, mine = _case_step(models, name, mode, True)
            assert abs(loss - want_loss) <= 1e-9 * abs(want_loss) + 1e-13, (name, mode)
            assert_grads_close(grads, want_grads, _bound(name))
            # each rank holds ~1/W of the per-token state (within one block of 3 positions)
            assert abs(mine - total / world) <= total / (CASE_PROMPT - 1) * 3, (name, mine, total)
    finally:
        dist.destroy_process_group()


CASE_PROMPT = 23
"""`run_cases`' prompt length."""

SELECT_BLOCKS = "/select2"
"""A case name's suffix: CASES[name] with context parallelism's selection across ranks in
blocks of 2 queries (`defaults.select_query_block` scores a tiny case's queries in one
block, so its loop over blocks would go unchecked)."""


@contextlib.contextmanager
def _select_blocks(name: str):
    if not name.endswith(SELECT_BLOCKS):
        yield
        return
    import longstraw.defaults as defaults

    saved = defaults.SELECT_QUERY_BLOCK, defaults.SELECT_MAX_QUERY_BLOCK
    defaults.SELECT_QUERY_BLOCK = defaults.SELECT_MAX_QUERY_BLOCK = 2
    try:
        yield
    finally:
        defaults.SELECT_QUERY_BLOCK, defaults.SELECT_MAX_QUERY_BLOCK = saved


def _case_step(models: dict, name: str, mode: str, context_parallel: bool) -> tuple:
    """One step of CASES[name] (built once per process, kept in `models`) in `mode`, blocks
    of 3 positions: the loss, every .grad, and the per-token state bytes of a capture."""
    model = _model_of(models, name)
    group = random_group(97, CASE_PROMPT, [5, 1, 7], seed=3)
    engine = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, chunk_size=6, attention_block_size=4,
                                            shard_block_size=3, mode=mode))
    with _kept_internals(name, model):
        model.zero_grad(set_to_none=True)
        result = engine.step(group)
        grads = grads_of(model)
    return result.loss, grads, _per_token_bytes(engine.capture(group.prompt))


def _per_token_bytes(state) -> int:
    """Bytes of the position-sharded state (K/V, MLA latents); GDN state is replicated."""
    from longstraw.state.prompt import AttentionKV, MLAState

    return sum(layer.nbytes() if isinstance(layer, AttentionKV) else layer.latent.nbytes()
               for layer in state.layers if isinstance(layer, (AttentionKV, MLAState)))


def crash_one_rank(rank: int, world: int, init_file: str, flag_dir: str) -> None:
    """Rank 1 raises before its step; the others must fail fast, not hang."""
    _init(rank, world, init_file)
    model = tiny_model("llama")
    group = random_group(97, 30, [4, 4], seed=1)
    engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=8))
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    try:
        engine.step(group)
    except ls.LongStrawError as exc:
        open(os.path.join(flag_dir, f"rank{rank}.failed"), "w").write(str(exc))
        raise


def run_fsdp(rank: int, world: int, init_file: str) -> None:
    """Decoder layers wrapped with FSDP2 (`parallel.sharding.shard_model`: resharded after
    every forward): each rank's gradient shard equals
    the matching slice of the single-process gradient (and the full tensor equals it), with
    the capture divided (each prompt token on one rank) and replicated, and exact mode's
    walk divided (FSDP2's reduce-scatter then sums the ranks' partial gradients; dense,
    hybrid, MoE hybrid and MLA) and replicated: no gradient is reduced twice or missed."""
    from torch.distributed.device_mesh import init_device_mesh

    from longstraw.parallel.sharding import shard_model

    _init(rank, world, init_file)
    try:
        names, kw = ("dense", "hybrid", "hybrid_moe", "mla_mlp"), dict(chunk_size=6, attention_block_size=4,
                                                                        shard_block_size=3)
        refs = on_one_rank_each([lambda n=name, m=mode: _one_process_grads(n, m, kw)
                                 for name in names for mode in ("detached", "exact")])
        for i, name in enumerate(names):
            model = CASES[name]()
            group = random_group(97, 23, [5, 3], seed=3)
            with float64_throughout(model):
                want = dict(zip(("detached", "exact"), refs[2 * i:2 * i + 2]))
                shard_model(model, init_device_mesh("cpu", (world,)))  # resharded after every forward
                sharded = 0
                for mode, divide in (("detached", True), ("exact", True), ("detached", False), ("exact", False)):
                    model.zero_grad(set_to_none=True)
                    result = ls.Engine(model, ls.ExecConfig(mode=mode, context_parallel=True, divide_capture=divide,
                                                            divide_walk=divide, **kw)).step(group)
                    assert result.metrics["divided_capture"] == float(divide)
                    assert result.metrics["divided_walk"] == float(divide and mode == "exact")
                    for pname, p in model.named_parameters():
                        grad, ref = p.grad, want[mode][pname]
                        if hasattr(grad, "to_local"):  # a DTensor shard: dim-0 chunks, as FSDP2 lays them out
                            sharded += 1
                            local = grad.to_local()
                            chunks = ref.chunk(world, dim=0)
                            expected = chunks[rank] if rank < len(chunks) else ref[:0]
                            assert local.shape == expected.shape, (name, mode, pname)
                            if local.numel():  # (a parameter with fewer rows than ranks has an empty shard)
                                assert (local - expected).abs().max() <= 1e-9 * ref.abs().max(), (name, mode, pname)
                            grad = grad.full_tensor()
                        assert (grad - ref).abs().max() <= 1e-9 * ref.abs().max() + 1e-300, (name, mode, pname)
                assert sharded > 0
            if name == "dense":  # a 2-D (HSDP) mesh: FSDP2 would not sum the partials right, so walk replicated
                from longstraw.parallel.fsdp import fsdp_sum_factor

                layers = list(model.model.layers)
                engine = ls.Engine(model, ls.ExecConfig(mode="exact", context_parallel=True, **kw))
                state = engine.capture(group.prompt, exact=True)
                assert fsdp_sum_factor(layers, engine.cp) == 1.0 and engine.divides_walk(state)
                info = layers[0]._get_fsdp_state()._fsdp_param_groups[0].mesh_info
                info.replicate_process_group = info.shard_process_group
                try:
                    assert fsdp_sum_factor(layers, engine.cp) is None and not engine.divides_walk(state)
                finally:
                    del info.replicate_process_group
            del model
        dist.barrier()  # FSDP2's gloo reduce-scatters are finished on every rank before teardown
    finally:
        dist.destroy_process_group()


def _one_process_grads(name: str, mode: str, kw: dict) -> dict:
    """Every .grad of one single-process step of a fresh CASES[name] in `mode` (`run_fsdp`'s group)."""
    model = CASES[name]()
    with float64_throughout(model):
        ls.Engine(model, ls.ExecConfig(mode=mode, **kw)).step(random_group(97, 23, [5, 3], seed=3))
    return grads_of(model)


def run_fsdp_2d(rank: int, world: int, init_file: str) -> None:
    """Dense decoder layers FSDP2-sharded on a 2-D (1, W) (replicate, shard) HSDP mesh with the
    all-reduce across replicas held (`parallel.fsdp.hold_replica_reductions`): the engine
    moves what FSDP2 holds into the sharded `.grad` (`settle_held_reductions`) and exact
    mode's walk runs divided (`fsdp_sum_factor` accepts the layout); every full gradient
    equals one process's. Float32 with FSDP2's sum-only reductions
    (`set_force_sum_reduction_for_comms`): replay's division by W is then left to the
    settling, and the walk's partials must not be divided by it. (Float64 on this mesh:
    the trainer's tests, tests/integrations/test_trl_distributed.py.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from longstraw.parallel.fsdp import fsdp_sum_factor, hold_replica_reductions
    from longstraw.parallel.sharding import shard_model

    _init(rank, world, init_file)
    try:
        for dtype, sum_only in ((torch.float32, True),):
            model = CASES["dense"]().to(dtype)
            group = random_group(97, 23, [5, 3], seed=3)
            kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3)
            tol = 1e-9 if dtype == torch.float64 else 1e-5
            want = {}
            for mode in ("detached", "exact"):
                model.zero_grad(set_to_none=True)
                ls.Engine(model, ls.ExecConfig(mode=mode, **kw)).step(group)
                want[mode] = grads_of(model)
            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
            layers = shard_model(model, mesh)
            hold_replica_reductions(layers)
            for layer in layers if sum_only else ():
                layer.set_force_sum_reduction_for_comms(True)
            for mode in ("detached", "exact"):
                model.zero_grad(set_to_none=True)
                engine = ls.Engine(model, ls.ExecConfig(mode=mode, context_parallel=True, **kw))
                assert fsdp_sum_factor(layers, engine.cp) == 1.0
                result = engine.step(group)
                assert result.metrics["divided_walk"] == float(mode == "exact"), (dtype, mode)
                for pname, p in model.named_parameters():
                    grad, ref = p.grad, want[mode][pname]
                    assert grad is not None, (dtype, mode, pname)
                    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                    assert (grad - ref).abs().max() <= tol * ref.abs().max() + 1e-30, (dtype, mode, pname)
            del model
        dist.barrier()
    finally:
        dist.destroy_process_group()


WINDOWED_CASES = ("olmo3", "gemma3_text", "gpt_oss")
"""Sliding windows (5) shorter than the prompt (17) under context parallelism
(`run_windowed`): blocks of 3 positions, so every window spans both ranks' blocks."""


def run_windowed(rank: int, world: int, init_file: str, families: list[str]) -> None:
    """Sliding-window families with a window (5) shorter than the prompt (17) under context
    parallelism: step (both modes: loss and every .grad), score and greedy generate (7 new
    tokens, past the window) equal one process, to 1e-9 (float64 internals). The sharded
    detached state keeps, summed over ranks, exactly the last W - 1 positions."""
    _init(rank, world, init_file)
    try:
        group = random_group(97, 17, [5, 1, 7], seed=3)
        refs = on_one_rank_each([lambda n=name: _windowed_run(n, group, False) for name in families])
        for name, want in zip(families, refs):
            got, model = _windowed_run(name, group, True), tiny_family(name)
            for mode in ("detached", "exact"):
                (loss, grads), (want_loss, want_grads) = got[mode], want[mode]
                assert abs(loss - want_loss) <= 1e-9 * abs(want_loss) + 1e-13, (name, mode)
                assert_grads_close(grads, want_grads, 1e-9)
            exec_kw = dict(context_parallel=True, chunk_size=4, attention_block_size=2, shard_block_size=3)
            with float64_internals(), torch.no_grad():
                chunked = ls.Engine(model, ls.ExecConfig(divide_capture=False, mode="detached", **exec_kw))
                for a, b, c in zip(got["scores"], want["scores"], chunked.score(group)):
                    assert (a - b).abs().max() <= 1e-9 and (c - b).abs().max() <= 1e-9, (name, a, b, c)
                state = ls.Engine(model, ls.ExecConfig(mode="exact", **exec_kw)).capture(group.prompt)  # detached
                for kind, kv in zip(model.config.layer_types, state.layers):  # sliding layers trimmed on every rank
                    held = torch.tensor([kv.length])
                    dist.all_reduce(held)
                    assert int(held) == (4 if kind == "sliding_attention" else 16), (name, kind, int(held))
            for a, b in zip(got["responses"], want["responses"]):
                assert torch.equal(a, b), (name, a, b)
            for a, b in zip(got["logprobs"], want["logprobs"]):
                assert (a - b).abs().max() <= 1e-9, (name, a, b)
    finally:
        dist.destroy_process_group()


def _windowed_run(name: str, group, context_parallel: bool) -> dict:
    """`run_windowed`'s runs of tiny_family(name), with or without context parallelism:
    each mode's step (loss, every .grad), then the exact-mode engine's score and greedy
    generate (7 new tokens, past the window)."""
    model = tiny_family(name)
    assert "sliding_attention" in model.config.layer_types and model.config.sliding_window == 5, name
    out = {}
    with float64_internals():
        for mode in ("detached", "exact"):
            engine = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, chunk_size=4,
                                                    attention_block_size=2, shard_block_size=3, mode=mode))
            model.zero_grad(set_to_none=True)
            out[mode] = engine.step(group).loss, grads_of(model)
        with torch.no_grad():  # the exact-mode engine's score and greedy generate
            out["scores"] = engine.score(group)
            greedy = engine.generate(group.prompt, num_samples=2, max_new_tokens=7, temperature=0)
    out["responses"], out["logprobs"] = greedy.responses, greedy.logprobs
    return out


def run_generate(rank: int, world: int, init_file: str, cases: list[str]) -> None:
    """Rollouts under context parallelism: with the same seed, every rank samples the same
    responses as a single process, with the same log-probs, and stepping the rollout's
    (sharded) state equals a single-process step."""
    _init(rank, world, init_file)
    try:
        models: dict = {}
        want = on_one_rank_each([lambda n=name: _generate_then_step(models, n, False) for name in cases])
        for name, (responses, logprobs, loss, grads) in zip(cases, want):
            got = _generate_then_step(models, name, True)
            for a, b, la, lb in zip(responses, got[0], logprobs, got[1]):
                assert torch.equal(a, b), (name, a, b)
                assert (la - lb).abs().max() <= 1e-9, (name, la, lb)
            assert abs(got[2] - loss) <= 1e-9 * abs(loss) + 1e-13, name
            assert_grads_close(got[3], grads, 1e-9)
    finally:
        dist.destroy_process_group()


def _generate_then_step(models: dict, name: str, context_parallel: bool) -> tuple:
    """`run_generate`'s rollout of CASES[name] (3 samples, 5 new tokens, seed 7), then a
    step of its responses (over the rollout's state under context parallelism; in one
    process a step from scratch, the reference): responses, log-probs, loss, every .grad."""
    model = _model_of(models, name)
    prompt = random_group(97, 23, [1], seed=3).prompt
    engine = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, chunk_size=6, attention_block_size=4,
                                            shard_block_size=3))
    with float64_throughout(model):
        rollout = engine.generate(prompt, num_samples=3, max_new_tokens=5, generator=torch.Generator().manual_seed(7))
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0, 0.5]))
        model.zero_grad(set_to_none=True)
        loss = engine.step(group, state=rollout.state if context_parallel else None).loss  # one process: afresh
    return rollout.responses, rollout.logprobs, loss, grads_of(model)


def _episode_env(branch: int, response: torch.Tensor) -> torch.Tensor:
    """Deterministic: 2 + branch observation tokens made from the response so far."""
    base = int(response.sum()) + 7 * branch
    return torch.tensor([(base + 13 * j) % 97 for j in range(2 + branch)], dtype=torch.long)


def run_episode(rank: int, world: int, init_file: str, cases: list[str]) -> None:
    """Agent episodes under context parallelism: greedy generate with a deterministic
    environment, and then with `prefix=` from the rollout's (sharded) state, equals one
    process token for token, log-probs to 1e-9, masks and turns identical."""
    _init(rank, world, init_file)
    try:
        refs = on_one_rank_each([lambda n=name: _episodes(n, False) for name in cases])
        for name, (want_runs, eos) in zip(cases, refs):
            got_runs, _ = _episodes(name, True, eos)
            assert sum(got_runs[0]["turns"]) >= 3, (name, got_runs[0]["turns"])  # the environment was called
            for want, got in zip(want_runs, got_runs):  # the episodes, then their forks with prefix=
                assert want["turns"] == got["turns"], (name, want["turns"], got["turns"])
                for a, b, la, lb, ma, mb in zip(want["responses"], got["responses"], want["logprobs"],
                                                got["logprobs"], want["loss_masks"], got["loss_masks"]):
                    assert torch.equal(a, b), (name, rank, a.tolist(), b.tolist())
                    assert torch.equal(ma, mb), (name, rank, ma.tolist(), mb.tolist())
                    assert (la - lb).abs().max() <= 1e-9, (name, rank, la, lb)
    finally:
        dist.destroy_process_group()


def _episodes(name: str, context_parallel: bool, eos: int | None = None) -> tuple[list[dict], int]:
    """`run_episode`'s greedy episodes of CASES[name] (2 turns), then forks of them with
    `prefix=` from the rollout's state (1 turn): each one's responses, log-probs, loss
    masks and turns; and the eos token (the third greedy token, found if not given)."""
    model = CASES[name]()
    prompt = random_group(97, 23, [1], seed=3).prompt
    engine = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, chunk_size=6, attention_block_size=4,
                                            shard_block_size=3))
    with float64_throughout(model):
        if eos is None:
            eos = int(engine.generate(prompt, num_samples=1, max_new_tokens=3, temperature=0).responses[0][-1])
        kw = dict(num_samples=3, max_new_tokens=16, temperature=0, eos_token_id=eos)
        episodes = engine.generate(prompt, environment=_episode_env, max_turns=2, **kw)
        forks = engine.generate(prompt, prefix=torch.tensor([11, 3, 50, 8]), state=episodes.state,
                                prefix_loss_mask=torch.tensor([True, False, True, True]), environment=_episode_env,
                                max_turns=1, **kw)
    return [dict(responses=r.responses, logprobs=r.logprobs, loss_masks=r.loss_masks, turns=r.turns)
            for r in (episodes, forks)], eos


def bad_group_on_one_rank(rank: int, world: int, init_file: str, flag_dir: str) -> None:
    """Rank 1's group has an out-of-vocabulary token, so its validation fails; every rank
    must raise a LongStrawError together, without waiting out the process-group timeout."""
    _init(rank, world, init_file)
    try:
        model = tiny_model("llama")
        group = random_group(97, 30, [4, 4], seed=1)
        if rank == 1:
            group = ls.Group(prompt=group.prompt, responses=[group.responses[0], torch.tensor([1, 500])],
                             rewards=group.rewards)
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=8))
        try:
            engine.step(group)
        except ls.LongStrawError as exc:
            open(os.path.join(flag_dir, f"rank{rank}.err"), "w").write(f"{type(exc).__name__}: {exc}")
        dist.barrier()  # both ranks past the failed agreement before either tears gloo down (an
        # unsynchronised teardown aborted a rank about 1 run in 12: "terminate called without an active exception")
    finally:
        dist.destroy_process_group()


def run_masked(rank: int, world: int, init_file: str, flag_dir: str) -> None:
    """Loss masks under context parallelism: every rank's masked step equals HF's masked
    loss (detached: the cached continuation; exact: the full sequence), loss and every
    gradient; and ranks given different masks all raise together."""
    _init(rank, world, init_file)
    try:
        model = float64_norms(tiny_model("qwen3"))
        group = masked_group(97, 23, [5, 1, 7], seed=3)
        kw = dict(context_parallel=True, chunk_size=6, attention_block_size=4, shard_block_size=3)
        compare_step(model, group, ls.ExecConfig(**kw), hf_cached_logprobs, 1e-9)
        compare_step(model, group, ls.ExecConfig(mode="exact", **kw), hf_full_logprobs, 1e-9)
        if rank == 1:  # the same tokens, one more token masked
            group.loss_masks = [m.clone() for m in group.loss_masks]
            group.loss_masks[2][0] = False
        try:
            ls.Engine(model, ls.ExecConfig(**kw)).step(group)
        except ls.InvalidGroupError as exc:
            open(os.path.join(flag_dir, f"rank{rank}.err"), "w").write(str(exc))
    finally:
        dist.destroy_process_group()


def world_one(rank: int, world: int, init_file: str, flag_dir: str) -> None:
    """One gloo rank: the group's backend and device, and a context-parallel step that
    equals the single-process one."""
    _init(rank, world, init_file)
    try:
        from longstraw.parallel.context import ContextParallel

        cp = ContextParallel.from_default_group()
        assert cp.backend == "gloo" and cp.device == torch.device("cpu"), cp
        # a sliding window (64) longer than the sequence (P = 20) runs as full attention
        for model, mode in [(tiny_model("qwen3"), "exact"), (tiny_model("mistral", sliding_window=64), "detached"),
                            (tiny_model("mistral", sliding_window=64), "exact")]:
            group = random_group(97, 20, [5, 3], seed=3)
            kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3, mode=mode, branch_chunk_size=2)
            model.zero_grad(set_to_none=True)
            want = ls.Engine(model, ls.ExecConfig(**kw)).step(group).loss, grads_of(model)
            model.zero_grad(set_to_none=True)
            got = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).step(group).loss, grads_of(model)
            assert abs(got[0] - want[0]) <= 1e-12 * abs(want[0]) + 1e-14
            assert_grads_close(got[1], want[1], 1e-12)
        open(os.path.join(flag_dir, "ok"), "w").write("ok")
    finally:
        dist.destroy_process_group()


def check_planner(world: int) -> None:
    """The planner's per-rank state bytes (and exact mode's GDN snapshot bytes) equal what
    the context-parallel engine holds on the fullest rank (rank 0), and the bytes the
    busiest rank receives in the divided capture, and in exact mode's divided reverse walk,
    equal its predictions, for a hybrid model, MLA (DeepSeek-V3) and sparse DSA (GLM-5,
    with a "shared" layer); the walk also for a dense model."""
    from longstraw.parallel.collectives import Traffic
    from longstraw.plan import PlanConfig, estimate
    from longstraw.plan.traffic import divided_capture_traffic, divided_walk_traffic

    prompt = random_group(97, 41, [3], seed=2).prompt  # 40 positions held
    for name in ("hybrid", "mla", "glm_sparse"):
        model = CASES[name]()
        for mode in ("detached", "exact"):
            engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=7, attention_block_size=3,
                                                    mode=mode))
            Traffic.received = 0
            held = [int(x) for x in all_gather_ints(engine.capture(prompt, exact=mode == "exact").nbytes())]
            received = max(all_gather_ints(Traffic.received))  # (all_gather_ints: torch's own, not counted)
            plan = estimate(model.config.to_dict(), PlanConfig(
                prompt_tokens=40, group=1, response_tokens=3, gpus=world, chunk_size=7, attention_block_size=3,
                mode=mode, dtype="float64"))
            want = plan["state_bytes_per_rank"] + plan["exact_checkpoint_bytes_per_rank"]
            assert max(held) == held[0] == want, (name, mode, held, plan["state_bytes_per_rank"],
                                                  plan["exact_checkpoint_bytes_per_rank"])
            # the bytes the busiest rank receives in the (divided) capture: as the planner predicts
            predicted = divided_capture_traffic(model.config.to_dict(), positions=40, world=world, block=3,
                                                chunk_size=7, dtype="float64", exact=mode == "exact")
            assert plan["divided_capture"] and received > 0
            assert abs(received - predicted) <= 64, (name, mode, received, predicted)
    # the divided reverse walk's traffic (`comm_bytes_reverse`): as the planner predicts
    group = random_group(97, 41, [3, 2], seed=2)
    for name in ("dense", "hybrid", "mla", "glm_sparse"):
        model = CASES[name]()
        # counts bytes, not rounding: the engine's own dtypes as they are (float64_internals
        # would turn its float32 buffers into float64 ones), HF's GDN kernel in float64
        with float64_hybrid(model) if name in HYBRIDS else contextlib.nullcontext():
            model.zero_grad(set_to_none=True)
            result = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=7, attention_block_size=3,
                                                    mode="exact")).step(group)
        assert result.metrics["divided_walk"] == 1.0
        received = max(all_gather_ints(result.metrics["comm_bytes_reverse"]))
        # (the planner counts the parameters that get a gradient: all but the DSA indexers')
        assert sum(p.grad.numel() * 8 for p in model.parameters() if p.grad is not None) > 0
        predicted = divided_walk_traffic(model.config.to_dict(), positions=40, world=world, block=3, chunk_size=7,
                                         dtype="float64")
        assert abs(received - predicted) <= 64, (name, received, predicted)


def all_gather_ints(value: int) -> list:
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64))
    return [float(t) for t in out]


def run_divided(rank: int, world: int, init_file: str) -> None:
    """Divided capture (each prompt token on one rank) at awkward geometries: a GDN
    segment cut by a chunk boundary inside a block, blocks that do not divide the prompt,
    blocks shorter than the conv's K-1 tail, more ranks than some blocks; MLA (dense) and
    sparse DSA (GLM-5 with a "shared" layer, DeepSeek-V3.2) with fetched pieces that cut
    blocks. Loss and every gradient equal the single process; the state equals a
    replicated capture's rows, indexer keys and snapshots; the step's metrics say the
    capture was divided. (The DeepSeek/GLM routers score in float32, where one token
    rounds differently from several: no MLA geometry here leaves a rank only one position,
    or the single process a last chunk of one token.)"""
    _init(rank, world, init_file)
    try:
        cases = [("hybrid", 22, 4, 6), ("hybrid", 20, 2, 5), ("dense", 22, 4, 6), ("hybrid", 12, 4, 3),
                 ("hybrid", 9, 5, 3), ("mla", 22, 4, 6), ("glm_sparse", 21, 3, 6), ("dsv32_sparse", 22, 4, 6)]
        if world == 3:  # Qwen3-Next's grouped projection layout and Qwen3.5's MoE, once (the default W)
            cases += [("next", 22, 4, 6), ("hybrid_moe", 16, 3, 4)]
        models: dict = {}
        steps = [(case, mode) for case in cases for mode in ("detached", "exact")]
        want = on_one_rank_each([lambda c=case, m=mode: _divided_step(models, c, m, False) for case, mode in steps])
        for (case, mode), (want_loss, _, want_grads) in zip(steps, want):
            name, prompt_len, block, chunk = case
            loss, divided_capture, grads = _divided_step(models, case, mode, True)
            # 8 positions in blocks of 5 leave rank 2 of 3 without a block: replicated capture
            assert divided_capture == float(prompt_len - 1 > (world - 1) * block), name
            assert abs(loss - want_loss) <= 1e-9 * abs(want_loss) + 1e-13, (name, mode)
            assert_grads_close(grads, want_grads, _bound(name))
            model, prompt = _model_of(models, name), random_group(97, prompt_len, [4, 2], seed=5).prompt
            kw = dict(chunk_size=chunk, attention_block_size=3, shard_block_size=block, mode=mode)
            with _kept_internals(name, model):
                divided = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).capture(
                    prompt, exact=mode == "exact")
                replicated = ls.Engine(model, ls.ExecConfig(context_parallel=True, divide_capture=False,
                                                            **kw)).capture(prompt, exact=mode == "exact")
            _assert_same_state(divided, replicated)
    finally:
        dist.destroy_process_group()


def _model_of(models: dict, name: str):
    """CASES[name](), built once per process and kept in `models`."""
    if name not in models:
        models[name] = CASES[name.removesuffix(SELECT_BLOCKS)]()
    return models[name]


def _divided_step(models: dict, case: tuple, mode: str, context_parallel: bool) -> tuple:
    """One step of a `run_divided` case: the loss, the `divided_capture` metric, every .grad."""
    name, prompt_len, block, chunk = case
    model = _model_of(models, name)
    group = random_group(97, prompt_len, [4, 2], seed=5)
    kw = dict(chunk_size=chunk, attention_block_size=3, shard_block_size=block, mode=mode)
    with _kept_internals(name, model):
        model.zero_grad(set_to_none=True)
        result = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, **kw)).step(group)
        return result.loss, result.metrics["divided_capture"], grads_of(model)


def _assert_same_state(a, b) -> None:
    from longstraw.state.prompt import AttentionKV, MLAState, RecurrentState

    assert a.length == b.length
    for x, y in zip(a.layers, b.layers):
        if isinstance(x, MLAState):
            _assert_same_rows(x.latent, y.latent)
            assert (x.index is None) == (y.index is None)
            if x.index is not None:
                assert (x.index.length, x.index.consumed) == (y.index.length, y.index.consumed)
                torch.testing.assert_close(x.index.until(x.index.end), y.index.until(y.index.end),
                                           rtol=FLOAT32_INTERNALS, atol=FLOAT64)
        elif isinstance(x, AttentionKV):
            _assert_same_rows(x, y)
        else:
            assert isinstance(x, RecurrentState) and sorted(x.snapshots) == sorted(y.snapshots)
            for p in x.snapshots:
                for s, t in zip(x.snapshots[p], y.snapshots[p]):
                    assert (s is None) == (t is None)
                    if s is not None:
                        assert s.dtype == t.dtype
                        torch.testing.assert_close(s, t, rtol=1e-10, atol=1e-12)


WALK_GEOMETRY_REPEATS = {("dense", 22, 3, 6, None), ("hybrid", 22, 3, 6, None), ("hybrid", 20, 4, 7, None)}
"""Divided-walk cases whose geometry the others already have (a prompt the block does not
divide, walk chunks of one cycle and of several): `every_geometry=False` skips them."""


def _walk_case(case: tuple, _, context_parallel: bool) -> tuple:
    """One divided-walk case of `run_divided_walk`: two exact steps of one engine (`.grad`
    accumulating over both), with the embedding frozen at prompt length 23; returns the
    losses, the gradients and each step's `divided_walk` metric."""
    name, prompt_len, block, chunk, pieces = case
    model = CASES[name]()
    if prompt_len == 23:
        model.model.embed_tokens.weight.requires_grad_(False)
    groups = [random_group(97, prompt_len, lens, seed=s) for lens, s in (([4, 2, 5], 5), ([3, 1], 6))]
    # one branch at a time on both sides (context parallelism replays so): HF's GDN casts A_log
    # to float32 once per call, so a batch rounds its gradient differently (~1e-8)
    kw = dict(chunk_size=chunk, attention_block_size=3, shard_block_size=block, mode="exact",
              branch_chunk_size=pieces, replay_batch=1)
    with _kept_internals(name, model):
        model.zero_grad(set_to_none=True)
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=context_parallel, **kw))
        results = [engine.step(group) for group in groups]
    return [r.loss for r in results], grads_of(model), [r.metrics["divided_walk"] for r in results]


def _one_step_case(name: str, divide_walk: bool | None, context_parallel: bool) -> tuple:
    """One exact step of CASES[name] at P = 22 in blocks of 3 (`divide_walk` None: the
    default), as `_walk_case` returns it."""
    model = CASES[name]()
    group = random_group(97, 22, [4, 2], seed=5)
    kw = dict(chunk_size=6, attention_block_size=3, shard_block_size=3, mode="exact")
    if context_parallel:
        kw.update(context_parallel=True, **({} if divide_walk is None else dict(divide_walk=divide_walk)))
    with _kept_internals(name, model):
        model.zero_grad(set_to_none=True)
        result = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
    return [result.loss], grads_of(model), [result.metrics["divided_walk"]]


def run_divided_walk(rank: int, world: int, init_file: str, every_geometry: bool = True) -> None:
    """Exact mode's divided reverse walk (dense, GDN hybrid, MLA, DSA): each prompt token
    recomputed and backpropagated on the rank that owns its block, the ranks' partial
    parameter gradients summed once. Loss and every `.grad` on every rank equal the single
    process, also when `.grad` already holds an earlier group's gradient, with a frozen
    parameter, with branches replayed in pieces, and for a rollout's state; the metrics
    say the walk was divided (and replicated with `divide_walk=False`)."""
    from longstraw.parallel.divided import walk_chunks

    _init(rank, world, init_file)
    try:
        # (family, prompt length, block, chunk, branch pieces): prompts not divisible by the
        # block or the cycle, walk chunks of one cycle and of several, a short last chunk
        # joined to the one before, one chunk for the whole prompt; hybrids cut at capture
        # chunks (a chunk not a multiple of the block, so walk chunks start inside a block)
        cases = [("dense", 22, 3, 6, None), ("dense", 23, 2, 7, 2), ("dense", 20, 4, 1, None),
                 ("dense", 17, 3, 40, None), ("hybrid", 22, 3, 6, None), ("hybrid", 23, 2, 5, 2),
                 ("hybrid", 20, 4, 7, None)]
        # walk chunks that are the capture chunks
        cases += [("hybrid", 25, 3, 6, None) if world == 2 else ("hybrid", 28, 3, 9, None)]
        # MLA (DeepSeek-V3), and DSA with a top-k smaller than the prompt: GLM-5 (a shared
        # indexer layer reuses the selection) and DeepSeek-V3.2, with dense MLPs; one MoE
        # case below checks the routing of a rank's own rows.
        cases += [("mla_mlp", 22, 3, 6, None), ("glm_sparse_mlp", 23, 2, 7, 2), ("dsv32_sparse_mlp", 20, 4, 1, None)]
        if world == 3:  # Qwen3-Next's grouped projection layout and Qwen3.5's MoE, once (the default W)
            cases += [("next", 19, 3, 4, None), ("hybrid_moe", 16, 3, 4, None)]
        cases = [case for case in cases if every_geometry or case not in WALK_GEOMETRY_REPEATS]
        for name, prompt_len, block, chunk, pieces in cases:
            bounds = walk_chunks(prompt_len - 1, chunk, world, block, at_chunks=name in HYBRIDS)
            assert bounds[0][0] == 0 and bounds[-1][1] == prompt_len - 1
            for a, b in bounds:  # every rank owns a position of every chunk; hybrids cut at capture chunks
                assert len({k % world for k in range(a // block, (b - 1) // block + 1)}) == world, bounds
                assert name not in HYBRIDS or a % chunk == 0, bounds
        # MoE routing of a rank's own rows (GLM-5 DSA with MoE layers; routers in float64);
        # switched off, and a family whose walk is not divided: replicated, same result
        steps = [(_walk_case, case, True) for case in cases] + [(_one_step_case, "glm_sparse", None)]
        steps += [(_one_step_case, name, False) for name in ("dense", "hybrid", "glm_sparse")]
        want = on_one_rank_each([lambda f=f, case=case, switch=switch: f(case, switch, False)
                                 for f, case, switch in steps])
        for (f, case, switch), (want_losses, want_grads, _) in zip(steps, want):
            losses, got_grads, divided = f(case, switch, True)
            name = case if isinstance(case, str) else case[0]
            assert divided == [float(switch is not False)] * len(losses), (case, switch, divided)
            for r, w in zip(losses, want_losses):
                assert abs(r - w) <= 1e-9 * abs(w) + 1e-13, (case, switch, r, w)
            assert_grads_close(got_grads, want_grads, 1e-9 if f is _walk_case else _bound(name))
        # a rollout's state, stepped in exact mode: the walk over it is divided too
        model = tiny_model("qwen3")
        kw = dict(chunk_size=5, attention_block_size=3, shard_block_size=2, mode="exact")
        prompt = random_group(97, 19, [1], seed=4).prompt
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw))
        rollout = engine.generate(prompt, num_samples=2, max_new_tokens=4, generator=torch.Generator().manual_seed(3))
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]))
        model.zero_grad(set_to_none=True)
        want = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
        grads = grads_of(model)
        model.zero_grad(set_to_none=True)
        got = engine.step(group, state=rollout.state)
        assert got.metrics["divided_walk"] == 1.0
        assert abs(got.loss - want.loss) <= 1e-9 * abs(want.loss) + 1e-13
        assert_grads_close(grads_of(model), grads, 1e-9)
    finally:
        dist.destroy_process_group()


def _assert_same_rows(x, y) -> None:
    """Divided against replicated capture rows: HF's float32 norms stay in (MLA's
    kv_a_layernorm: a rank's own rows and the whole chunk's round apart, 3.6e-7 relative
    measured under AVX2), so FLOAT32_INTERNALS."""
    assert (x.length, x.consumed) == (y.length, y.consumed)
    for s, t in zip(x.keys(), y.keys()):
        torch.testing.assert_close(s, t, rtol=FLOAT32_INTERNALS, atol=FLOAT64)


def run_shard_attention(rank: int, world: int, init_file: str) -> None:
    """prefix_causal_attention over this rank's shard of a prefix (cp set) equals it over the
    whole prefix in one process: output, dq/dk/dv and the prefix's gradient sinks, both on
    the fused path (`FlashAttention`) and the blockwise one, also with a rank whose shard is
    empty (every rank joins the merge and the dq all-reduce); and with the self part divided
    (`own_rows`: each rank's query rows in runs of 2 dealt round-robin, or all on rank 0):
    the same output, k/v gradients and sinks, and dq on each rank's own rows."""
    from longstraw.parallel.context import ContextParallel
    from longstraw.ops.attention import prefix_causal_attention
    from longstraw.tensors import KVSegment

    _init(rank, world, init_file)
    try:
        cp = ContextParallel.from_default_group()
        # all-reduces pair elements by index, also when one rank's tensor is strided otherwise
        # (a transposed view on rank 0, contiguous elsewhere)
        from longstraw.parallel.collectives import all_reduce_max, all_reduce_sum

        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1)
        for reduce, want in ((all_reduce_sum, torch.arange(12.).reshape(3, 4) * world * (world + 1) / 2),
                             (all_reduce_max, torch.arange(12.).reshape(3, 4) * world)):
            x = base.t().contiguous().t() if rank == 0 else base.clone()
            assert torch.equal(reduce(x, cp), want.to(torch.float64)) and torch.equal(x, want.to(torch.float64))
        g = torch.Generator().manual_seed(0)
        h, hkv, d, t, s, block = 4, 2, 16, 11, 21, 4

        def rand(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        q, k, v, pk, pv, dout = rand(h, t, d), rand(hkv, t, d), rand(hkv, t, d), rand(hkv, s, d), rand(hkv, s, d), \
            rand(h, t, d)
        blocks = [range(a, min(s, a + block)) for a in range(0, s, block)]
        for owners in ([i % world for i in range(len(blocks))], [0] * len(blocks)):  # dealt; all on rank 0
            mine = torch.tensor([p for b, o in zip(blocks, owners) if o == rank for p in b], dtype=torch.long)
            for fused in (True, False):
                got = []
                for sharded in (False, True):
                    x = [a.clone().requires_grad_() for a in (q, k, v)]
                    rows = mine if sharded else torch.arange(s)
                    sink = (pk.new_zeros(hkv, len(rows), d), pv.new_zeros(hkv, len(rows), d))
                    seg = KVSegment(pk[:, rows].contiguous(), pv[:, rows].contiguous(), 0, sink,
                                    cp=cp if sharded else None)
                    out = prefix_causal_attention(*x, prefixes=[seg], q_start=s + 2, scale=d ** -0.5, block_size=3,
                                                  allow_fused=fused)
                    out.backward(dout)
                    full = [pk.new_zeros(hkv, s, d).index_copy_(1, rows, part) for part in sink]
                    if sharded:
                        for part in full:
                            dist.all_reduce(part)
                    got.append([out.detach()] + [a.grad for a in x] + full)
                for a, b in zip(*got):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
                # the self part divided by query rows: runs of 2 dealt round-robin, or all on rank 0
                for deal in ([(i // 2) % world for i in range(t)], [0] * t):
                    index = [torch.tensor([i for i in range(t) if deal[i] == r], dtype=torch.long)
                             for r in range(world)]
                    x = [a.clone().requires_grad_() for a in (q, k, v)]
                    sink = (pk.new_zeros(hkv, len(mine), d), pv.new_zeros(hkv, len(mine), d))
                    seg = KVSegment(pk[:, mine].contiguous(), pv[:, mine].contiguous(), 0, sink, cp=cp)
                    out = prefix_causal_attention(*x, prefixes=[seg], q_start=s + 2, scale=d ** -0.5, block_size=3,
                                                  allow_fused=fused, own_rows=(index, cp))
                    out.backward(dout)
                    full = [pk.new_zeros(hkv, s, d).index_copy_(1, mine, part) for part in sink]
                    for part in full:
                        dist.all_reduce(part)
                    want = got[0]
                    own = index[rank]
                    for a, b in zip([out.detach(), x[0].grad[:, own]] + [a.grad for a in x[1:]] + full,
                                    [want[0], want[1][:, own]] + want[2:]):
                        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


def walk_raises_on_one_rank(rank: int, world: int, init_file: str) -> None:
    """`partial_gradients` around a walk that raises on one rank (first rank 1, then rank
    0): the failing rank raises its own error, its peer a DistributedError (the sum's
    collective times out on a short-timeout group), and on every rank every `.grad` is
    afterwards the tensor it held before the call, unchanged; one that had none has none."""
    from longstraw.parallel.context import ContextParallel, DistributedError
    from longstraw.parallel.gradients import partial_gradients

    _init(rank, world, init_file)
    try:
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3, dtype=torch.float64)
        extra = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))  # no gradient before the call
        x = torch.randn(5, 4, dtype=torch.float64)
        layer(x).pow(2).sum().backward()  # the replicated earlier gradient, alike on every rank
        params = [layer.weight, layer.bias, extra]
        for failing in (1, 0):
            cp = ContextParallel.from_default_group(dist.new_group(backend="gloo",
                                                                   timeout=datetime.timedelta(seconds=3)))
            before = [(p.grad, None if p.grad is None else p.grad.clone()) for p in params]
            try:
                with partial_gradients(params, cp):
                    ((layer(x) * (rank + 2)).sum() + extra.sum()).backward()  # partial gradients
                    if rank == failing:
                        raise RuntimeError(f"the walk fails on rank {failing}")
            except RuntimeError as exc:
                assert (rank == failing) != isinstance(exc, DistributedError), (rank, failing, exc)
            else:
                raise AssertionError("partial_gradients swallowed the error")
            for p, (held, value) in zip(params, before):
                assert p.grad is held, (rank, failing)
                assert held is None or torch.equal(held, value), (rank, failing)
    finally:
        dist.destroy_process_group()


def replicas_agree(rank: int, world: int, init_file: str) -> None:
    """Replicated gradients agree by construction: rank 1's replay backward is perturbed
    (every gradient it computes scaled by 1 + 1e-7, as a nondeterministic `index_add_`
    order would move it), and after two accumulated steps every rank's `.grad` is bitwise
    rank 0's, in detached mode and exact mode's replicated walk (a broadcast) and divided
    walk (its one sum), and rank 0's is the single process's. Then `check_replicas` passes
    on equal weights and raises on every rank, naming the parameter and rank 1, when rank
    1's copy of one weight moves by one ulp."""
    from longstraw.parallel.context import DistributedError, check_replicas

    _init(rank, world, init_file)
    try:
        model = tiny_model("qwen3")
        groups = [random_group(97, 23, [5, 3], seed=3), random_group(97, 23, [2, 4], seed=4)]
        kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3)
        runs = (("detached", True), ("exact", False), ("exact", True))
        want = {}
        for mode, divide in runs:
            model.zero_grad(set_to_none=True)
            engine = ls.Engine(model, ls.ExecConfig(mode=mode, **kw))
            for group in groups:
                engine.step(group)
            want[mode] = grads_of(model)
        if rank == 1:  # a different summation order on this rank only
            for p in model.parameters():
                p.register_hook(lambda g: g * (1 + 1e-7))
        for mode, divide in runs:
            model.zero_grad(set_to_none=True)
            engine = ls.Engine(model, ls.ExecConfig(mode=mode, context_parallel=True, divide_walk=divide, **kw))
            for group in groups:
                result = engine.step(group)
            assert result.metrics["divided_walk"] == float(mode == "exact" and divide)
            got = grads_of(model)
            flat = torch.cat([g.reshape(-1) for g in got.values()])
            assert all(torch.equal(x, flat) for x in all_gather_tensors(flat)), (rank, mode, divide)
            # rank 0's gradient (rank 1's walk partials are perturbed in a divided walk: 1e-7)
            assert_grads_close(got, want[mode], 1e-6 if mode == "exact" and divide else 1e-9)
        assert check_replicas(model) == sum(1 for p in model.parameters() if p.requires_grad)
        name, weight = "model.layers.1.mlp.down_proj.weight", model.model.layers[1].mlp.down_proj.weight
        if rank == 1:
            with torch.no_grad():
                weight.view(-1)[5] = torch.nextafter(weight.view(-1)[5], torch.tensor(float("inf"), dtype=weight.dtype))
        try:
            check_replicas(model)
        except DistributedError as exc:
            assert name in str(exc) and "rank(s) [1]" in str(exc) and "1 of" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: check_replicas missed a one-ulp divergence")
    finally:
        dist.destroy_process_group()


def all_gather_tensors(x: torch.Tensor) -> list:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


TREE_CASES = {"dense": FLOAT64, "hybrid": FLOAT64, "glm_sparse": FLOAT64}
"""Prefix trees under context parallelism: the cases, each with its tolerance of tree
against flat (float64 throughout: HF's float32 GDN decay and MoE router, left in, round a
tree's sums differently from the flat group's, 1e-7 to 1e-6 apart)."""


def run_trees(rank: int, world: int, init_file: str) -> None:
    """Prefix trees (`share_response_prefixes`) with context parallelism: the shared
    segments run replicated on every rank, as branches do, against the sharded prompt.
    Every rank's tree step equals the single-process tree step (FLOAT64) and the single-process flat step (the case's tolerance); its score
    equals the single-process one."""
    _init(rank, world, init_file)
    try:
        models: dict = {}
        steps = [(name, mode) for name in TREE_CASES for mode in ("detached", "exact")]
        refs = on_one_rank_each([lambda n=name, m=mode, k=key: _tree_run(models, n, m, k)
                                 for name, mode in steps for key in ("one", "flat")])
        for i, (name, mode) in enumerate(steps):
            rel = TREE_CASES[name]
            (loss, got, scores), (one_loss, one, one_scores), (flat_loss, flat, _) = (
                _tree_run(models, name, mode, "cp"), *refs[2 * i:2 * i + 2])
            assert abs(loss - one_loss) <= 1e-9 * abs(one_loss) + 1e-13, (name, mode)
            assert_grads_close(got, one, FLOAT64)
            assert abs(loss - flat_loss) <= rel * abs(flat_loss) + 1e-13, (name, mode)
            assert_grads_close(got, flat, rel)
            for s, o in zip(scores, one_scores):
                torch.testing.assert_close(s, o, rtol=1e-9, atol=1e-12)
    finally:
        dist.destroy_process_group()


def _tree_run(models: dict, name: str, mode: str, key: str) -> tuple:
    """One `run_trees` step of CASES[name] (built once per process): "cp" the tree step
    under context parallelism, "one" in one process, "flat" one process without prefix
    sharing; its loss, every .grad and the group's scores."""
    if name not in models:
        models[name] = CASES[name]() if name == "hybrid" else float64_norms(CASES[name]())
    model = models[name]
    group = tree_group(["ABD", "ABE", "LC", "L", "AC"], prompt_len=23)
    extra = {"cp": dict(context_parallel=True), "one": {}, "flat": dict(share_response_prefixes=False)}[key]
    with float64_throughout(model):
        model.zero_grad(set_to_none=True)
        engine = ls.Engine(model, ls.ExecConfig(chunk_size=6, attention_block_size=4, shard_block_size=3, mode=mode,
                                                **extra))
        return engine.step(group).loss, grads_of(model), engine.score(group)


def decode_merge_in_one_collective(rank: int, world: int, init_file: str) -> None:
    """A decode step merges each attention layer's shard partials in ONE collective
    (`merge_gathered`), identical on every rank and, at W = 2, bitwise equal to the two
    all-reduces of `merge_across_ranks`; a step then costs 1 + (attention layers)
    collectives (the sampled tokens' broadcast, one merge per layer)."""
    from longstraw.parallel.collectives import merge_across_ranks, merge_gathered
    from longstraw.parallel.context import ContextParallel

    _init(rank, world, init_file)
    try:
        cp = ContextParallel.from_default_group(None)
        g = torch.Generator().manual_seed(rank)
        for dtype in (torch.float32, torch.float64):
            out = torch.randn(2, 6, 8, generator=g).to(dtype)  # (Hkv, G*g, Dv)
            lse = (4 * torch.randn(2, 6, generator=g)).to(dtype)  # (Hkv, G*g)
            lse[0, 1] = float("-inf")  # this rank saw nothing for that row
            lse[1, 2] = float("-inf") if rank == 0 else lse[1, 2]
            if rank == world - 1:
                lse[0, 3] = float("-inf")
            got, got_lse = merge_gathered(out, lse, cp)
            want, want_lse = merge_across_ranks(out, lse, cp)
            if world == 2:
                assert torch.equal(got, want) and torch.equal(got_lse, want_lse), (dtype, got - want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
            for other, other_lse in zip(all_gather_tensors(got), all_gather_tensors(got_lse)):
                assert torch.equal(other, got) and torch.equal(other_lse, got_lse)  # the same bits everywhere

        model = CASES["dense"]()
        attention_layers = len(model.model.layers)
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, chunk_size=6, attention_block_size=4,
                                                shard_block_size=3))
        prompt = random_group(97, 23, [1], seed=3).prompt
        state = engine.generate(prompt, num_samples=3, max_new_tokens=2).state
        calls = []
        saved = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_single",
                                                        "all_gather_into_tensor", "broadcast") if hasattr(dist, name)}

        def counting(name):
            def call(*args, **kwargs):
                calls.append(name)
                return saved[name](*args, **kwargs)
            return call

        counts = []
        try:
            for name in saved:
                setattr(dist, name, counting(name))
            for new_tokens in (5, 9):
                calls.clear()
                engine.generate(prompt, num_samples=3, max_new_tokens=new_tokens, state=state,
                                generator=torch.Generator().manual_seed(7))
                counts.append(len(calls))
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        per_step = (counts[1] - counts[0]) / 4  # four more decode steps
        assert per_step == 1 + attention_layers, (counts, per_step, attention_layers)
    finally:
        dist.destroy_process_group()


def run_kept_outputs(rank: int, world: int, init_file: str) -> None:
    """Exact mode with kept attention outputs (`ExecConfig.keep_attention_outputs`) under
    context parallelism, capture and walk replicated (a divided walk attends for its own
    rows and keeps none): capture keeps the outputs and LSEs merged across the ranks'
    shards, the walk's attention backward runs from them; loss and every gradient equal
    one process's walk that attends again."""
    _init(rank, world, init_file)
    try:
        model = float64_norms(tiny_model("qwen3"))
        group = random_group(97, 23, [5, 1, 7], seed=3)
        exec_kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3, mode="exact")
        model.zero_grad(set_to_none=True)
        single = ls.Engine(model, ls.ExecConfig(**exec_kw)).step(group)
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, divide_capture=False, divide_walk=False,
                                                keep_attention_outputs=True, **exec_kw))
        result = engine.step(group)
        assert result.metrics["kept_attention_bytes"] > 0 and result.metrics["divided_walk"] == 0.0
        assert abs(result.loss - single.loss) <= 1e-9 * abs(single.loss) + 1e-13
        assert_grads_close(grads_of(model), want, FLOAT64)
    finally:
        dist.destroy_process_group()
