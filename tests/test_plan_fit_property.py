"""`plan/fit.py`'s search against an exhaustive one (issue 43): over random models, steps,
budgets and pins (with a generate phase, images, a replicated walk and chunks above 4,096 among
them), the returned config planned again fits, and when "nothing fits" is
returned no point of the (small) space the search covers fits. Torch-free."""

import itertools
import random
from dataclasses import replace

import pytest

from longstraw.plan import PlanConfig, estimate
from longstraw.plan.fit import CHUNKS, PIECES, Fit, NoFit, _savers, chunks_of, search

MODELS = ("qwen3-8b", "qwen3.6-27b", "glm-5.2")
FREE = ("recompute_layers", "offload_state", "offload_snapshots", "shard_params", "divide_capture",
        "expert_parallel", "divide_walk")


def _case(seed: int):
    rng, extra = random.Random(seed), random.Random(1000 + seed)
    model = MODELS[seed % len(MODELS)]
    hybrid_exact = model == "qwen3.6-27b" and seed % 2  # exact snapshots, which grow as P / chunk
    base = PlanConfig(prompt_tokens=1048576 if hybrid_exact else rng.choice((65536, 262144, 1048576)),
                      group=rng.choice((2, 8)), response_tokens=rng.choice((512, 1024, 2048)),
                      gpus=rng.choice((1, 2, 4)), mode="exact" if hybrid_exact else rng.choice(("detached", "exact")),
                      lora_rank=rng.choice((None, 16)), reserve=0,
                      # a rollout phase and (the hybrid) images, from their own draws: the other draws stay the seed's
                      generate=extra.choice((False, True)),
                      **(dict(images=8, image_tokens=1024) if model == "qwen3.6-27b" and extra.random() < 0.5 else {}))
    pinned = {"mode"} | set(rng.sample(FREE, 4))  # three on/off options free: the product stays small
    for name in pinned - {"mode"}:
        values = {"recompute_layers": (False, True), "offload_state": (False, True), "shard_params": (False, True),
                  "divide_capture": (True,), "expert_parallel": (False,), "divide_walk": (True, False),
                  "offload_snapshots": (None, False) + ((True,) if base.mode == "exact" else ())}[name]
        base = replace(base, **{name: rng.choice(values)})
    if hybrid_exact:
        pinned.add("offload_snapshots")
        base = replace(base, offload_snapshots=False)
    return model, base, pinned, rng


def _space(model, base, pinned):
    """Every point the search covers: its on/off combinations x pieces x chunks."""
    pieces = [None] + [p for p in PIECES if p < base.response_tokens]
    chunks = sorted(set(CHUNKS) | {base.chunk_size}, reverse=True)
    for combo in _savers(model, base, pinned):
        for p, ch in itertools.product(pieces, chunks_of(replace(base, **combo), chunks)):
            c = replace(base, **combo, branch_chunk_size=p, chunk_size=ch)
            if not (c.offload_state and c.keep_graph_bytes):
                yield c


@pytest.mark.parametrize("seed", range(12))
def test_the_search_returns_a_fit_that_fits_and_nothing_fits_only_when_nothing_does(seed):
    model, base, pinned, rng = _case(seed)
    peaks = sorted(estimate(model, c)["peak_bytes_per_rank"] for c in _space(model, base, pinned))
    # just under the space's leanest point, exactly it (only the leanest fit), between it and the fattest
    for budget in (int(0.97 * peaks[0]), peaks[0], int(rng.uniform(peaks[0], peaks[-1]))):
        got = search(model, replace(base, gpu_memory=budget), pinned)
        if isinstance(got, Fit):
            again = estimate(model, got.config)
            assert again["peak_bytes_per_rank"] <= budget
            assert all(getattr(got.config, k) == getattr(base, k) for k in pinned)
        else:
            assert isinstance(got, NoFit) and peaks[0] > budget, (peaks[0], budget)
