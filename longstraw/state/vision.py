"""What a prompt with images keeps beside its per-layer state: the image tokens'
embeddings (the vision tower's output, computed once at capture), where they sit in the
prompt, and the prompt's M-RoPE position ids.

Shapes (one prompt, no batch dim):
    P    prompt tokens
    N    image tokens in the prompt (after the tower's spatial merge)
    d    the text model's hidden size
    B, T a call's batch and tokens (B = 1 for a sequence, G for a decode step)

Every run against the prompt state reads it through two lookups keyed by a token's
*sequence index* (what LongStraw calls its position; `0 .. P - 1` in the prompt, `P ..`
in a response): `rope_positions` gives the three-axis M-RoPE ids HF's `get_rope_index`
gives that token (text after the prompt continues from `rope_delta`: index + delta on
every axis), and `embed` puts the tower's row at each image token. So capture chunks,
replay, the reverse walk and decode steps place images and positions alike, wherever a
chunk boundary falls (an image split over two chunks reads its rows from one table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.tensors import accumulation_dtype, nbytes


@dataclass
class PromptImages:
    """The prompt's image embeddings and M-RoPE positions.

    Fields:
        positions: LongTensor [3, P]: HF's M-RoPE ids (temporal, height, width) of each
            prompt token.
        rope_delta: HF's `rope_deltas` for the prompt: max position + 1 - P (<= 0); a
            token at sequence index i >= P has M-RoPE id i + rope_delta on every axis.
        rows: LongTensor [P]: the row of `embeds` at each image token, -1 at text tokens.
        embeds: [N, d] the tower + merger's output, detached, in the model dtype.
        spans: per image, (first row, rows): its rows of `embeds`, in prompt order.
        grad: exact mode only: dLoss/d(embeds) [N, d] in the accumulation dtype, summed
            over the reverse walk's chunks; the tower's backward reads it.
        trains: whether the tower takes a gradient (False: frozen, e.g. LoRA on the text
            model only; exact mode then allocates no `grad`).
    """

    positions: torch.Tensor
    rope_delta: int
    rows: torch.Tensor
    embeds: torch.Tensor
    spans: list
    grad: torch.Tensor | None = None
    trains: bool = True

    def __post_init__(self):
        assert self.positions.dim() == 2 and self.positions.shape[0] == 3, self.positions.shape
        assert self.rows.shape == (self.positions.shape[1],), (self.rows.shape, self.positions.shape)
        assert int((self.rows >= 0).sum()) == self.embeds.shape[0], "one embedding row per image token"

    @property
    def prompt_tokens(self) -> int:
        return self.positions.shape[1]

    def rope_positions(self, index: torch.Tensor) -> torch.Tensor:
        """Sequence indices [B, T] -> HF's position ids [4, B, T]: row 0 the indices
        themselves (the text positions HF's masks read), rows 1-3 the M-RoPE ids."""
        inside = index < self.prompt_tokens
        table = self.positions.to(index.device)[:, index.clamp(max=self.prompt_tokens - 1)]  # (3, B, T)
        mrope = torch.where(inside[None], table, (index + self.rope_delta)[None].expand(3, -1, -1))
        return torch.cat([index[None], mrope], dim=0)

    def embed(self, embed_tokens, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Input embeddings [B, T, d] of tokens ids [B, T] at sequence indices [B, T]: the
        model's own embedding table, and the tower's rows at image tokens (HF's
        `masked_scatter`, so the table gets no gradient there). With grad enabled and a
        gradient buffer (exact mode's walk), the rows' gradient is added into `grad`."""
        out = embed_tokens(ids)  # (B, T, d)
        rows = torch.where(index < self.prompt_tokens, self.rows.to(index.device)[index.clamp(
            max=self.prompt_tokens - 1)], torch.full_like(index, -1))  # (B, T)
        mask = rows >= 0
        if not bool(mask.any()):
            return out
        picked = rows[mask]  # (n,), in sequence order
        src = self.embeds[picked].to(out.dtype)  # (n, d)
        if torch.is_grad_enabled() and self.grad is not None:
            src = src.detach().requires_grad_(True)
            src.register_hook(lambda g, picked=picked: self._add_grad(picked, g))
        return out.masked_scatter(mask[..., None], src)

    def _add_grad(self, rows: torch.Tensor, g: torch.Tensor) -> None:
        """Backward's hook on the rows an exact-mode chunk read: add their gradient [n, d]."""
        self.grad.index_add_(0, rows, g.to(self.grad.dtype))

    def enable_grad_buffers(self) -> None:
        """A zeroed dLoss/d(embeds) buffer (exact mode; none for a frozen tower)."""
        if not self.trains:
            return
        self.grad = torch.zeros(self.embeds.shape, dtype=accumulation_dtype(self.embeds.dtype),
                                device=self.embeds.device)

    def release_grad_buffers(self) -> None:
        self.grad = None

    def nbytes(self) -> int:
        """Bytes held: the embeddings, the position table and the row map."""
        return nbytes(self.embeds, self.positions, self.rows)

    def grad_nbytes(self) -> int:
        return nbytes(self.grad)
