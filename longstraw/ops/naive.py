"""Naive twins of the efficient ops: obvious, full-size, slow. Tests and benchmarks
compare against these; the engine never calls them."""

from __future__ import annotations

import torch


def naive_attention(q, k, v, q_pos, k_pos, scale, window=None):
    """Dense masked softmax attention with GQA expanded.

    Args:
        q: [H, T, D] at absolute positions q_pos [T].
        k, v: [Hkv, N, D] / [Hkv, N, Dv] at absolute positions k_pos [N].
    Returns:
        [H, T, Dv].
    """
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, dim=0)
    v = v.repeat_interleave(g, dim=0)
    scores = (q @ k.transpose(1, 2)) * scale  # (H, T, N)
    masked = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        masked = masked | ((q_pos[:, None] - k_pos[None, :]) >= window)
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def naive_token_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    """log softmax(hidden @ weight^T / temperature)[targets], with full [T, vocab] logits.

    hidden [T, d], weight [V, d], targets [T] -> [T]."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
