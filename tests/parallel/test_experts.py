"""Expert parallelism over the context-parallel group (gloo, CPU, float64, spawned).

At W = 3 (uneven slices: 4 experts as 1, 1, 2) and W = 2, an expert-parallel engine
equals the replicated MoE (today's context parallelism, every expert on every rank) to
1e-9: the step's loss and every parameter gradient (the experts' gathered from their
owners) in detached and exact mode, with the capture and walk divided (gather +
reduce-scatter) and replicated (all-reduce), score, and greedy generation; for GLM-5
(`glm_moe_dsa`, sparse DSA) and Qwen3-MoE (Mixtral: -m slow). Bad input is refused when
the engine is built, before any work (`tests/experts_worker.py`).
"""

import pytest

import longstraw as ls
from tests import experts_worker as worker
from tests.ranks import spawn


def test_expert_parallel_equals_the_replicated_moe_at_three_ranks_and_refuses_bad_input(tmp_path):
    """GLM-5 (HF's eager experts) and Qwen3-MoE through HF's batched_mm experts forward
    (whose sentinel rows need HF's `_is_expert_parallel`) at W = 3, both modes; first, in
    the same processes, fewer experts than ranks and a model without experts are refused
    when the engine is built."""
    spawn(worker.run_expert_parallel, args=(3, str(tmp_path / "init"), ["glm_sparse", "qwen3_moe_batched"],
                                               ["detached", "exact"], True,
                                               str(tmp_path)), nprocs=3, join=True)
    for rank in range(3):
        assert "2 experts for 3 ranks" in (tmp_path / f"rank{rank}.err").read_text()
        assert "no MoE experts module" in (tmp_path / f"rank{rank}.dense").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("world,cases,divide", [(3, ["qwen3_moe", "mixtral"], True),
                                                (2, ["glm_sparse", "qwen3_moe"], True),
                                                (2, ["glm_sparse", "mixtral"], False)])
def test_expert_parallel_equals_the_replicated_moe_more_cases(tmp_path, world, cases, divide):
    spawn(worker.run_expert_parallel, args=(world, str(tmp_path / "init"), cases, ["detached", "exact"], divide),
          nprocs=world, join=True)


def test_expert_parallel_needs_context_parallelism():
    """Refused when the engine is built (the trainer sets context_parallel itself, so the
    config alone may ask for experts first); the model is left whole."""
    from tests.reference import tiny_family

    model = tiny_family("qwen3_moe")
    shapes = [p.shape for p in model.parameters()]
    with pytest.raises(ls.ConfigError, match="context_parallel=True"):
        ls.Engine(model, ls.ExecConfig(expert_parallel=True))
    assert [p.shape for p in model.parameters()] == shapes and all(p.grad is None for p in model.parameters())
    with pytest.raises(ls.ConfigError, match="True or False"):
        ls.ExecConfig(context_parallel=True, expert_parallel=1)
