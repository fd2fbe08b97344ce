"""The CUDA kernel dispatch of `ops/kernels.py`: the torch kernels run on CPU, in float32
and when a package is missing; with a fake fla / mamba-ssm module injected (a naive
twin that asserts the kernel's argument layout) and the device check opened, each
adapter calls it with the right layout and converts back: outputs, final states and
every input gradient (the initial state's included) equal the torch path's in float64.

The real kernels are NOT exercised here (no CUDA, neither package installed); the
`cuda` tests at the end run them against the torch path where both exist."""

import importlib.util
import sys
import types

import pytest
import torch

from longstraw.ops import kernels
from longstraw.ops.gated_delta import chunk_gated_delta_rule, gated_delta_step
from longstraw.ops.kda import chunk_kda, kda_step
from longstraw.ops.naive import naive_gated_delta_rule, naive_kda, naive_ssd_scan
from longstraw.ops.ssd import chunk_ssd_scan

F64 = torch.float64


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# ----------------------------------------------------------------------------
# fakes: the kernels' documented contracts ([B, T, H, D] layout), computed by the naive twins


def fake_kda(calls):
    """fla's chunk_kda / fused_recurrent_kda: B sequences, explicit scale, fp32-or-wider h0."""
    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **extra):
        b, t, h, dk = q.shape
        assert k.shape == g.shape == q.shape and v.shape[:3] == (b, t, h) and beta.shape == (b, t, h)
        assert not extra and output_final_state and scale == dk ** -0.5
        assert initial_state is None or (initial_state.shape == (b, h, dk, v.shape[-1])
                                         and initial_state.dtype not in kernels.HALF)
        calls.append(dict(shape=tuple(q.shape), l2=use_qk_l2norm_in_kernel, h0=initial_state is not None))
        if use_qk_l2norm_in_kernel:
            q, k = _l2(q), _l2(k)
        pairs = [naive_kda(q[i] * scale * dk ** 0.5, k[i], v[i], g[i], beta[i],
                           None if initial_state is None else initial_state[i], use_qk_l2norm=False) for i in range(b)]
        return torch.stack([o for o, _ in pairs]), torch.stack([s for _, s in pairs])
    return kernel


def fake_gdn_recurrent(calls):
    """fla's fused_recurrent_gated_delta_rule: q, k [B, T, H, K], v [B, T, HV, V], g / beta
    [B, T, HV]; value head hv reads q/k head hv // (HV // H) (fla's GVA); gk / gv between g and beta."""
    def kernel(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, **extra):
        b, t, h, dk = q.shape
        hv = v.shape[2]
        assert gk is None and gv is None and not extra and output_final_state and scale == dk ** -0.5
        assert v.shape[:2] == (b, t) and hv % h == 0 and g.shape == beta.shape == (b, t, hv)
        calls.append(dict(shape=tuple(q.shape)))
        q, k = q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)
        pairs = [naive_gated_delta_rule(q[i], k[i], v[i], g[i], beta[i], initial_state[i],
                                        use_qk_l2norm=use_qk_l2norm_in_kernel) for i in range(b)]
        return torch.stack([o for o, _ in pairs]), torch.stack([s for _, s in pairs])
    return kernel


def fake_gdn_chunk(calls):
    """fla's chunk_gated_delta_rule: g / beta positional [B, T, HV]; q, k [B, T, H, K] un-expanded
    (the naive twin groups value head hv onto q/k head hv // (HV // H), as fla's GVA does)."""
    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **extra):
        b, t, h, dk = q.shape
        hv = v.shape[2]
        assert k.shape == q.shape and hv % h == 0 and g.shape == beta.shape == (b, t, hv)
        assert not extra and output_final_state and scale == dk ** -0.5 and g.dtype not in kernels.HALF
        calls.append(dict(shape=tuple(q.shape), hv=hv, h0=initial_state is not None))
        pairs = [naive_gated_delta_rule(q[i], k[i], v[i], g[i], beta[i],
                                        None if initial_state is None else initial_state[i],
                                        use_qk_l2norm=use_qk_l2norm_in_kernel) for i in range(b)]
        return torch.stack([o for o, _ in pairs]), torch.stack([s for _, s in pairs])
    return kernel


def fake_mamba(calls):
    """mamba-ssm's mamba_chunk_scan_combined with return_final_states=True."""
    def kernel(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
               return_varlen_states=False):
        b, t, h, p = x.shape
        assert b == 1 and dt.shape == (1, t, h) and A.shape == (h,) and B.shape == C.shape and B.shape[:2] == (1, t)
        assert D is None and z is None and dt_bias is None and not dt_softplus and return_final_states
        assert initial_states is None or initial_states.shape == (1, h, p, B.shape[-1])
        calls.append(dict(shape=tuple(x.shape), chunk=chunk_size))
        y, state = naive_ssd_scan(x[0], dt[0], A, B[0], C[0], None if initial_states is None else initial_states[0])
        return y[None].to(x.dtype), state[None]
    return kernel


def fake_simple_gla(calls):
    """fla's chunk_simple_gla: S_t = e^(g_t) S + k_t v_t^T ([K, V] per head), o_t = scale q_t S_t."""
    def kernel(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **extra):
        b, t, h, dk = q.shape
        assert b == 1 and k.shape == q.shape and g.shape == (1, t, h) and g_gamma is None and not extra
        state = q.new_zeros(h, dk, v.shape[-1]) if initial_state is None else initial_state[0]
        calls.append(dict(shape=tuple(q.shape), scale=scale))
        outs = []
        for i in range(t):
            state = g[0, i].exp()[:, None, None] * state + k[0, i][:, :, None] * v[0, i][:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", q[0, i], state))
        return torch.stack(outs)[None], state[None]
    return kernel


@pytest.fixture
def inject(monkeypatch):
    """inject(module, attr, fake): `module` importable with `attr`; kernels.load re-resolved."""
    kernels.load.cache_clear()

    def put(module, attr, fake):
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{attr: fake}))
        kernels.load.cache_clear()
    yield put
    kernels.load.cache_clear()


@pytest.fixture
def open_device(monkeypatch):
    """Pretend every tensor is a CUDA half tensor (float64 here, for exact comparisons)."""
    monkeypatch.setattr(kernels, "kernel_tensors", lambda *ts: True)


def _grads(outs, leaves, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    return torch.autograd.grad(outs, leaves, ups)


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def _kda_inputs(t=11, h=2, dk=8, dv=6, b=None):
    gen = torch.Generator().manual_seed(0)
    lead = (t,) if b is None else (b,)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = mk(*lead, h, dk), mk(*lead, h, dk), mk(*lead, h, dv)
    g = -torch.rand(*lead, h, dk, generator=gen, dtype=F64) * 0.8
    beta = torch.rand(*lead, h, generator=gen, dtype=F64)
    h0 = mk(*((b,) if b else ()), h, dk, dv) * 0.5
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def _ssd_inputs(t=13, h=4, p=3, g=2, n=5):
    gen = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x, b, c = mk(t, h, p), mk(t, g, n), mk(t, g, n)
    dt = torch.rand(t, h, generator=gen, dtype=F64) * 0.5 + 0.05
    a = -torch.rand(h, generator=gen, dtype=F64) - 0.2
    h0 = mk(h, p, n) * 0.5
    return [y.requires_grad_() for y in (x, dt, a, b, c, h0)]


# ----------------------------------------------------------------------------
# dispatch


def test_no_kernel_without_its_package():
    kernels.load.cache_clear()
    missing = [name for name, (module, _) in kernels.KERNELS.items()
               if importlib.util.find_spec(module.split(".")[0]) is None]
    assert "mamba_chunk_scan_combined" in missing  # mamba-ssm is never installed here (docs/gpu.md)
    assert all(kernels.load(name) is None for name in missing)


def test_forced_opens_the_dispatch_to_cpu_float32_only_inside_it(monkeypatch):
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    f32, f64 = torch.zeros(2), torch.zeros(2, dtype=F64)
    assert not kernels.kernel_tensors(f32)
    with kernels.forced():
        assert kernels.kernel_tensors(f32, f32.bfloat16()) and not kernels.kernel_tensors(f32, f64)
        with kernels.forced():
            pass
        assert kernels.forcing()
    assert not kernels.forcing() and not kernels.kernel_tensors(f32)
    monkeypatch.setenv(kernels.FORCE_ENV, "1")
    assert kernels.kernel_tensors(f32)


def test_cpu_and_float32_take_the_torch_path_even_with_a_kernel_installed(inject):
    calls = []
    inject("fla.ops.kda", "chunk_kda", fake_kda(calls))
    assert kernels.load("chunk_kda") is not None
    x = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    assert kernels.pick("chunk_kda", x) is None  # CPU
    q, k, v, g, beta, h0 = (t.detach().float() for t in _kda_inputs())
    chunk_kda(q, k, v, g, beta, h0)
    assert calls == []


def test_kda_chunk_calls_fla_layout_and_converts_back(inject, open_device):
    calls = []
    inject("fla.ops.kda", "chunk_kda", fake_kda(calls))
    leaves = _kda_inputs()
    got = chunk_kda(*leaves)
    assert calls == [dict(shape=(1, 11, 2, 8), l2=True, h0=True)]
    want = chunk_kda(*leaves, allow_kernel=False)
    _assert_same(got, want)
    _assert_same(_grads(got, leaves), _grads(want, leaves))
    chunk_kda(*leaves[:5], None, use_qk_l2norm=False)
    assert calls[-1] == dict(shape=(1, 11, 2, 8), l2=False, h0=False)


def test_kda_decode_uses_the_recurrent_kernel_only_without_gradients(inject, open_device):
    calls = []
    inject("fla.ops.kda", "fused_recurrent_kda", fake_kda(calls))
    leaves = [x.detach() for x in _kda_inputs(b=3)]
    with torch.no_grad():
        got = kda_step(*leaves)
    assert calls == [dict(shape=(3, 1, 2, 8), l2=True, h0=True)]
    _assert_same(got, kda_step(*leaves, allow_kernel=False))
    kda_step(*(x.requires_grad_() for x in leaves))  # a gradient wanted: fla's recurrent kernel has no backward
    assert len(calls) == 1


def test_gdn_decode_passes_key_heads_unexpanded_and_beta_by_name(inject, open_device):
    calls = []
    inject("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", fake_gdn_recurrent(calls))
    gen = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v, state = mk(3, 2, 8), mk(3, 2, 8), mk(3, 4, 6), mk(3, 4, 8, 6) * 0.5  # 2 key heads, 4 value heads
    g, beta = -torch.rand(3, 4, generator=gen, dtype=F64), torch.rand(3, 4, generator=gen, dtype=F64)
    with torch.no_grad():
        got = gated_delta_step(q, k, v, g, beta, state)
    assert calls == [dict(shape=(3, 1, 2, 8))]  # fla groups the 4 value heads over the 2 key heads itself
    _assert_same(got, gated_delta_step(q, k, v, g, beta, state, allow_kernel=False))


def test_gdn_chunk_passes_key_heads_unexpanded_and_converts_back(inject, open_device):
    calls = []
    inject("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", fake_gdn_chunk(calls))
    gen = torch.Generator().manual_seed(4)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v, h0 = mk(9, 2, 8), mk(9, 2, 8), mk(9, 4, 6), mk(4, 8, 6) * 0.5  # 2 key heads, 4 value heads
    g, beta = -torch.rand(9, 4, generator=gen, dtype=F64), torch.rand(9, 4, generator=gen, dtype=F64)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    got = chunk_gated_delta_rule(*leaves)
    assert calls == [dict(shape=(1, 9, 2, 8), hv=4, h0=True)]
    want = chunk_gated_delta_rule(*leaves, allow_kernel=False)
    _assert_same(got, want)
    _assert_same(_grads(got, leaves), _grads(want, leaves))
    assert chunk_gated_delta_rule(*(x[:0] for x in leaves[:5]), h0)[0].shape == (0, 4, 6)  # T = 0: torch path
    assert len(calls) == 1


def test_ssd_through_mamba_ssm_layout_and_gradients(inject, open_device):
    calls = []
    inject("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", fake_mamba(calls))
    leaves = _ssd_inputs()
    got = chunk_ssd_scan(*leaves, chunk_size=8)
    assert calls == [dict(shape=(1, 13, 4, 3), chunk=8)]
    want = chunk_ssd_scan(*leaves, chunk_size=8, allow_kernel=False)
    _assert_same(got, want)
    _assert_same(_grads(got, leaves), _grads(want, leaves))


def test_ssd_through_fla_simple_gla_when_mamba_ssm_is_missing(inject, open_device):
    calls = []
    inject("fla.ops.simple_gla", "chunk_simple_gla", fake_simple_gla(calls))
    leaves = _ssd_inputs()
    got = chunk_ssd_scan(*leaves)
    assert calls == [dict(shape=(1, 13, 4, 5), scale=1.0)]  # q = C expanded to 4 heads, K = d_state
    want = chunk_ssd_scan(*leaves, allow_kernel=False)
    _assert_same(got, want)
    _assert_same(_grads(got, leaves), _grads(want, leaves))


# ----------------------------------------------------------------------------
# the real kernels, where they exist (not here)


def _real(name):
    kernels.load.cache_clear()
    return torch.cuda.is_available() and kernels.load(name) is not None


@pytest.mark.skipif(not _real("chunk_kda"), reason="needs CUDA and flash-linear-attention")
def test_real_fla_chunk_kda_matches_torch_path():
    leaves = [x.detach().to("cuda", torch.bfloat16) for x in _kda_inputs(t=130, h=2, dk=64, dv=64)]
    leaves[5] = leaves[5].float()
    got, want = chunk_kda(*leaves), chunk_kda(*leaves, allow_kernel=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not (_real("mamba_chunk_scan_combined") or _real("chunk_simple_gla")),
                    reason="needs CUDA and mamba-ssm or flash-linear-attention")
def test_real_ssd_kernel_matches_torch_path():
    x, dt, a, b, c, h0 = (y.detach().cuda() for y in _ssd_inputs(t=130, h=4, p=64, g=1, n=64))
    x, b, c = x.bfloat16(), b.bfloat16(), c.bfloat16()
    got = chunk_ssd_scan(x, dt.float(), a.float(), b, c, h0.float())
    want = chunk_ssd_scan(x, dt.float(), a.float(), b, c, h0.float(), allow_kernel=False)
    for u, w in zip(got, want):
        torch.testing.assert_close(u, w, rtol=3e-2, atol=3e-2)
