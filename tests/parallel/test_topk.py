"""`parallel.topk.global_topk` on gloo at W = 2, 3, 4 against one process's selection
(`dsa.select_candidates` and its twin `naive.naive_select_candidates` over every rank's
candidates at once): integer scores so ties meet at the cut and across ranks, empty
slots, rows with fewer candidates than k (and none at all), float32 and float64; and the
bytes a rank receives = `plan.traffic.radix_topk_bytes_per_query` (`shard_topk`: the planner's `candidate_bytes_per_query`)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from longstraw.ops.dsa import select_candidates
from longstraw.ops.naive import naive_select_candidates
from longstraw.parallel.collectives import Traffic
from longstraw.parallel.context import ContextParallel
from longstraw.parallel.topk import global_topk, shard_topk
from longstraw.plan.traffic import candidate_bytes_per_query, radix_topk_bytes_per_query
from tests.ranks import spawn

B, N, BLOCK = 9, 23, 3  # queries, positions, deal block (position p on rank (p // BLOCK) % W)


def _case(seed: int, dtype: torch.dtype):
    """Every position's score per query [B, N] (-inf: invisible), integers in a narrow range
    (many ties), negative ones included; row 0 sees nothing, row 1 two positions."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (B, N), generator=g).to(dtype) * 0.75
    scores[torch.rand(B, N, generator=g) < 0.3] = float("-inf")
    scores[0] = float("-inf")
    scores[1, 2:] = float("-inf")
    return scores


def _rank_candidates(scores: torch.Tensor, rank: int, world: int, topk: int):
    """This rank's candidates: the top-k of its own positions (as `mla_decode.prompt_candidates`)."""
    pos = torch.arange(N)
    mine = pos[(pos // BLOCK) % world == rank]
    cand_pos = torch.where(scores[:, mine] > float("-inf"), mine.expand(B, -1), -1)
    return select_candidates(scores[:, mine], cand_pos, topk, with_scores=True)


def check_ranks(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world=world)
    try:
        for dtype in (torch.float32, torch.float64):
            for topk in (1, 2, 5, 8, N, N + 3):
                scores = _case(topk, dtype)
                every = torch.where(scores > float("-inf"), torch.arange(N).expand(B, -1), -1)
                want_pos, want_sc = naive_select_candidates(scores, every, topk)
                assert torch.equal(select_candidates(scores, every, topk), want_pos)
                cand_pos, cand_sc = _rank_candidates(scores, rank, world, topk)
                before = Traffic.received
                got_pos, got_sc = global_topk(cand_pos, cand_sc, topk, cp)
                moved = Traffic.received - before
                assert torch.equal(got_pos, want_pos), (dtype, topk, rank, got_pos, want_pos)
                assert torch.equal(got_sc, want_sc), (dtype, topk, rank)
                assert got_sc.dtype == dtype
                before = Traffic.received
                got = shard_topk(cand_pos, cand_sc, topk, cp)  # the cheaper exchange, planned as such
                assert torch.equal(got[0], want_pos) and torch.equal(got[1], want_sc)
                assert abs(Traffic.received - before - B * candidate_bytes_per_query(world, topk, dtype.itemsize)) <= 4
                assert abs(moved - B * radix_topk_bytes_per_query(world, topk, dtype.itemsize)) <= 4, (moved, dtype, topk)
    finally:
        dist.destroy_process_group()


def test_cases_have_ties_at_the_cut():
    """The data above does exercise the tie rule: some row's k-th score is shared by a
    position left out."""
    for topk in (2, 5, 8):
        scores = _case(topk, torch.float64)
        every = torch.where(scores > float("-inf"), torch.arange(N).expand(B, -1), -1)
        pos, sc = naive_select_candidates(scores, every, topk)
        cut = sc[:, -1:]
        left_out = (scores == cut) & ~torch.zeros(B, N, dtype=torch.bool).scatter(1, pos.clamp(min=0), True)
        assert (left_out & (cut > float("-inf"))).any()


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)])
def test_global_topk_is_one_process_selection(world, tmp_path):
    spawn(check_ranks, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


def test_planned_bytes_flat_in_world():
    """The bytes per query stay within the counts' 4 bytes a rank of each other from W = 2 to 1,024
    (the all-gather they replace: (W - 1) K 8)."""
    k = 2048
    small, large = radix_topk_bytes_per_query(2, k), radix_topk_bytes_per_query(1024, k)
    assert large - small < 2 * small + 4 * 1024
    assert large < 0.01 * (1023 * k * 8)
