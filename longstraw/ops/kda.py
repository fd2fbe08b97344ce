"""Kimi Delta Attention (KDA, Kimi Linear's recurrent mixer) for one sequence: the gated
delta rule of `gated_delta.py` with a per-channel decay instead of one per head.

Each head keeps a state S [Dk, Dv]. Per token t, with log decay g_t [Dk] (<= 0, one
per key channel) and write strength beta_t in [0, 1]:

    S'  = diag(e^(g_t)) S_{t-1}            decay each key channel's row on its own
    u_t = beta_t (v_t - S'^T k_t)          delta: the part of v_t the state does not predict
    S_t = S' + k_t u_t^T                   write the correction
    o_t = S_t^T q_t                        read

q and k are L2-normalised first (`x / sqrt(|x|^2 + 1e-6)`, HF / fla) when
`use_qk_l2norm`, and q is scaled by Dk^-1/2. The chunked form is `gated_delta.py`'s
WY form with every decay factor taken per channel: inside a chunk, with
gamma_i = g_1 + ... + g_i [Dk] and D_ij = e^(gamma_i - gamma_j) (j <= i, per channel),

    (I + A) u = beta v - (beta e^gamma * k) S0,     A_ij = beta_i sum_d k_id k_jd D_ijd   (j < i)
    o_i = (e^gamma_i * q_i) S0 + sum_(j <= i) (sum_d q_id k_jd D_ijd) u_j
    S_C = diag(e^gamma_C) S0 + sum_j (e^(gamma_C - gamma_j) * k_j) u_j^T

D is masked before the exp (no overflow above the diagonal), so no factor e^(-gamma)
is ever formed. Out-of-place torch ops throughout: autograd gives every input's
gradient, the initial state's included.

Legend: T tokens, H heads (q, k and v alike), Dk / Dv head dims, K chunks of C tokens
(T padded with tokens that neither decay nor write). Arithmetic is float32, or float64
for float64 inputs.
"""

from __future__ import annotations

import torch

from longstraw.tensors import accumulation_dtype_of

from . import kernels
from .gated_delta import l2_normalize, to_chunks
from .registered import register_chunk_op

KDA_MAX_KERNEL_DK = 256  # fla's chunk_kda takes key head dims up to 256


def _check(q, k, v, g, beta, state, batch: bool):
    lead = "B" if batch else "T"
    if q.dim() != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k and g must all be [{lead}, H, Dk], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(g.shape)}")
    n, h, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (n, h) or beta.shape != (n, h):
        raise ValueError(f"v must be [{lead}, H, Dv] and beta [{lead}, H] with {lead}={n}, H={h}, got "
                         f"{tuple(v.shape)} and {tuple(beta.shape)}")
    want = ((n,) if batch else ()) + (h, dk, v.shape[2])
    if state is not None and state.shape != want:
        raise ValueError(f"the state must be [{'B, ' if batch else ''}H, Dk, Dv] = {want}, got {tuple(state.shape)}")


def _prepare(q, k, acc, use_qk_l2norm):
    q, k = q.to(acc), k.to(acc)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k


def chunk_kda(q, k, v, g, beta, initial_state=None, *, chunk_size: int = 64, use_qk_l2norm: bool = True,
              allow_kernel: bool = True):
    """KDA over the T tokens of one sequence, starting from `initial_state`.

    Args:
        q, k: [T, H, Dk] (after the short convs); v: [T, H, Dv].
        g: [T, H, Dk] per-channel log decay (<= 0); beta: [T, H] write strength.
        initial_state: [H, Dk, Dv] or None for zeros.
        chunk_size: tokens per chunk (any T works; it is padded).
        use_qk_l2norm: L2-normalise q and k per head first (Kimi Linear: True).
        allow_kernel: on CUDA in bf16 / fp16, use fla's `chunk_kda` when importable
            (`kernels.py`; its chunk size is its own); False forces the torch path.

    Returns:
        (out [T, H, Dv] in v's dtype, final_state [H, Dk, Dv] in the accumulation
        dtype). Differentiable w.r.t. q, k, v, g, beta and initial_state.
    """
    _check(q, k, v, g, beta, initial_state, batch=False)
    kernel = kernels.pick("chunk_kda", q, k, v) if allow_kernel and q.shape[-1] <= KDA_MAX_KERNEL_DK else None
    if kernel is not None and q.shape[0]:
        return kernels.kda_chunk(kernel, q, k, v, g, beta, initial_state, use_qk_l2norm)
    t, h, dv = v.shape
    acc = accumulation_dtype_of(q, v)
    state = v.new_zeros(h, q.shape[2], dv, dtype=acc) if initial_state is None else initial_state
    if t == 0:
        return v.new_zeros(0, h, dv), state.to(acc)
    return KDA_CHUNK_OP([q, k, v, g, beta, state], chunk_size, use_qk_l2norm)


def _torch_chunk(q, k, v, g, beta, initial_state, *, chunk_size: int, flag: bool):
    """The torch path of `chunk_kda` (T >= 1, a given initial state; `flag`: use_qk_l2norm):
    the implementation of the registered op `longstraw::kda_chunk`."""
    t, h, dv = v.shape
    acc = accumulation_dtype_of(q, v)
    state = initial_state.to(acc)
    q, k = _prepare(q, k, acc, flag)
    c = chunk_size
    n = -(-t // c)
    qc, kc, vc, gc = (to_chunks(x.to(acc), n, c) for x in (q, k, v, g))  # (H, K, C, D)
    bc = to_chunks(beta.to(acc), n, c)  # (H, K, C)

    gamma = gc.cumsum(dim=-2)  # (H, K, C, Dk) per-channel log decay since the chunk start
    visible = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()[..., None]  # j <= i
    pair_decay = (gamma[..., :, None, :] - gamma[..., None, :, :]).masked_fill(~visible, float("-inf")).exp()
    k_beta = kc * bc[..., None]  # (H, K, C, Dk)
    system = torch.einsum("hnid,hnjd,hnijd->hnij", k_beta, kc, pair_decay)  # (H, K, C, C), strictly lower read
    scores = torch.einsum("hnid,hnjd,hnijd->hnij", qc, kc, pair_decay)  # (H, K, C, C) intra-chunk reads
    w_v = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, k_beta * gamma.exp(), upper=False, unitriangular=True)
    q_read = qc * gamma.exp()  # (H, K, C, Dk)
    k_write = kc * (gamma[..., -1:, :] - gamma).exp()  # (H, K, C, Dk)
    chunk_decay = gamma[..., -1, :].exp()[..., None]  # (H, K, Dk, 1)

    outs = []
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ state  # (H, C, Dv)
        outs.append(q_read[:, i] @ state + scores[:, i] @ u)
        state = state * chunk_decay[:, i] + k_write[:, i].transpose(-1, -2) @ u  # (H, Dk, Dv)
    out = torch.cat(outs, dim=1)[:, :t].movedim(1, 0)  # (T, H, Dv)
    return out.to(v.dtype), state


def _fake_chunk(q, k, v, g, beta, initial_state, *, chunk_size: int, flag: bool):
    """`longstraw::kda_chunk`'s fake: out [T, H, Dv] in v's dtype, state [H, Dk, Dv] in acc."""
    t, h, dv = v.shape
    return v.new_empty(t, h, dv), v.new_empty(h, q.shape[2], dv, dtype=accumulation_dtype_of(q, v))


KDA_CHUNK_OP = register_chunk_op("kda_chunk", _torch_chunk, _fake_chunk)


def kda_step(q, k, v, g, beta, state, *, use_qk_l2norm: bool = True, allow_kernel: bool = True):
    """One token of KDA for B independent sequences (batched decode).

    Args:
        q, k, g: [B, H, Dk]; v: [B, H, Dv]; beta: [B, H]; state: [B, H, Dk, Dv].
        allow_kernel: on CUDA in bf16 / fp16 and with no gradient wanted, use fla's
            `fused_recurrent_kda` when importable (it has no backward).

    Returns:
        (out [B, H, Dv] in v's dtype, new state [B, H, Dk, Dv] in the accumulation
        dtype). Out of place: `state` is not modified.
    """
    _check(q, k, v, g, beta, state, batch=True)
    if allow_kernel and not kernels.needs_grad(q, k, v, g, beta, state):
        if (kernel := kernels.pick("fused_recurrent_kda", q, k, v)) is not None:
            return kernels.kda_decode(kernel, q, k, v, g, beta, state, use_qk_l2norm)
    acc = accumulation_dtype_of(q, v, state)
    q, k = _prepare(q, k, acc, use_qk_l2norm)
    state = state.to(acc) * g.to(acc).exp()[..., None]  # decay each key channel
    delta = (v.to(acc) - torch.einsum("bhk,bhkv->bhv", k, state)) * beta.to(acc)[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state).to(v.dtype), state


def kda_transition(q, k, v, g, beta, *, chunk_size: int = 64, use_qk_l2norm: bool = True):
    """The segment's affine map and outputs as functions of its unknown start state
    (context parallelism; `gated_delta_scan.py`'s idea). KDA decays and mixes the state's
    rows (key channels) only, never its columns, so one `chunk_kda` pass from the
    augmented start [I | 0] ([H, Dk, Dk + Dv]) with values [0 | v] gives the end state
    [A | C] and the outputs [read | out0].

    Args:
        q, k, g: [T, H, Dk]; v: [T, H, Dv]; beta: [T, H] (as `chunk_kda`).

    Returns:
        (read [T, H, Dk], out0 [T, H, Dv], A [H, Dk, Dk], C [H, Dk, Dv]) in the
        accumulation dtype: from a start state S [H, Dk, Dv] the outputs are
        read @ S + out0 per head and the end state is A @ S + C.
    """
    t, h, dv = v.shape
    dk = q.shape[-1]
    acc = accumulation_dtype_of(q, v)
    eye = torch.eye(dk, dtype=acc, device=v.device).expand(h, dk, dk)
    start = torch.cat([eye, torch.zeros(h, dk, dv, dtype=acc, device=v.device)], dim=-1)  # (H, Dk, Dk + Dv)
    values = torch.cat([torch.zeros(t, h, dk, dtype=acc, device=v.device), v.to(acc)], dim=-1)  # (T, H, Dk + Dv)
    out, end = chunk_kda(q, k, values, g, beta, start, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm,
                         allow_kernel=False)
    return out[..., :dk], out[..., dk:], end[..., :dk], end[..., dk:]
