"""`longstraw/state/host_arena.py`: an offloaded state's host memory is one buffer per state
(rows; exact mode's gradient rows), carved into aligned, disjoint views whose total is
the planner's host bytes (`plan/offload.host_bytes`), for every family and several
sizes and dtypes. The pinned path is checked with a fake CUDA runtime: one exact-size
registration per arena, released with the last view."""

import pytest
import torch

import longstraw as ls
from longstraw.state.host_arena import HostArena
from longstraw.state.offload import Stager, has_rows
from longstraw.plan import PlanConfig, estimate
from longstraw.plan.offload import ARENA_ALIGN, arena_offsets
from longstraw.state.prompt import IndexKeys, LatentKV
from tests.state.test_offload import MODELS

SPECS = [((3, 5, 7), torch.bfloat16), ((1, 3), torch.float32), ((2, 0, 4), torch.float64), ((5,), torch.float16),
         ((2, 9, 3), torch.float64), ((1,), torch.bfloat16)]


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_views_are_aligned_disjoint_and_round_trip():
    arena = HostArena(SPECS, pin=False)
    sizes = [t.numel() * t.element_size() for t in arena.views]
    assert arena.nbytes == arena_offsets(sizes)[1] > sum(sizes)  # odd sizes: padding counted
    base = arena.buffer.data_ptr()
    spans = [_span(t) for t in arena.views]
    for (a, b), t, (shape, dtype), offset in zip(spans, arena.views, SPECS, arena.offsets):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert offset % ARENA_ALIGN == 0
        assert t.numel() == 0 or (a == base + offset and b <= base + arena.nbytes)
    spans = [s for s, t in zip(spans, arena.views) if t.numel()]
    for i, (a, b) in enumerate(spans):
        for c, d in spans[i + 1:]:
            assert b <= c or d <= a, "views overlap"
    data = [torch.randn(shape, dtype=torch.float64).to(dtype) for shape, dtype in SPECS]
    for t, x in zip(arena.views, data):
        t.copy_(x)
    for t, x in zip(arena.views, data):  # no later write clobbered an earlier view
        assert torch.equal(t, x)


def test_zeroed_arena_is_zero():
    arena = HostArena(SPECS, pin=False, zero=True)
    assert all(torch.count_nonzero(t) == 0 for t in arena.views)


# ----------------------------------------------------------------------------
# what an offloaded state allocates


def _offloaded_state(model, prompt_tokens: int, exact: bool):
    """An offloaded prompt state as `Engine.capture` allocates it (no compute)."""
    engine = ls.Engine(model, ls.ExecConfig(state_device="cpu", mode="exact" if exact else "detached"))
    state = engine.adapter.new_state(prompt_tokens - 1, exact=exact, host=True)
    state.offload = Stager(state, engine.adapter.device)
    if exact:
        state.enable_grad_buffers()
    return state


def _host_tensors(state, grads: bool) -> list[torch.Tensor]:
    out = []
    for i in state.offload.order:
        layer = state.layers[i]
        for h in [layer.latent] + ([layer.index] if layer.index is not None else []) if hasattr(layer, "latent") \
                else [layer]:
            if grads:
                out += [] if isinstance(h, IndexKeys) else [h.k_grad] + ([] if isinstance(h, LatentKV) else [h.v_grad])
            else:
                out += [h.keys] if isinstance(h, IndexKeys) else [h.k] + ([] if isinstance(h, LatentKV) else [h.v])
    return out


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "qwen2_window", "qwen3_5", "deepseek_v3", "glm_moe_dsa_sparse"])
def test_one_arena_per_state_of_the_planners_bytes(name, exact):
    """Every staged row tensor of the state shares one host buffer (the old layout: one
    allocation per layer and tensor), so do the gradient rows; their bytes, padding
    included, are the planner's host bytes at several P and dtypes."""
    padded = False
    for dtype, prompt_tokens in ((torch.float64, 21), (torch.bfloat16, 14), (torch.float32, 2), (torch.bfloat16, 37)):
        model = MODELS[name]().to(dtype)
        state = _offloaded_state(model, prompt_tokens, exact)
        rows = _host_tensors(state, grads=False)
        assert rows and all(t.device.type == "cpu" for t in rows)
        assert len({t.untyped_storage().data_ptr() for t in rows}) == 1, "one allocation for every row tensor"
        exact_bytes = sum(t.numel() * t.element_size() for t in rows)
        if exact:
            grads = _host_tensors(state, grads=True)
            assert len({t.untyped_storage().data_ptr() for t in grads}) == 1, "one allocation for the gradients"
            assert all(torch.count_nonzero(g) == 0 for g in grads)
            exact_bytes += sum(t.numel() * t.element_size() for t in grads)
        plan = estimate(model.config.to_dict(), PlanConfig(
            prompt_tokens=prompt_tokens, group=2, response_tokens=3, mode="exact" if exact else "detached",
            chunk_size=6, attention_block_size=4, dtype={torch.float64: "fp64", torch.float32: "fp32",
                                                         torch.bfloat16: "bf16"}[dtype], offload_state=True))
        assert plan["offload_host_bytes_per_rank"] == state.offload.host_bytes, (dtype, prompt_tokens)
        padded |= state.offload.host_bytes > exact_bytes
        assert len(state.offload.order) == sum(has_rows(layer) for layer in state.layers)
    assert padded, "some case should need alignment padding, so the planner is seen to count it"


def test_an_offloaded_state_stepped_again_gets_a_fresh_gradient_arena_and_frees_it():
    """Each `step` on a reused offloaded state allocates its gradient arena and frees it
    when its walk is done (the host holds only the rows between steps); the two steps
    agree exactly."""
    from tests.reference import grads_of, random_group

    model = MODELS["qwen3"]()
    engine = ls.Engine(model, ls.ExecConfig(state_device="cpu", mode="exact", chunk_size=6, attention_block_size=4))
    group = random_group(97, 21, [4, 3], seed=2)
    state = engine.capture(group.prompt, exact=True)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        result = engine.step(group, state=state)
        assert result.metrics["state_grad_bytes"] > 0  # the step held gradient rows
        assert state.grad_nbytes() == 0 and state.layers[0].k_grad is None
        assert state.offload.host_bytes == state.offload.row_arena_bytes
        runs.append((result.loss, grads_of(model)))
    (la, ga), (lb, gb) = runs
    assert la == lb and all(torch.equal(ga[k], gb[k]) for k in ga)


# ----------------------------------------------------------------------------
# the pinned path, with a fake CUDA runtime


class _FakeCudart:
    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pinned_arena_registers_exactly_its_bytes_once_and_releases_them(monkeypatch):
    import gc

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    arena = HostArena(SPECS, pin=True, zero=True)
    total = arena.nbytes
    assert [(size, flags) for _, size, flags in fake.registered] == [(total, 1)]  # exact size, not a power of two
    assert fake.registered[0][0] == arena.buffer.data_ptr()
    view = arena.views[4]
    view.fill_(2.0)
    del arena
    gc.collect()
    assert fake.unregistered == [] and torch.all(view == 2.0)  # a live view keeps the buffer registered
    del view
    gc.collect()
    assert fake.unregistered == [fake.registered[0][0]]


def test_registration_failure_is_a_clear_error(monkeypatch):
    fake = _FakeCudart()
    fake.cudaHostRegister = lambda ptr, size, flags: 2
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(RuntimeError, match="cudaHostRegister of .* bytes"):
        HostArena(SPECS, pin=True)
