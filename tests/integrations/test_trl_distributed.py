"""`LongStrawGRPOTrainer` on many processes (gloo, CPU, float64) equals one process over
the same global batch: one SGD step (lr 1), to 1e-9 on the logged loss, every gradient the
step applied and every updated parameter, on every rank. The ranks are spawned with the
env torchrun sets (accelerate's PartialState picks it up); the reference runs in this
process. Sampling is real: the completions (and so the rewards) must match too.

W = 2 with C = 2 (one prompt over both ranks) and C = 1 (plain data parallelism) run by
default, with TRL's tools at C = 2 (C = 1 in exact mode under `-m slow`); W = 4, C = 2
(two data-parallel groups of two) is opt-in (`-m slow`).
"""

import socket

import pytest
import torch
from tests.distributed_worker import spawn_each
from tests.reference import assert_grads_close, assert_loss_close

pytest.importorskip("trl")
pytest.importorskip("datasets")
from tests.integrations import trl_worker as worker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, *args) -> list[int]:
    """Spawn `world` ranks of `worker.rank_main` and join each by itself; their exit codes."""
    return spawn_each(worker.rank_main, world, (world, _free_port(), *args), worker.PG_TIMEOUT_S + 300)


def _spawn(case: str, world: int, context: int, out_dir, steps: int, fsdp: bool = False, clip: float = 0.0
           ) -> list[dict]:
    """Run `case` on `world` ranks; return each rank's record (a rank's error in the failure)."""
    codes = _run_ranks(world, str(out_dir), case, context, "", steps, fsdp, clip)
    errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
    assert not errors and codes == [0] * world, (errors, codes)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture
def float64_default():
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(saved)


def _assert_equal_runs(ours: dict, want: dict, rel: float = 1e-9) -> None:
    assert all(torch.equal(ours["before"][n], want["before"][n]) for n in want["before"])
    assert len(ours["logs"]) == len(want["logs"]) == len(want["grads"]) == len(ours["grads"]) >= 1
    for got_log, want_log in zip(ours["logs"], want["logs"]):
        for key in ("reward", "reward_std", "completions/mean_length"):  # the same completions, each seen once
            assert got_log[key] == pytest.approx(want_log[key], rel=1e-12, abs=1e-12), key
        assert_loss_close(got_log["loss"], want_log["loss"], rel)
    for got, grads in zip(ours["grads"], want["grads"]):
        assert set(got) == set(grads) and any(g.abs().sum() > 0 for g in grads.values())
        assert_grads_close(got, grads, rel)
    for name, w in want["after"].items():  # SGD lr 1 (one step: after = before - grad)
        assert (ours["after"][name] - w).abs().max() <= rel * w.abs().max() + 1e-12, name


FSDP_CLIP = 0.05
"""max_grad_norm of the FSDP2 runs (and their references): below every step's gradient norm,
so the Trainer's clipping (its norm over the shards and the replicated parameters) acts."""


def _check(case, world, context, tmp_path, steps=1, fsdp=False):
    clip = FSDP_CLIP if fsdp else 0.0
    ranks = _spawn(case, world, context, tmp_path / "ranks", steps, fsdp, clip)
    want = worker.record_run(case, str(tmp_path / "one"), data_groups=world // context, steps=steps,
                             max_grad_norm=clip)
    assert not fsdp or all(log["grad_norm"] > clip for log in want["logs"])  # the clipping acts
    for record in ranks:
        assert record["context"] == context  # the engine's context parallelism over C ranks
        assert bool(record["sharded"]) == fsdp and all(".layers." in n for n in record["sharded"])
        if fsdp and worker.CASES[case][2].get("mode") == "exact":  # FSDP2's reduce-scatter sums the walk's partials
            assert record["divided_walks"] and all(w == 1.0 for w in record["divided_walks"]), record["divided_walks"]
        _assert_equal_runs(record, want)


@pytest.mark.parametrize("case,steps", [("detached", 2), ("exact", 1)])
def test_two_ranks_one_prompt_each_step_equals_one_process(tmp_path, float64_default, case, steps):
    """W = 2, C = 2: every prompt divided over both ranks. Two optimizer steps: the second
    generation batch must be the one a single process takes (the loader dealt per group)."""
    _check(case, 2, 2, tmp_path, steps)


@pytest.mark.parametrize("case", ["detached", "lora_beta"])
def test_two_data_parallel_ranks_equal_one_process_over_the_global_batch(tmp_path, float64_default, case):
    """W = 2, C = 1: two prompts per rank, four in the global batch ("batch" scaling over all)."""
    _check(case, 2, 1, tmp_path)


@pytest.mark.parametrize("case,context", [("tools", 2), pytest.param("tools_exact", 1, marks=pytest.mark.slow)])
def test_tools_on_two_ranks_equal_one_process(tmp_path, float64_default, case, context):
    """TRL's tool loop (`tools=[lookup]`, up to 2 calls per completion) on W = 2: each
    rank runs its data-parallel group's tool calls and continues them from its held prompt
    states (C = 2: both ranks of the group together). The coin model calls or answers, so
    completions with 0, 1 and 2 calls share a group."""
    ranks = _spawn(case, 2, context, tmp_path / "ranks", 1)
    want = worker.record_run(case, str(tmp_path / "one"), data_groups=2 // context)
    log = want["logs"][0]
    for record in ranks:
        assert record["context"] == context
        _assert_equal_runs(record, want)
        assert record["logs"][0]["tools/call_frequency"] == log["tools/call_frequency"]
    assert 0 < log["tools/call_frequency"] < 1 and log["longstraw/tool_continuations"] > 0  # calls and answers


@pytest.mark.slow
def test_images_on_two_ranks_one_prompt_equal_one_process(tmp_path, float64_default):
    """W = 2, C = 2 with images (the narrowed tiny VLM, two screenshots per prompt, exact):
    each prompt's images dealt over both ranks for the tower, the divided walk's image-row
    gradient summed; loss and every gradient, the tower's included, equal one process's."""
    ranks = _spawn("images_exact", 2, 2, tmp_path / "ranks", 1)
    want = worker.record_run("images_exact", str(tmp_path / "one"), data_groups=1)
    assert any(".visual." in n and g.abs().sum() > 0 for n, g in want["grads"][0].items())
    for record in ranks:
        assert record["context"] == 2
        assert record["divided_walks"] and all(w == 1.0 for w in record["divided_walks"])
        _assert_equal_runs(record, want)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["detached", "exact", "lora_beta"])
def test_four_ranks_two_groups_of_two_equal_one_process(tmp_path, float64_default, case):
    _check(case, 4, 2, tmp_path)


def test_fsdp2_two_ranks_one_prompt_equals_one_process(tmp_path, float64_default):
    """W = 2, C = 2, `longstraw_fsdp=True`: the decoder layers sharded over both ranks (a
    (1, 2) HSDP mesh, its replica all-reduce held), LoRA with beta > 0 in exact mode (the
    divided walk sums its partials through FSDP2's reduce-scatter), the gradient clipped;
    the full gradients gathered from the shards equal one process's."""
    _check("lora_beta", 2, 2, tmp_path, fsdp=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["detached", "exact", "lora_beta"])
def test_fsdp2_four_ranks_on_a_2d_mesh_equal_one_process(tmp_path, float64_default, case):
    """W = 4, C = 2, `longstraw_fsdp=True`: a (2, 2) HSDP mesh, sharded within each group,
    replicated across the two; FSDP2's all-reduce across them held, LongStraw's one sum per
    step instead."""
    _check(case, 4, 2, tmp_path, fsdp=True)


def test_fsdp2_refuses_one_rank_per_prompt_and_a_premade_optimizer(tmp_path):
    """`longstraw_fsdp=True` with C = 1 (nothing to shard over that pairs up) and with an
    optimizer made before the sharding: one ConfigError naming both, at construction."""
    import longstraw as ls

    premade = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), None)
    with pytest.raises(ls.ConfigError) as info:
        worker.record_run("detached", str(tmp_path), data_groups=1, fsdp=True, optimizers=premade)
    message = str(info.value)
    assert "longstraw_fsdp=True with longstraw_context_parallel_size=1" in message, message
    assert "longstraw_fsdp=True with optimizers=" in message, message
    with pytest.raises(ls.ConfigError, match="longstraw_fsdp must be True or False, got 'yes'"):
        worker.record_run("detached", str(tmp_path), data_groups=1, fsdp="yes")


def test_the_trainers_own_fsdp_config_is_refused_naming_longstraw_fsdp():
    """TRL's / accelerate's FSDP (`args.fsdp`) stays refused; the message names the option
    that does FSDP2 here."""
    import trl

    from longstraw.integrations.trl_settings import unsupported_settings

    args = trl.GRPOConfig("unused", use_cpu=True, report_to=[])
    args.fsdp = "full_shard"
    assert any("Trainer's FSDP" in m and "longstraw_fsdp=True" in m for m in unsupported_settings(args))


@pytest.mark.parametrize("context,where,cause", [(1, "update", "500"), (2, "update", "500"),
                                                 (1, "generation", "PositionLimitError")])
def test_a_rank_that_fails_a_check_fails_every_rank_together(tmp_path, context, where, cause):
    """Rank 1 alone fails a LongStraw check (its update's group holds token 500; its
    generation refuses a prompt): every rank raises a DistributedError naming rank 1 and
    the cause, learnt from one all-gather (no rank waits out the process-group timeout)."""
    out = tmp_path / "ranks"
    out.mkdir()
    codes = _run_ranks(2, str(out), "detached", context, where)
    assert all(code != 0 for code in codes), codes
    for rank in (0, 1):
        report = (out / f"rank{rank}.err").read_text()
        assert report.startswith("DistributedError") and "rank 1" in report and cause in report, report
        assert "timed out" not in report.lower() and "timeout" not in report.lower(), report


def test_a_context_parallel_size_that_does_not_divide_the_processes_is_refused(tmp_path):
    """One process, C = 2: refused at construction, before TRL builds anything."""
    import longstraw as ls

    with pytest.raises(ls.ConfigError, match="context-parallel size 2 does not divide the 1 processes"):
        worker.record_run("detached", str(tmp_path), data_groups=1, context=2)


@pytest.mark.slow  # 27 s on 2 shared cores
def test_a_nan_on_rank_one_skips_the_step_on_every_rank(tmp_path, float64_default, monkeypatch):
    """W = 2, C = 1: rank 1's gradient of the first optimizer step is NaN (LONGSTRAW_FAULT
    nan@1:0), rank 0's is finite. Both ranks skip it (one all-reduce of a flag): the Trainer's
    optimizer step finds no gradient, the weights after step 1 are the initial ones on both
    ranks, the skip is logged, and step 2 trains."""
    monkeypatch.setenv("LONGSTRAW_FAULT", "nan@1:0")  # the spawned ranks inherit it
    ranks = _spawn("detached", 2, 1, tmp_path / "ranks", 2)
    for record in ranks:
        assert record["grads"][0] == {}  # every .grad dropped before HF's optimizer.step
        for name, w in record["before"].items():
            assert torch.equal(record["params_at"][1][name], w), name
        assert any(not torch.equal(record["params_at"][2][n], w) for n, w in record["before"].items())
        assert [log["longstraw/skipped_nonfinite_steps"] for log in record["logs"]] == [1.0, 1.0]
    for name, w in ranks[0]["after"].items():
        assert torch.equal(ranks[1]["after"][name], w), name  # the replicas stayed equal
