"""A divided capture's MLP pieces (`base.chunked_mlps`): where they start, and which one
runs (`MLP_PIECE`, read by a rehearsal's MoE call, `experts.dealt_rows`). Its own module
so that `base` and `experts` both import it without importing each other."""

from __future__ import annotations

import contextlib
import contextvars


def mlp_pieces(n: int, size: int) -> list[int]:
    """Where a divided capture's MLP pieces of `size` tokens start in n tokens: one piece
    up to size + 1 tokens, and a last piece of one token joins the one before it."""
    if n <= size + 1:
        return [0]
    starts = list(range(0, n, size))
    if n - starts[-1] == 1:
        starts.pop()
    return starts


MLP_PIECE: contextvars.ContextVar = contextvars.ContextVar("longstraw_mlp_piece", default=None)
"""(index, size) of the divided capture's MLP piece running (`chunked_mlps`), else None:
what a rehearsal's MoE call needs to know every rank's rows (`experts.rows_of_every_rank`)."""


@contextlib.contextmanager
def piece(index: int, size: int):
    """`MLP_PIECE` is (index, size) within the block."""
    token = MLP_PIECE.set((index, size))
    try:
        yield
    finally:
        MLP_PIECE.reset(token)


def piece_rows(n: int, size: int, index: int) -> int:
    """Rows of MLP piece `index` of n rows in pieces of `size` (`mlp_pieces`; 0 past the last)."""
    starts = mlp_pieces(n, size)
    if index >= len(starts):
        return 0
    return (starts[index + 1] if index + 1 < len(starts) else n) - starts[index]


__all__ = ["MLP_PIECE", "mlp_pieces", "piece", "piece_rows"]
