"""The torch chunk kernels of the recurrent mixers as registered ops (`torch.library.custom_op`).

A chunked recurrence (GDN's gated delta rule, KDA, Mamba-2's SSD) written in torch is a
Python loop over blocks of 64 tokens: thousands of small ops per layer at a long prompt.
Registered as one op with a fake implementation, it is one call per layer per chunk for
anything that looks at ops rather than data: fake tensors (`ls.rehearse`), the live-byte
tracker, `torch.compile`. The real implementation is the torch function itself, so the
numbers do not change (tests/ops/test_registered.py: values and every gradient in
float64 against the plain function).

Each kernel `fn(*tensors, chunk_size=, flag=) -> (out, state)` becomes two ops:

    longstraw::NAME(Tensor[] xs, int chunk_size, bool flag) -> (out, state)
    longstraw::NAME_backward(Tensor[] xs, Tensor grad_out, Tensor grad_state, bool[] needs,
                             int chunk_size, bool flag) -> Tensor[]   (one per xs; empty where not needed)

The forward's autograd keeps only its inputs; the backward op recomputes the forward
under torch autograd and differentiates it (as flash-linear-attention's kernels do:
they recompute their chunk matrices in the backward). So the forward's graph holds no
[H, N, C, C] chunk matrices, and the backward holds them for one layer at a time. Both
ops' fakes return empty tensors of the real ones' shapes, dtypes and strides (contiguous).

What a fake cannot see: the memory an op holds inside itself (its chunk matrices, the
recompute in its backward). A rehearsal counts the op's outputs, as it counts a CUDA
kernel's; docs/rehearse.md lists this among what a rehearsal cannot see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

FORWARD = "(Tensor[] xs, int chunk_size, bool flag) -> (Tensor, Tensor)"
BACKWARD = ("(Tensor[] xs, Tensor grad_out, Tensor grad_state, bool[] needs, int chunk_size, bool flag) "
            "-> Tensor[]")

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Fake = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _fresh(t: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """t contiguous and sharing storage with none of `inputs` (a custom op may not alias them)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    return t.clone() if any(x.untyped_storage().data_ptr() == ptr for x in inputs) else t


@contextlib.contextmanager
def autograd_inside_an_op():
    """Inside a custom op's implementation the dispatcher excludes the autograd keys (its
    caller's autograd already ran), so no graph is recorded even under `enable_grad`.
    This block takes the autograd keys (and ADInplaceOrView) off the exclusion, keeping
    the rest (autocast stays off, as in the forward), and enables grad."""
    C = torch._C
    autograd = C.DispatchKeySet(C.DispatchKey.AutogradFunctionality)
    for key in (C.DispatchKey.ADInplaceOrView, C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor):
        autograd = autograd | C.DispatchKeySet(key)
    keep = C._dispatch_tls_local_exclude_set() - autograd
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), keep), torch.enable_grad():
        yield


def register_chunk_op(name: str, kernel: Kernel, fake: Fake):
    """Register `kernel(*xs, chunk_size=, flag=) -> (out, state)` as `longstraw::name`.

    Args:
        name: the op's name in the `longstraw` namespace.
        kernel: the torch implementation (out-of-place, differentiable by torch autograd).
        fake: `fake(*xs, chunk_size=, flag=) -> (out, state)`: empty tensors of the
            outputs' shapes and dtypes (contiguous), on the inputs' device.

    Returns:
        The forward op (call it as `op(list_of_tensors, chunk_size, flag)`).
    """

    @torch.library.custom_op(f"longstraw::{name}", mutates_args=(), schema=FORWARD)
    def forward(xs, chunk_size, flag):
        out, state = kernel(*xs, chunk_size=chunk_size, flag=flag)
        return _fresh(out, xs), _fresh(state, xs)

    @forward.register_fake
    def _(xs, chunk_size, flag):
        return fake(*xs, chunk_size=chunk_size, flag=flag)

    @torch.library.custom_op(f"longstraw::{name}_backward", mutates_args=(), schema=BACKWARD)
    def backward_op(xs, grad_out, grad_state, needs, chunk_size, flag):
        with autograd_inside_an_op():
            leaves = [x.detach().requires_grad_(n) for x, n in zip(xs, needs)]
            out, state = kernel(*leaves, chunk_size=chunk_size, flag=flag)
            wanted = [x for x in leaves if x.requires_grad]
            pairs = [(o, g) for o, g in ((out, grad_out), (state, grad_state)) if o.requires_grad]
            assert pairs, f"longstraw::{name}_backward: the recomputed outputs need no grad"
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        result = []
        for x, n in zip(xs, needs):
            grad = next(grads) if n else None
            if n and grad is None:  # an input the outputs do not depend on
                grad = torch.zeros_like(x, memory_format=torch.contiguous_format)
            result.append(_fresh(grad, [*xs, grad_out, grad_state]) if n else x.new_empty(0))
        return result

    @backward_op.register_fake
    def _(xs, grad_out, grad_state, needs, chunk_size, flag):
        return [x.new_empty(x.shape) if n else x.new_empty(0) for x, n in zip(xs, needs)]

    def setup_context(ctx, inputs, output):
        xs, chunk_size, flag = inputs
        ctx.save_for_backward(*xs)
        ctx.needs = [x.requires_grad for x in xs]
        ctx.chunk_size, ctx.flag = chunk_size, flag
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in output]

    def backward(ctx, grad_out, grad_state):
        xs = list(ctx.saved_tensors)
        grad_out, grad_state = (torch.zeros(s, dtype=d, device=dev) if g is None else g
                                for g, (s, d, dev) in zip((grad_out, grad_state), ctx.shapes))
        grads = backward_op(xs, grad_out.contiguous(), grad_state.contiguous(), ctx.needs, ctx.chunk_size, ctx.flag)
        return [g if n else None for g, n in zip(grads, ctx.needs)], None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward
