"""Gated delta rule (the linear-attention mixer of Qwen3.5 / Qwen3-Next) for one sequence.

Each value head keeps a state S [Dk, Dv]. Per token t, with log decay g_t <= 0 and
write strength beta_t in [0, 1]:

    S'  = exp(g_t) S_{t-1}                 decay the old state
    u_t = beta_t (v_t - S'^T k_t)          delta: the part of v_t the state does not predict yet
    S_t = S' + k_t u_t^T                   write the correction
    o_t = S_t^T q_t                        read

q and k are first L2-normalised per head (`x / sqrt(|x|^2 + 1e-6)`, as HF and fla do)
when `use_qk_l2norm`, and q is always scaled by Dk^-1/2 after that.

The torch path evaluates this chunk by chunk (the WY / UT form of DeltaNet). Inside a
chunk of C tokens, with gamma_i = g_1 + ... + g_i the log decay since the chunk start
and S0 the state entering the chunk, the written values satisfy a unit lower-triangular
system, so they are affine in S0:

    (I + A) u = beta v - (beta e^gamma k) S0,       A_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j  (j < i)
    u = W_v - W_k S0,     W_v = (I + A)^-1 (beta v),  W_k = (I + A)^-1 (beta e^gamma k)
    o = (e^gamma q) S0 + [(q k^T) e^(gamma_i - gamma_j)]_(j <= i) u
    S_C = e^gamma_C S0 + (e^(gamma_C - gamma) k)^T u

W_v, W_k and the intra-chunk scores are computed for all chunks at once; only the
hand-over of S0 from chunk to chunk is sequential. Every step is an out-of-place torch
op, so plain autograd differentiates it w.r.t. every input, the initial state included,
and no input is ever written to.

Legend: T tokens, Hk query/key heads, Hv value heads (a multiple of Hk), Dk key dim,
Dv value dim, N chunks of C tokens (T padded up to N*C with tokens that neither decay
nor write). Head grouping follows HF: value head h reads q/k head h // (Hv // Hk)
(`repeat_interleave` on the head dim). Arithmetic is float32, or float64 when the
inputs are float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.ops import kernels
from longstraw.tensors import accumulation_dtype_of
from longstraw.ops.registered import register_chunk_op

L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the HF / fla convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_kv_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, Hv, D]: each q/k head serves Hv // Hk consecutive value heads."""
    hk = x.shape[1]
    if hk == num_v_heads:
        return x
    return x.repeat_interleave(num_v_heads // hk, dim=1)


def fla_kernel():
    """flash-linear-attention's fused chunk kernel, or None when it cannot be imported.
    `kernels.pick` decides when it is used: on CUDA in bf16 / fp16 (LongStraw's choice;
    fla 0.6 takes float32 too, see `kernels.py`), or anywhere inside `kernels.forced()`."""
    return kernels.load("chunk_gated_delta_rule")


def _check_shapes(q, k, v, g, beta, initial_state):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, hk, dk = q.shape
    if v.dim() != 3 or v.shape[0] != t:
        raise ValueError(f"v must be [T, Hv, Dv] with T={t}, got {tuple(v.shape)}")
    hv = v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"g and beta must be [T, Hv] = {(t, hv)}, got {tuple(g.shape)} and {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (hv, dk, v.shape[2]):
        raise ValueError(f"initial_state must be [Hv, Dk, Dv] = {(hv, dk, v.shape[2])}, "
                         f"got {tuple(initial_state.shape)}")


def to_chunks(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """[T, Hv, ...] -> [Hv, N, C, ...], zero-padded at the end from T to N*C tokens."""
    x = x.movedim(0, 1)  # (Hv, T, ...)
    pad = n * c - x.shape[1]
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], n, c, *x.shape[2:])


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, chunk_size: int = 64,
                           use_qk_l2norm: bool = True, allow_kernel: bool = True):
    """Gated delta rule over the T tokens of one sequence, starting from `initial_state`.

    Args:
        q, k: [T, Hk, Dk] queries and keys (after the short conv), Hk dividing Hv; the
            torch path repeats them up to Hv heads as HF does (fla groups them itself).
        v: [T, Hv, Dv] values.
        g: [T, Hv] log decay (<= 0). beta: [T, Hv] write strength.
        initial_state: [Hv, Dk, Dv] state before the first token, or None for zeros.
        chunk_size: tokens per chunk of the torch path (any T works; it is padded).
        use_qk_l2norm: L2-normalise q and k per head first (True for Qwen3.5 / Qwen3-Next).
        allow_kernel: on CUDA in bf16/fp16, use flash-linear-attention when importable
            (`kernels.gdn_chunk`; its chunk size is its own); False forces the torch path.

    Returns:
        (out [T, Hv, Dv] in v's dtype, final_state [Hv, Dk, Dv] in float32, or float64
        for float64 inputs). Differentiable w.r.t. q, k, v, g, beta and initial_state.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if allow_kernel and q.shape[0] and (kernel := kernels.pick("chunk_gated_delta_rule", q, k, v)) is not None:
        return kernels.gdn_chunk(kernel, q, k, v, g, beta, initial_state, use_qk_l2norm)

    t, hv, dv = v.shape
    acc = accumulation_dtype_of(q, k, v)
    if initial_state is None:
        initial_state = torch.zeros(hv, q.shape[2], dv, dtype=acc, device=v.device)
    if t == 0:
        return v.new_zeros(0, hv, dv), initial_state.to(acc)
    return GDN_CHUNK_OP([q, k, v, g, beta, initial_state], chunk_size, use_qk_l2norm)


def _torch_chunk(q, k, v, g, beta, initial_state, *, chunk_size: int, flag: bool):
    """The torch path of `chunk_gated_delta_rule` (T >= 1, a given initial state; `flag`:
    use_qk_l2norm): the implementation of the registered op `longstraw::gdn_chunk`."""
    t, hv, dv = v.shape
    dk = q.shape[2]
    acc = accumulation_dtype_of(q, k, v)
    state = initial_state.to(acc)

    q, k = q.to(acc), k.to(acc)
    if flag:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * dk ** -0.5
    q, k = expand_kv_heads(q, hv), expand_kv_heads(k, hv)  # (T, Hv, Dk)

    c = chunk_size
    n = -(-t // c)
    qc, kc, vc = (to_chunks(x, n, c) for x in (q, k, v.to(acc)))  # (Hv, N, C, D)
    gc, bc = (to_chunks(x.to(acc), n, c) for x in (g, beta))  # (Hv, N, C)

    gamma = gc.cumsum(dim=-1)  # (Hv, N, C) log decay since the chunk start
    visible = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()  # j <= i
    # exp(gamma_i - gamma_j) on and below the diagonal, 0 above (masked before exp: no overflow)
    pair_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~visible, float("-inf")).exp()  # (Hv, N, C, C)

    k_beta = kc * bc[..., None]
    # I + A: the unit-triangular solve reads only the strictly lower part of this matrix
    system = (k_beta @ kc.transpose(-1, -2)) * pair_decay  # (Hv, N, C, C)
    w_v = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)  # (Hv, N, C, Dv)
    w_k = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False,
                                        unitriangular=True)  # (Hv, N, C, Dk)

    scores = (qc @ kc.transpose(-1, -2)) * pair_decay  # (Hv, N, C, C) intra-chunk reads
    q_read = qc * gamma.exp()[..., None]  # (Hv, N, C, Dk) reads of the incoming state
    k_write = kc * (gamma[..., -1:] - gamma).exp()[..., None]  # (Hv, N, C, Dk) writes, decayed to chunk end
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (Hv, N, 1, 1)

    outs = []
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ state  # (Hv, C, Dv)
        outs.append(q_read[:, i] @ state + scores[:, i] @ u)  # (Hv, C, Dv)
        state = state * chunk_decay[:, i] + k_write[:, i].transpose(-1, -2) @ u  # (Hv, Dk, Dv)

    out = torch.cat(outs, dim=1)[:, :t].movedim(1, 0)  # (T, Hv, Dv)
    return out.to(v.dtype), state


def _fake_chunk(q, k, v, g, beta, initial_state, *, chunk_size: int, flag: bool):
    """`longstraw::gdn_chunk`'s fake: out [T, Hv, Dv] in v's dtype, state [Hv, Dk, Dv] in acc."""
    t, hv, dv = v.shape
    return v.new_empty(t, hv, dv), v.new_empty(hv, q.shape[2], dv, dtype=accumulation_dtype_of(q, k, v))


GDN_CHUNK_OP = register_chunk_op("gdn_chunk", _torch_chunk, _fake_chunk)


def gated_delta_step(q, k, v, g, beta, state, *, use_qk_l2norm: bool = True, allow_kernel: bool = True):
    """One token of the gated delta rule for B independent sequences (batched decode).

    The recurrent form of `chunk_gated_delta_rule` for T = 1, batched over a leading B
    (the G branches of a rollout, each with its own state).

    Args:
        q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv] (log decay, write strength).
        state: [B, Hv, Dk, Dv], the state before this token (float32, or float64).
        use_qk_l2norm: L2-normalise q and k per head first.
        allow_kernel: on CUDA in bf16 / fp16 and with no gradient wanted, use fla's
            `fused_recurrent_gated_delta_rule` when importable (`kernels.gdn_decode`).

    Returns:
        (out [B, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv] in the accumulation
        dtype). Out of place: `state` is not modified.
    """
    b, hv, dv = v.shape
    dk = q.shape[-1]
    if q.shape != k.shape or q.shape[0] != b or hv % q.shape[1]:
        raise ValueError(f"q, k must be [B, Hk, Dk] with Hk dividing Hv={hv}, got {tuple(q.shape)}, {tuple(k.shape)}")
    if state.shape != (b, hv, dk, dv) or g.shape != (b, hv) or beta.shape != (b, hv):
        raise ValueError(f"state must be {(b, hv, dk, dv)} and g, beta {(b, hv)}; got {tuple(state.shape)}, "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}")
    if allow_kernel and not kernels.needs_grad(q, k, v, g, beta, state):
        if (kernel := kernels.pick("fused_recurrent_gated_delta_rule", q, k, v)) is not None:
            return kernels.gdn_decode(kernel, q, k, v, g, beta, state, use_qk_l2norm)
    acc = accumulation_dtype_of(q, v, state)
    q, k = q.to(acc), k.to(acc)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = expand_kv_heads(q * dk ** -0.5, hv)  # (B, Hv, Dk)
    k = expand_kv_heads(k, hv)
    state = state.to(acc) * g.to(acc).exp()[..., None, None]  # decay
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v.to(acc) - predicted) * beta.to(acc)[..., None]  # (B, Hv, Dv)
    state = state + k[..., :, None] * delta[..., None, :]  # write
    out = torch.einsum("bhk,bhkv->bhv", q, state)  # read
    return out.to(v.dtype), state
