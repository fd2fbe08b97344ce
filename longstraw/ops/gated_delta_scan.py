"""The gated delta rule as an affine map of its state, for sequence-parallel capture.

Per value head, one token updates the state S [Dk, Dv] by

    S_t = e^(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

which is affine in S_{t-1}. A run of tokens (a segment) is therefore one affine map

    S_end = A S_start + C,       A [Dk, Dk],  C [Dk, Dv]

and every output is affine in S_start too: o_t = S_t^T q_t = R_t S_start + O_t, with
R_t = q_t^T A_t [Dk] (the read of the start state) and O_t the output from a zero start.

Context parallelism uses this to divide a GDN layer: each rank computes (R, O, A, C) of
the segments it owns, all at once and without knowing their start states; a chain across
ranks then carries the state from segment to segment (`chain_states`: per segment one
[Hv, Dk, Dv] matmul and at most one send), and each rank finishes its outputs with one
small matmul per token. This is the LASP-2 / Megatron GDN-CP idea for the delta rule.

How (R, O, A, C) are computed: the columns of the state evolve independently (the rule
mixes rows through k k^T, never columns), so running the ordinary chunked rule with the
augmented start state [I | 0] ([Dk, Dk + Dv]) and values [0 | v] gives the final state
[A | C] and the outputs [R | O] in one pass (`chunk_gated_delta_rule`, torch path, in
the accumulation dtype). It costs (Dk + Dv) / Dv of one plain pass of the recurrence;
the projections, the conv and the gates are not repeated.

Legend: T tokens, Hv value heads, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

from ..tensors import accumulation_dtype_of
from longstraw.parallel.collectives import recv_from, send_to
from .gated_delta import chunk_gated_delta_rule


def gated_delta_transition(q, k, v, g, beta, *, use_qk_l2norm: bool = True, chunk_size: int = 64):
    """The segment's affine map and outputs, as functions of its unknown start state.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] (as `chunk_gated_delta_rule`).

    Returns:
        (read [T, Hv, Dk], out0 [T, Hv, Dv], A [Hv, Dk, Dk], C [Hv, Dk, Dv]), all in the
        accumulation dtype (float64 for float64 inputs, else float32), such that from a
        start state S [Hv, Dk, Dv] the outputs are read @ S + out0 (per head) and the end
        state is A @ S + C.
    """
    t, hv, dv = v.shape
    dk = q.shape[-1]
    acc = accumulation_dtype_of(q, k, v)
    eye = torch.eye(dk, dtype=acc, device=v.device).expand(hv, dk, dk)
    start = torch.cat([eye, torch.zeros(hv, dk, dv, dtype=acc, device=v.device)], dim=-1)  # (Hv, Dk, Dk+Dv)
    values = torch.cat([torch.zeros(t, hv, dk, dtype=acc, device=v.device), v.to(acc)], dim=-1)  # (T, Hv, Dk+Dv)
    out, end = chunk_gated_delta_rule(q, k, values, g, beta, start, chunk_size=chunk_size,
                                      use_qk_l2norm=use_qk_l2norm, allow_kernel=False)
    return out[..., :dk], out[..., dk:], end[..., :dk], end[..., dk:]


def apply_transition(a: torch.Tensor, c: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """A @ S + C per head ([Hv, Dk, Dk], [Hv, Dk, Dv], S [Hv, Dk, Dv] or None for zeros)."""
    return c if state is None else torch.baddbmm(c, a, state.to(c.dtype))


def finish_outputs(read: torch.Tensor, out0: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The segment's outputs [T, Hv, Dv] from its start state S (None: zeros)."""
    if state is None:
        return out0
    return out0 + torch.einsum("thk,hkv->thv", read, state.to(read.dtype))


def chain_states(transitions, links, cp, shape, dtype, device):
    """Carry the state through this rank's segments, across ranks (an exclusive scan of
    affine maps, evaluated as a relay: a segment's start state is the previous segment's
    end state, received from its owner).

    Args:
        transitions: [(A, C)] of this rank's segments, in position order.
        links: [(src, dst)] per segment: src is -1 at the sequence start (zero state),
            this rank when the previous segment is ours, else the rank to receive the start
            state from; dst is the rank to send the end state to, or None (ours, or the end).
        cp: the `parallel.context.ContextParallel` (unused when no link crosses ranks).
        shape, dtype, device: of a state [Hv, Dk, Dv].

    Returns:
        [(start state or None, end state)] per segment.

    Every rank walks its segments in position order and a send only goes to the owner of
    the next segment, which is waiting for exactly that: the relay cannot deadlock.
    """
    out, state, pending = [], None, []
    for (a, c), (src, dst) in zip(transitions, links):
        if src == -1:
            state = None
        elif src != cp_rank(cp):
            state = recv_from(torch.empty(shape, dtype=dtype, device=device), src, cp)
        end = apply_transition(a, c, state)
        if dst is not None:
            pending.append(send_to(end, dst, cp))
        out.append((state, end))
        state = end
    for wait in pending:
        wait()
    return out


def cp_rank(cp) -> int:
    return 0 if cp is None else cp.rank
