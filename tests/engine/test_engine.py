"""Engine internals that the end-to-end tests cannot see on CPU."""

import pytest
import torch

from longstraw.engine.clock import clock
from longstraw.engine.replay import BranchStats
from tests.reference import random_group, tiny_hybrid, tiny_mla, tiny_model


def test_phase_timestamps_wait_for_cuda_kernels(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    clock(torch.device("cpu"))
    assert synced == []
    clock(torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]


def test_branch_statistics_stay_on_the_device_until_read():
    stats = BranchStats()
    for _ in range(3):
        stats.add(torch.tensor(0.5), {"ratio": torch.ones(4), "clipped": torch.zeros(4)})
    assert isinstance(stats.loss, torch.Tensor) and isinstance(stats.ratio, torch.Tensor)  # no float() per piece
    assert float(stats.loss) == 1.5 and stats.summary(with_kl=False) == {"ratio_mean": 1.0, "clip_fraction": 0.0}


# ----------------------------------------------------------------------------
# exact mode's state gradients live only as long as the step that spends them

_EXACT_FAMILIES = {"qwen3": lambda: tiny_model("qwen3"), "qwen3_5": lambda: tiny_hybrid("qwen3_5"),
                   "deepseek_v3": lambda: tiny_mla("deepseek_v3")}


@pytest.mark.parametrize("name", list(_EXACT_FAMILIES))
def test_exact_step_returns_holding_no_state_gradient(name, monkeypatch):
    """After `step` returns, a held state keeps only its rows (grad_nbytes() == 0) and no
    gradient buffer the step allocated is alive (weak references); a state the step
    captured itself is freed with it."""
    import weakref

    import longstraw as ls
    from longstraw.state import prompt as state_mod

    model = _EXACT_FAMILIES[name]()
    buffers = []
    zeros = state_mod.zeros_like_rows
    monkeypatch.setattr(state_mod, "zeros_like_rows", lambda t, dtype: buffers.append(zeros(t, dtype)) or buffers[-1])
    eng = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=5, attention_block_size=4))
    group = random_group(model.config.vocab_size, 17, [3, 4], seed=3)

    held = eng.capture(group.prompt, exact=True)
    result = eng.step(group, state=held)
    assert result.metrics["state_grad_bytes"] > 0  # the step did hold them
    assert held.grad_nbytes() == 0
    assert buffers, "the step allocated no gradient buffers"
    refs = [weakref.ref(b) for b in buffers]
    buffers.clear()
    assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} state-gradient buffers still alive"

    again = eng.step(group, state=held)  # stepping a held state again allocates them afresh
    assert again.loss == pytest.approx(result.loss, rel=1e-12) and held.grad_nbytes() == 0

    captured = []
    capture = eng.capture

    def spy(*args, **kwargs):
        state = capture(*args, **kwargs)
        captured.append(weakref.ref(state))
        return state

    monkeypatch.setattr(eng, "capture", spy)
    eng.step(group)
    assert len(captured) == 1 and captured[0]() is None, "the state step captured outlived it"


def test_a_step_that_fails_releases_the_held_states_gradient_buffers(monkeypatch):
    """A step that raises after allocating the state's gradient buffers (here: in the
    reverse walk) still leaves a held state with only its rows."""
    import longstraw as ls

    model = _EXACT_FAMILIES["qwen3"]()
    eng = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=5, attention_block_size=4))
    group = random_group(model.config.vocab_size, 17, [3, 4], seed=3)
    held = eng.capture(group.prompt, exact=True)

    def broken(*args, **kwargs):
        assert held.grad_nbytes() > 0  # the buffers were allocated when the walk starts
        raise RuntimeError("walk failed")

    monkeypatch.setattr(eng, "walk_back", broken)
    with pytest.raises(RuntimeError, match="walk failed"):
        eng.step(group, state=held)
    assert held.grad_nbytes() == 0
