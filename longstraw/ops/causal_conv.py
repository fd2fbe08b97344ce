"""Depthwise causal 1-D convolution of one sequence, continued from a carried tail.

The Gated DeltaNet layers pass q/k/v through a short (K = 4 in Qwen3.5 / Qwen3-Next)
depthwise causal conv with SiLU. To run a sequence in pieces (capture chunk by chunk,
then replay a branch after the prompt) each piece needs the K-1 pre-conv inputs just
before it: the tail. With the tail prepended the conv is a plain "valid" conv:

    y[:, t] = act(bias + sum_j weight[:, j] * cat(tail, x)[:, t + j])

and the next piece's tail is the last K-1 columns of cat(tail, x). A zero tail is the
sequence start, which is exactly HF's `causal_conv1d_fn` (zero left padding of K-1).
HF's cache keeps K columns instead of K-1; the oldest one is never read by the conv.

Legend: C channels, T tokens, K kernel width. Channels first, no batch dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r} (expected 'silu' or None)")


def causal_conv1d_with_tail(x, weight, bias=None, tail=None, activation: str | None = "silu"):
    """Depthwise causal conv of x after `tail`.

    Args:
        x: [C, T] pre-conv inputs of this piece.
        weight: [C, K] depthwise kernel (HF's `conv1d.weight.squeeze(1)`).
        bias: [C] or None.
        tail: [C, K-1] the K-1 inputs before x (zeros at the sequence start), or None for zeros.
        activation: "silu" (HF's `hidden_act` for these models) or None.

    Returns:
        (y [C, T] in x's dtype, new_tail [C, K-1] in x's dtype): the tail for the next
        piece, correct for any T (also T < K-1, where part of it is the old tail).
        The conv runs in weight's dtype, as HF does. Differentiable w.r.t. x, weight,
        bias and tail; no input is modified.
    """
    c, _ = x.shape
    width = weight.shape[1] - 1
    if weight.shape[0] != c:
        raise ValueError(f"weight must be [C, K] with C={c}, got {tuple(weight.shape)}")
    if tail is None:
        tail = x.new_zeros(c, width)
    elif tail.shape != (c, width):
        raise ValueError(f"tail must be [C, K-1] = {(c, width)}, got {tuple(tail.shape)}")
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # (C, K-1+T)
    y = F.conv1d(full.to(weight.dtype)[None], weight[:, None, :], bias, groups=c)[0]  # (C, T)
    # A copy, so the carried tail does not keep the whole piece alive.
    new_tail = full[:, full.shape[1] - width:].contiguous()  # (C, K-1)
    return _activate(y, activation).to(x.dtype), new_tail


def causal_conv1d_step(x, weight, bias=None, tail=None, activation: str | None = "silu"):
    """One token of `causal_conv1d_with_tail` for B independent sequences (batched decode).

    Args:
        x: [B, C] this token's pre-conv inputs.
        weight: [C, K]; bias: [C] or None.
        tail: [B, C, K-1], each sequence's last K-1 inputs (None: zeros).
        activation: "silu" or None.

    Returns:
        (y [B, C] in x's dtype, new_tail [B, C, K-1] in x's dtype). No input is modified.
    """
    b, c = x.shape
    width = weight.shape[1] - 1
    if weight.shape[0] != c:
        raise ValueError(f"weight must be [C, K] with C={c}, got {tuple(weight.shape)}")
    if tail is None:
        tail = x.new_zeros(b, c, width)
    elif tail.shape != (b, c, width):
        raise ValueError(f"tail must be [B, C, K-1] = {(b, c, width)}, got {tuple(tail.shape)}")
    full = torch.cat([tail.to(x.dtype), x[..., None]], dim=-1)  # (B, C, K)
    y = (full.to(weight.dtype) * weight).sum(-1)  # (B, C)
    if bias is not None:
        y = y + bias
    return _activate(y, activation).to(x.dtype), full[..., 1:].contiguous()
