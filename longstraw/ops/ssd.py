"""Mamba2's state-space duality (SSD) scan for one sequence, from an initial state.

Each head h keeps a state S [P, N] (head_dim x d_state). Per token t, with step
dt_t > 0 (after softplus and the time-step limits), the head's scalar A < 0, and the
token's B_t, C_t [N] (shared by the heads of a group):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        decay, then write x_t along B_t
    y_t = S_t C_t                                     read along C_t

The decay is a scalar per head and token, so inside a chunk of C tokens, with
gamma_i = dt_1 A + ... + dt_i A the log decay since the chunk start and S0 the state
entering it, everything is a masked matrix product (HF's `torch_forward`, Mamba2's
"minimal SSD"):

    y_i = e^gamma_i S0 C_i + sum_(j <= i) e^(gamma_i - gamma_j) (C_i . B_j) dt_j x_j
    S_C = e^gamma_C S0 + sum_j e^(gamma_C - gamma_j) dt_j x_j B_j^T

The intra-chunk parts are computed for all chunks at once; only the hand-over of S0
from chunk to chunk is sequential. Every op is out of place, so autograd
differentiates w.r.t. every input, the initial state included. The D skip (y + D x),
the gate and the gated norm are the layer's, not the scan's.

`ssd_transition` writes a segment as an affine map of its unknown start state (a
diagonal decay per head) for context parallelism, as `gated_delta_scan` does for GDN.

Legend: T tokens, H heads, P head dim, G groups (dividing H; head h reads group
h // (H // G), HF's `repeat_interleave`), N d_state, K chunks of C tokens (T padded
to K*C with tokens that neither decay nor write). Arithmetic is float32, or float64
when the inputs are float64.
"""

from __future__ import annotations

import torch

from longstraw.tensors import accumulation_dtype_of

from . import kernels
from .kernels import heads_of_groups
from .gated_delta import to_chunks
from .registered import register_chunk_op


def _check(x, dt, a, b, c, state, batch: bool):
    lead = x.shape[:1]
    if x.dim() != 3:
        raise ValueError(f"x must be [{'B' if batch else 'T'}, H, P], got {tuple(x.shape)}")
    h, p = x.shape[1:]
    if dt.shape != (*lead, h) or a.shape != (h,):
        raise ValueError(f"dt must be {(*lead, h)} and A {(h,)}, got {tuple(dt.shape)} and {tuple(a.shape)}")
    if b.dim() != 3 or b.shape != c.shape or b.shape[0] != lead[0] or h % b.shape[1]:
        raise ValueError(f"B and C must be [{lead[0]}, G, N] with G dividing H={h}, got {tuple(b.shape)}, "
                         f"{tuple(c.shape)}")
    want = (*(lead if batch else ()), h, p, b.shape[2])
    if state is not None and state.shape != want:
        raise ValueError(f"the state must be [{'B, ' if batch else ''}H, P, N] = {want}, got {tuple(state.shape)}")


def chunk_ssd_scan(x, dt, a, b, c, initial_state=None, *, chunk_size: int = 64, allow_kernel: bool = True):
    """The SSD recurrence over the T tokens of one sequence, from `initial_state`.

    Args:
        x: [T, H, P] the post-conv inputs, per head.
        dt: [T, H] time steps (softplus and limits applied).
        a: [H] the heads' A (negative: -exp(A_log)).
        b, c: [T, G, N] input and output projections of the state, per group.
        initial_state: [H, P, N] the state before the first token, or None for zeros.
        chunk_size: tokens per chunk (any T works; it is padded).
        allow_kernel: on CUDA in bf16 / fp16, use mamba-ssm's `mamba_chunk_scan_combined`,
            else fla's `chunk_simple_gla`, when importable (`kernels.py`); False forces
            the torch path.

    Returns:
        (y [T, H, P], final_state [H, P, N]), both in the accumulation dtype (float32,
        float64 for float64 inputs): HF's torch path also returns float32 outputs. No D
        skip. Differentiable w.r.t. x, dt, a, b, c and initial_state.
    """
    _check(x, dt, a, b, c, initial_state, batch=False)
    t, h, p = x.shape
    acc = accumulation_dtype_of(x, dt, b, initial_state)
    n_state = b.shape[2]
    state = x.new_zeros(h, p, n_state, dtype=acc) if initial_state is None else initial_state.to(acc)
    if t == 0:
        return x.new_zeros(0, h, p, dtype=acc), state
    if allow_kernel and (out := kernels.ssd_chunk(x, dt, a, b, c, initial_state, chunk_size)) is not None:
        return out
    return SSD_CHUNK_OP([x, dt, a, b, c, state], chunk_size, False)


def _torch_chunk(x, dt, a, b, c, initial_state, *, chunk_size: int, flag: bool):
    """The torch path of `chunk_ssd_scan` (T >= 1, a given initial state; `flag` unused):
    the implementation of the registered op `longstraw::ssd_chunk`."""
    t, h, p = x.shape
    acc = accumulation_dtype_of(x, dt, b, initial_state)
    state = initial_state.to(acc)
    dt = dt.to(acc)
    xs = x.to(acc) * dt[..., None]  # (T, H, P) dt_j x_j
    log_decay = dt * a.to(acc)  # (T, H)
    b, c = heads_of_groups(b.to(acc), h), heads_of_groups(c.to(acc), h)  # (T, H, N)

    k = -(-t // chunk_size)
    xc, bc, cc = (to_chunks(y, k, chunk_size) for y in (xs, b, c))  # (H, K, C, P|N)
    gamma = to_chunks(log_decay, k, chunk_size).cumsum(dim=-1)  # (H, K, C)
    visible = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    pair_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~visible, float("-inf")).exp()  # (H, K, C, C)
    y_intra = ((cc @ bc.transpose(-1, -2)) * pair_decay) @ xc  # (H, K, C, P)
    c_read = cc * gamma.exp()[..., None]  # (H, K, C, N) reads of the incoming state
    b_write = bc * (gamma[..., -1:] - gamma).exp()[..., None]  # (H, K, C, N) writes, decayed to chunk end
    written = xc.transpose(-1, -2) @ b_write  # (H, K, P, N) the chunk's own contribution to its end state
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (H, K, 1, 1)

    outs = []
    for i in range(k):
        outs.append(y_intra[:, i] + c_read[:, i] @ state.transpose(-1, -2))  # (H, C, P)
        state = state * chunk_decay[:, i] + written[:, i]  # (H, P, N)
    y = torch.cat(outs, dim=1)[:, :t].movedim(1, 0)  # (T, H, P)
    return y, state


def _fake_chunk(x, dt, a, b, c, initial_state, *, chunk_size: int, flag: bool):
    """`longstraw::ssd_chunk`'s fake: y [T, H, P] and state [H, P, N], both in acc."""
    t, h, p = x.shape
    acc = accumulation_dtype_of(x, dt, b, initial_state)
    return x.new_empty(t, h, p, dtype=acc), x.new_empty(h, p, b.shape[2], dtype=acc)


SSD_CHUNK_OP = register_chunk_op("ssd_chunk", _torch_chunk, _fake_chunk)


def ssd_step(x, dt, a, b, c, state):
    """One token of the SSD recurrence for B independent sequences (batched decode).

    Args:
        x: [B, H, P]; dt: [B, H]; a: [H]; b, c: [B, G, N].
        state: [B, H, P, N] the state before this token.

    Returns:
        (y [B, H, P], new state [B, H, P, N]), in the accumulation dtype, no D skip.
        Out of place: `state` is not modified.
    """
    _check(x, dt, a, b, c, state, batch=True)
    h = x.shape[1]
    acc = accumulation_dtype_of(x, dt, b, state)
    dt = dt.to(acc)
    b, c = heads_of_groups(b.to(acc), h), heads_of_groups(c.to(acc), h)  # (B, H, N)
    decay = (dt * a.to(acc)).exp()[..., None, None]  # (B, H, 1, 1)
    state = state.to(acc) * decay + (x.to(acc) * dt[..., None])[..., :, None] * b[..., None, :]
    return torch.einsum("bhpn,bhn->bhp", state, c), state


# ----------------------------------------------------------------------------
# a segment as an affine map of its start state (context parallelism)


def ssd_transition(x, dt, a, b, c, *, chunk_size: int = 64):
    """The segment's outputs and end state as functions of its unknown start state S:

        y_t = out0_t + read_t S^T (per head: S [P, N], read_t [N]),   S_end = decay S + end0

    Args: as `chunk_ssd_scan`, without a start state.

    Returns:
        (read [T, H, N], out0 [T, H, P], decay [H], end0 [H, P, N]) in the accumulation
        dtype: read_t = e^(dt_1 A + ... + dt_t A) C_t and decay the whole segment's
        e^(sum dt A); out0 and end0 are the scan from a zero start.
    """
    out0, end0 = chunk_ssd_scan(x, dt, a, b, c, None, chunk_size=chunk_size, allow_kernel=False)
    acc = out0.dtype
    gamma = (dt.to(acc) * a.to(acc)).cumsum(dim=0)  # (T, H) log decay since the segment start
    read = heads_of_groups(c.to(acc), x.shape[1]) * gamma.exp()[..., None]  # (T, H, N)
    decay = gamma[-1].exp() if x.shape[0] else a.new_ones(a.shape, dtype=acc)
    return read, out0, decay, end0


def finish_ssd_outputs(read: torch.Tensor, out0: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The segment's outputs [T, H, P] from its start state [H, P, N] (None: zeros)."""
    return out0 if state is None else out0 + torch.einsum("thn,hpn->thp", read, state.to(read.dtype))


def diagonal_transition(decay: torch.Tensor, end0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [H, P, P], C [H, P, N]) with A S + C = decay S + end0: the diagonal decay as the
    matrix `gated_delta_scan.chain_states` applies (P x P per head, small next to a segment)."""
    p = end0.shape[1]
    eye = torch.eye(p, dtype=end0.dtype, device=end0.device)
    return decay[:, None, None] * eye, end0
