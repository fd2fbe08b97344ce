"""Context parallelism's DSA selection across ranks scores its queries in blocks of
`defaults.select_query_block` queries: the engine (`models/mla._select_across_ranks`) and the
planner (`plan.working.dsa_selection_bytes`) follow the one rule. Its loop over several
blocks equals one process's selection: `tests/parallel/test_distributed.py`'s
"glm_sparse/select2" case (blocks of 2 queries, gloo, W = 2)."""

from __future__ import annotations

import pytest

from longstraw import defaults
from longstraw.defaults import select_query_block


def test_the_block_grows_as_a_rank_sees_fewer_keys():
    assert select_query_block(73_472) == 512  # GLM-5.2 on 32 ranks at P = 2,088,960: a shard + R
    assert select_query_block(524_288) == 128 == select_query_block(1 << 30)  # never below 128
    assert select_query_block(1) == 1024 == select_query_block(0)  # never above 1,024
    for keys in (1_000, 65_536, 100_000, 300_000):
        block = select_query_block(keys)
        assert block * keys <= defaults.SELECT_BLOCK_ELEMENTS < 2 * block * keys or block == 1024


@pytest.mark.parametrize("block", [16, None])
def test_the_engine_scores_the_rule_s_blocks(monkeypatch, block):
    """A rehearsed step of tiny GLM-5 (sparse DSA) at W = 2: replay's selection takes
    ceil(queries / block) turns of its loop per layer call, `prompt_candidates` once a
    turn (the rule, patched to blocks of 16, or its default: one block for 40 queries)."""
    import torch

    import longstraw as ls
    import longstraw.models.mla as mla
    from longstraw.models.routing import Phase, current_call
    from longstraw.tiny import tiny_model

    calls = []
    real = mla.prompt_candidates

    def counted(index_q, *args, **kwargs):
        calls.append((current_call().phase, index_q.shape[0]))
        return real(index_q, *args, **kwargs)

    monkeypatch.setattr(mla, "prompt_candidates", counted)
    if block is not None:
        monkeypatch.setattr(defaults, "SELECT_QUERY_BLOCK", block)
        monkeypatch.setattr(defaults, "SELECT_MAX_QUERY_BLOCK", block)
    config = tiny_model("glm_moe_dsa", index_topk=8).config
    ls.rehearse(config, ls.ExecConfig(context_parallel=True, chunk_size=16, mode="detached"), prompt_tokens=48,
                group=2, response_tokens=40, device="cpu", dtype=torch.float32, world_size=2)
    replay = [n for phase, n in calls if phase is not Phase.CAPTURE]  # the branches (as RECOMPUTE in replay)
    want = [16, 16, 8] if block else [40]
    assert replay and replay == want * (len(replay) // len(want))
