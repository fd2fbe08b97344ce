"""The torch chunk kernels as registered ops (`ops/registered.py`): the op equals the plain
torch function (values and every gradient, float64), its fakes give the real outputs'
shapes, dtypes and strides, and a fake call is one op, not one per 64-token block."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.ops import gated_delta, kda, ssd

T, C = 150, 32  # T not a multiple of the chunk


def _gdn(dtype, gen):
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = mk(T, 2, 8), mk(T, 2, 8), mk(T, 4, 6)
    g = (-torch.rand(T, 4, generator=gen, dtype=torch.float64) * 0.6).to(dtype)
    beta = torch.rand(T, 4, generator=gen, dtype=torch.float64).to(dtype)
    return [q, k, v, g, beta, mk(4, 8, 6) * 0.5], True


def _kda(dtype, gen):
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = mk(T, 3, 8), mk(T, 3, 8), mk(T, 3, 6)
    g = (-torch.rand(T, 3, 8, generator=gen, dtype=torch.float64) * 0.6).to(dtype)
    beta = torch.rand(T, 3, generator=gen, dtype=torch.float64).to(dtype)
    return [q, k, v, g, beta, mk(3, 8, 6) * 0.5], True


def _ssd(dtype, gen):
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    dt = (torch.rand(T, 4, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    a = -torch.rand(4, generator=gen, dtype=torch.float64).to(dtype) - 0.1
    return [mk(T, 4, 6), dt, a, mk(T, 2, 5), mk(T, 2, 5), mk(4, 6, 5) * 0.5], False


OPS = {"gdn": (gated_delta, _gdn), "kda": (kda, _kda), "ssd": (ssd, _ssd)}


def _op(module):
    return {gated_delta: gated_delta.GDN_CHUNK_OP, kda: kda.KDA_CHUNK_OP, ssd: ssd.SSD_CHUNK_OP}[module]


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("grad_of", ["all", "some"])
def test_the_op_equals_the_torch_function_values_and_grads(name, grad_of):
    module, make = OPS[name]
    xs, flag = make(torch.float64, torch.Generator().manual_seed(0))
    needs = [True] * 6 if grad_of == "all" else [True, False, True, False, True, False]
    leaves = [x.requires_grad_(n) for x, n in zip(xs, needs)]
    out, state = _op(module)(leaves, C, flag)
    ref, ref_state = module._torch_chunk(*leaves, chunk_size=C, flag=flag)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    gen = torch.Generator().manual_seed(1)
    dout, dstate = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (ref, ref_state))
    wrt = [x for x in leaves if x.requires_grad]
    got = torch.autograd.grad((out, state), wrt, (dout, dstate))
    want = torch.autograd.grad((ref, ref_state), wrt, (dout, dstate))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_gradient_into_the_output_only_is_the_torch_functions():
    xs, flag = _gdn(torch.float64, torch.Generator().manual_seed(2))
    leaves = [x.requires_grad_() for x in xs]
    out, _ = gated_delta.GDN_CHUNK_OP(leaves, C, flag)
    ref, _ = gated_delta._torch_chunk(*leaves, chunk_size=C, flag=flag)
    for a, b in zip(torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(ref.sum(), leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _meta(t: torch.Tensor):
    return t.shape, t.dtype, t.stride(), t.device


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_outputs_have_the_real_shapes_dtypes_and_strides(name, dtype):
    module, make = OPS[name]
    xs, flag = make(dtype, torch.Generator().manual_seed(0))
    if name == "ssd":  # the state dtype sets SSD's accumulation: keep it float32, as the model's snapshots
        xs[5] = xs[5].float()
    op, backward = _op(module), getattr(torch.ops.longstraw, f"{name}_chunk_backward")
    needs = [True, False, True, True, False, True]
    real = op(xs, C, flag)
    grads = backward(xs, *(torch.randn_like(r) for r in real), needs, C, flag)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fxs = [mode.from_tensor(x) for x in xs]
        fake = op(fxs, C, flag)
        fgrads = backward(fxs, *(torch.empty_like(f) for f in fake), needs, C, flag)
    assert [_meta(f) for f in fake] == [_meta(r) for r in real]
    assert [_meta(f) for f in fgrads] == [_meta(g) for g in grads]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_fake_chunk_is_one_op_not_one_per_block():
    xs, flag = _gdn(torch.float32, torch.Generator().manual_seed(0))
    t = 4096  # 64 blocks of the default chunk
    with FakeTensorMode() as mode:
        q, k, v = (torch.empty(t, *x.shape[1:]) for x in xs[:3])
        g, beta = torch.empty(t, 4), torch.empty(t, 4)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)] + [mode.from_tensor(xs[5]).requires_grad_()]
        with _Ops() as seen:
            out, state = gated_delta.chunk_gated_delta_rule(*leaves, use_qk_l2norm=flag)
            (out.sum() + state.sum()).backward()
    assert seen.names.count("longstraw.gdn_chunk.default") == 1
    assert seen.names.count("longstraw.gdn_chunk_backward.default") == 1
    ops = [n for n in seen.names if not n.startswith("prim.")]  # prim.device: metadata queries
    assert len(ops) < 20, ops
