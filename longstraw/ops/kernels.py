"""CUDA kernels of flash-linear-attention (fla) and mamba-ssm for the recurrent mixers,
behind availability checks, with the torch kernels of `kda.py` / `ssd.py` as the fallback.

Tested two ways without a GPU. `tests/ops/test_kernels.py` checks the dispatch (the
torch path on CPU, in float32, or when a package is missing) and each adapter's layout
against fakes that are the naive twins, in float64. `tests/ops/test_kernels_interpret.py`
(`pytest -m interpret`, needs the `kernels` extra) runs fla's real Triton kernels, and
mamba-ssm's Triton SSD when mamba-ssm is installed (without its CUDA extensions:
docs/gpu.md), under Triton's interpreter on CPU in float32, through these adapters,
with the dispatch opened by `forced()` (below). Not run anywhere yet: bf16 / fp16 (the
interpreter has no bf16) and the compiled kernels themselves.

The kernels used, and what each takes (their real signatures, fla-core 0.6.0 and
mamba-ssm 2.3.2.post1, read from the packages' sources):

    fla.ops.kda.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel)      [B, T, H, D] layout, g the per-channel log decay
        [B, T, H, Dk], initial_state [B, H, Dk, Dv] float32; autograd gives dh0
    fla.ops.kda.fused_recurrent_kda(...)           same arguments; forward only (decode)
    fla.ops.gated_delta_rule.chunk_gated_delta_rule / fused_recurrent_gated_delta_rule
        the same with g [B, T, HV] per value head (GDN); q, k [B, T, H, Dk] with H
        dividing HV: value head hv reads q/k head hv // (HV // H) (fla's GVA, HF's
        `repeat_interleave` order), so q / k go in un-expanded (`gdn_chunk`, `gdn_decode`)
    mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C,
        chunk_size, initial_states=, return_final_states=True)      x [B, T, H, P],
        dt [B, T, H] (softplus already applied: dt_softplus=False), B / C [B, T, G, N],
        initial_states [B, H, P, N]; autograd gives dinitial_states
    fla.ops.simple_gla.chunk_simple_gla(q, k, v, g, scale, initial_state,
        output_final_state)           SSD is a scalar-gated linear attention: q = C,
        k = B, v = dt x, g = dt A per head, scale 1; its state is [B, H, N, P] (S^T)

LongStraw dispatches to them on CUDA in bf16 / fp16 only. That is LongStraw's choice,
not the kernels' limit: fla-core 0.6.0 takes float32 too (no dtype check in its chunk
kernels; the interpreter tests run them in float32), but in float32 the torch path is
the reference, and `tl.dot` would round float32 to TF32 on a GPU. The state
handed in and out is float32, as the torch kernels keep it.

`forced()` (or LONGSTRAW_FORCE_KERNELS=1 in the environment) opens the dispatch to
float32 and half tensors on any device, CPU included: for the interpreter tests only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from longstraw.tensors import accumulation_dtype

# name -> (module, attribute): where each kernel lives
KERNELS = {
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "fused_recurrent_kda": ("fla.ops.kda", "fused_recurrent_kda"),
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "mamba_chunk_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "chunk_simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
}
HALF = (torch.bfloat16, torch.float16)
FORCE_ENV = "LONGSTRAW_FORCE_KERNELS"  # "1": as inside `forced()`, for the whole process
_forced = 0  # depth of `forced()` blocks


@functools.lru_cache(maxsize=None)
def load(name: str):
    """The kernel `name` (a key of KERNELS), or None when its package cannot be imported."""
    module, attr = KERNELS[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:  # not installed, or its triton stack is unusable here
        return None


def forcing() -> bool:
    """True inside `forced()` or with LONGSTRAW_FORCE_KERNELS=1."""
    return _forced > 0 or os.environ.get(FORCE_ENV) == "1"


@contextlib.contextmanager
def forced():
    """Tests only: inside this block the kernels are picked for float32 / half tensors
    on any device (CPU too, where Triton's interpreter runs them), when their package
    imports. Outside it nothing changes."""
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1


def suits(device_type: str, dtype: torch.dtype) -> bool:
    """True when a tensor on `device_type` in `dtype` is one LongStraw sends to the
    kernels: on CUDA in half precision. With `forcing()`: float32 or half on any device.
    The planner's kernel choice asks the same (`budget.gdn_kernel`)."""
    if forcing():
        return dtype in HALF or dtype == torch.float32
    return device_type == "cuda" and dtype in HALF


def kernel_tensors(*tensors: torch.Tensor) -> bool:
    """True when every tensor `suits` the kernels (on CUDA in half precision, or forced)."""
    return all(suits(t.device.type, t.dtype) for t in tensors)


def pick(name: str, *tensors: torch.Tensor):
    """The kernel `name` if the inputs suit it and its package imports, else None (torch path)."""
    return load(name) if kernel_tensors(*tensors) else None


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------
# KDA


def kda_chunk(kernel, q, k, v, g, beta, initial_state, use_qk_l2norm: bool):
    """`kda.chunk_kda` through fla's `chunk_kda`: [T, H, D] -> its [1, T, H, D] and back.

    Returns (out [T, H, Dv] in v's dtype, final_state [H, Dk, Dv] in the accumulation dtype)."""
    acc = accumulation_dtype(v.dtype)
    h0 = None if initial_state is None else initial_state.to(acc)[None]  # (1, H, Dk, Dv)
    out, state = kernel(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                        g=g.to(acc)[None].contiguous(), beta=beta[None].contiguous(), scale=q.shape[-1] ** -0.5,
                        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out[0].to(v.dtype), state[0].to(acc)


def kda_decode(kernel, q, k, v, g, beta, state, use_qk_l2norm: bool):
    """`kda.kda_step` through fla's `fused_recurrent_kda` (forward only): the B branches
    as its batch of B sequences of one token. q, k, g [B, H, Dk] (g [B, H] for GDN), v
    [B, H, Dv], beta [B, H] -> (out [B, H, Dv] in v's dtype, state [B, H, Dk, Dv] in the
    accumulation dtype). g and beta go by keyword: GDN's kernel has gk, gv between them."""
    acc = accumulation_dtype(v.dtype)
    out, new = kernel(q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
                      g=g.to(acc)[:, None].contiguous(), beta=beta[:, None].contiguous(), scale=q.shape[-1] ** -0.5,
                      initial_state=state.to(acc).contiguous(), output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out[:, 0].to(v.dtype), new.to(acc)


# ----------------------------------------------------------------------------
# GDN (Gated DeltaNet)


def gdn_chunk(kernel, q, k, v, g, beta, initial_state, use_qk_l2norm: bool):
    """`gated_delta.chunk_gated_delta_rule` through fla's `chunk_gated_delta_rule`:
    q, k [T, Hk, Dk], v [T, Hv, Dv], g / beta [T, Hv] -> [1, T, H, D] and back. q / k
    go in un-expanded: fla's GVA gives value head hv the q/k head hv // (Hv // Hk), as
    HF's `repeat_interleave` does (measured under the interpreter, grouped heads).

    Returns (out [T, Hv, Dv] in v's dtype, final_state [Hv, Dk, Dv] in the accumulation dtype)."""
    acc = accumulation_dtype(v.dtype)
    h0 = None if initial_state is None else initial_state.to(acc)[None]  # (1, Hv, Dk, Dv)
    out, state = kernel(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                        g.to(acc)[None].contiguous(), beta[None].contiguous(), scale=q.shape[-1] ** -0.5,
                        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out[0].to(v.dtype), state[0].to(acc)


def gdn_decode(kernel, q, k, v, g, beta, state, use_qk_l2norm: bool):
    """`gated_delta.gated_delta_step` through fla's `fused_recurrent_gated_delta_rule`
    (decode, no gradient): q, k [B, Hk, Dk] un-expanded (fla groups the Hv value heads
    as HF does, like `gdn_chunk`). Returns (out [B, Hv, Dv] in v's dtype, state
    [B, Hv, Dk, Dv] in the accumulation dtype)."""
    return kda_decode(kernel, q, k, v, g, beta, state, use_qk_l2norm)


# ----------------------------------------------------------------------------
# SSD (Mamba2)


def ssd_mamba(kernel, x, dt, a, b, c, initial_state, chunk_size: int):
    """`ssd.chunk_ssd_scan` through mamba-ssm's `mamba_chunk_scan_combined` (no D, no z,
    dt already through softplus and its limits). Returns (y [T, H, P], state [H, P, N])
    in the accumulation dtype."""
    acc = accumulation_dtype(x.dtype)
    h0 = None if initial_state is None else initial_state.to(acc)[None]  # (1, H, P, N)
    y, state = kernel(x[None].contiguous(), dt[None].contiguous(), a.contiguous(), b[None].contiguous(),
                      c[None].contiguous(), chunk_size, initial_states=h0, dt_softplus=False,
                      return_final_states=True)
    return y[0].to(acc), state[0].to(acc)


def heads_of_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N]: group g serves the H // G consecutive heads g*H//G.. (SSD's
    B and C per group, shared by its heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def ssd_simple_gla(kernel, x, dt, a, b, c, initial_state):
    """`ssd.chunk_ssd_scan` through fla's `chunk_simple_gla`: S_t = e^(dt A) S + (dt x) B^T,
    y = S C is GLA with q = C, k = B, v = dt x, g = dt A and scale 1, in the transposed
    state layout [H, N, P]. Returns (y [T, H, P], state [H, P, N]) in the accumulation dtype."""
    acc = accumulation_dtype(x.dtype)
    h = x.shape[1]
    q, k = heads_of_groups(c, h), heads_of_groups(b, h)  # (T, H, N)
    v = x * dt[..., None].to(x.dtype)  # (T, H, P)
    g = dt.to(acc) * a.to(acc)  # (T, H) log decay
    h0 = None if initial_state is None else initial_state.to(acc).transpose(-1, -2)[None].contiguous()
    y, state = kernel(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g=g[None].contiguous(),
                      scale=1.0, initial_state=h0, output_final_state=True)
    return y[0].to(acc), state[0].transpose(-1, -2).to(acc)


def ssd_chunk(x, dt, a, b, c, initial_state, chunk_size: int):
    """The SSD scan on a CUDA kernel when one suits (mamba-ssm first, then fla), or None."""
    if (kernel := pick("mamba_chunk_scan_combined", x, b, c)) is not None:
        return ssd_mamba(kernel, x, dt, a, b, c, initial_state, chunk_size)
    if (kernel := pick("chunk_simple_gla", x, b, c)) is not None:
        return ssd_simple_gla(kernel, x, dt, a, b, c, initial_state)
    return None
