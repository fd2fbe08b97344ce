"""Exact mode with kept capture graphs (`ExecConfig.keep_graph_bytes`): the same loss and
gradients as recomputing every chunk, for dense, hybrid (GDN) and MLA + sparse DSA
models, with every chunk kept, some kept, and none; the walk recomputes exactly the
chunks whose graphs were not kept."""

import contextlib

import pytest
import torch

import longstraw as ls
from longstraw.engine.kept_graphs import SavedBytes, chunks_to_keep
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    float64_hybrid,
    float64_norms,
    grads_of,
    random_group,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)

MODELS = {
    "qwen3": lambda: float64_norms(tiny_model("qwen3")),
    "qwen3_5": lambda: tiny_hybrid("qwen3_5"),
    "glm_moe_dsa_sparse": lambda: tiny_mla("glm_moe_dsa"),
}


def _step(model, group, keep, monkeypatch):
    """(loss, grads, chunks recomputed in the reverse walk) of one exact step."""
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=5, attention_block_size=4, keep_graph_bytes=keep))
    recomputed = []
    run = engine.adapter.run

    def spy(ids, start, states, *, phase, **kw):
        if phase == "recompute" and states[0].start == 0 and len(states) == 1:
            recomputed.append(start)
        return run(ids, start, states, phase=phase, **kw)

    monkeypatch.setattr(engine.adapter, "run", spy)
    model.zero_grad(set_to_none=True)
    result = engine.step(group)
    chunks = -(-(group.prompt.numel() - 1) // 5)
    assert result.metrics["kept_graph_chunks"] == chunks - len(recomputed)  # reported: walked without recompute
    return result.loss, grads_of(model), recomputed


@pytest.mark.parametrize("name", list(MODELS))
def test_kept_graphs_give_the_recomputed_gradient(name, monkeypatch):
    model = MODELS[name]()
    group = random_group(97, 22, [4, 1, 6], seed=5)  # prompt[:-1] = 21 tokens: chunks at 0, 5, 10, 15, 20
    ctx = float64_hybrid(model) if name == "qwen3_5" else contextlib.nullcontext()
    with ctx:
        loss0, want, recomputed0 = _step(model, group, 0, monkeypatch)
        assert sorted(recomputed0) == [0, 5, 10, 15, 20]
        loss_all, got_all, recomputed_all = _step(model, group, 1 << 40, monkeypatch)
        assert recomputed_all == []  # every chunk's graph was kept: no recomputation
        with SavedBytes(model) as saved, torch.enable_grad():
            engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=5))
            state = engine.adapter.new_state(5, exact=True)
            state.enable_grad_buffers()
            engine.adapter.run(group.prompt[:5], 0, [state], phase="capture", block_size=4)
        budget = 2 * saved.total + saved.total // 2  # two of the five graphs fit
        loss_some, got_some, recomputed_some = _step(model, group, budget, monkeypatch)
        assert sorted(recomputed_some) == [0, 5, 10]  # the last two were kept
    for loss, got in ((loss_all, got_all), (loss_some, got_some)):
        assert_loss_close(loss, loss0, 1e-12)
        assert_grads_close(got, want, 1e-10)


def test_chunks_to_keep_takes_the_last_chunks_that_fit():
    starts = [0, 4, 8, 12]
    assert chunks_to_keep(starts, 100, 250) == {8, 12}
    assert chunks_to_keep(starts, 100, 99) == set()
    assert chunks_to_keep(starts, 100, 10**9) == set(starts)


def test_saved_bytes_counts_the_graph_not_the_parameters():
    lin = torch.nn.Linear(64, 64, dtype=torch.float64)
    x = torch.randn(10, 64, dtype=torch.float64, requires_grad=True)
    with SavedBytes(lin) as saved:
        y = torch.tanh(lin(x))
    assert y.requires_grad
    # x (saved by the matmul for dW) and tanh's output; never the 64 x 64 weight
    assert saved.total == 2 * 10 * 64 * 8


def test_a_negative_budget_is_refused():
    with pytest.raises(ls.ConfigError, match="keep_graph_bytes"):
        ls.ExecConfig(keep_graph_bytes=-1)
