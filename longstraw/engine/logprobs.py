"""Per-token log-probs of a response, computed in chunks over the response.

The model's own `lm_head` module is called (so a LoRA / PEFT-wrapped head keeps
working), one chunk of `chunk_size` tokens at a time, under activation
checkpointing: forward keeps only the chunk's hidden states and the [chunk] result,
and backward recomputes that chunk's logits. No [R, vocab] tensor survives a chunk.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def scaled_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits / temperature, cast to float32 first for half-precision logits (else in
    their dtype). Casting first matters: bf16 holds 8 significant bits, so dividing in
    bf16 rounds every logit again (up to ~0.2 nats off at T = 0.7, vocab 32K). The
    sampler and every log-prob use this one definition, so they agree."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def scaled_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the last dim, in float32 for half-precision
    logits (else their dtype; see `scaled_logits`). The one definition of a token's
    log-prob: replay, `score` and rollouts all use it, so their numbers agree."""
    return torch.log_softmax(scaled_logits(logits, temperature), dim=-1)


def _chunk_logprobs(lm_head, hidden, targets, temperature):
    return scaled_log_softmax(lm_head(hidden), temperature).gather(-1, targets[:, None])[:, 0]  # (C,)


def token_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int = 1024) -> torch.Tensor:
    """log p(targets[t] | hidden[t]) for every t.

    Args:
        lm_head: the model's output projection module, [.., d] -> [.., vocab].
        hidden: [R, d] final hidden states (after the final norm).
        targets: [R] token ids.
        temperature: logits are divided by it.
        chunk_size: tokens per chunk.

    Returns:
        [R] log-probs (float32 for half-precision models, else the model dtype).
    """
    pieces = []
    for c0 in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[c0 : c0 + chunk_size], targets[c0 : c0 + chunk_size]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, lm_head, h, y, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm_head, h, y, temperature))
    return torch.cat(pieces)
