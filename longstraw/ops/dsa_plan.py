"""Where each selected entry of a DSA query block lives, without reading device data.

`sparse_latent_attention` gathers, per block of B queries, the B*K selected rows from its
sources: the prefix segments and, last, the new tokens. The source with the most rows is
the `primary`: it is gathered and scattered over all B*K entries at once (row index
clamped; the other entries are overwritten / zeroed after). Every other source j takes
only its own entries, listed by `nonzero_static` with a size known on the host: a bound,
not a count, so building a plan never waits for the device (on a GPU a count would be one
host sync per call, i.e. per layer and chunk: at P = 2.1M that is tens of thousands per
step). The bound of a block's entries in source j is

    prefix segment of S_j rows:   B * min(K, S_j)                (distinct positions per row)
    new tokens, rows i of a block: sum_i min(K, T, i + 1)        (causal: only visible positions)

and at most B*K. The padding slots of `nonzero_static` point at a dummy entry B*K (one row
past the block in the gather / gradient buffers: `dummy_rows`), so they copy into and add
from a row nobody reads. The indices' validity (each -1 or a visible position of exactly one
source) is asserted on the device (`torch._assert_async`: a RuntimeError on CPU at once, a
device-side assert on CUDA, nothing on fake tensors), which the bounds rely on.

Legend: B queries of a block, K = topk, n = B*K entries, S_j rows of source j, T new tokens.
"""

from __future__ import annotations

import torch

dummy_rows = 1
"""Rows past the n entries that a plan's buffers must hold (the padding slots' target)."""


def _held(flat: torch.Tensor, src) -> torch.Tensor:
    """Whether each position of `flat` lies in source `src` (bool, flat's shape)."""
    return (flat >= src.start) & (flat < src.start + src.k.shape[0])


def check_indices(indices: torch.Tensor, sources: list, q_start: int) -> None:
    """Assert on the device that every entry of indices [T, K] is -1 or a visible position
    of exactly one source (new tokens: at or before the query's own position)."""
    valid = indices >= 0
    hits = torch.zeros(indices.shape, dtype=torch.uint8, device=indices.device)
    for src in sources:
        hits += _held(indices, src)
    own = torch.arange(q_start, q_start + indices.shape[0], device=indices.device)[:, None]
    bad = (hits != valid) | (indices > own)
    torch._assert_async(~bad.any(), "an index is neither -1 nor a visible position of exactly one prefix segment or "
                                    "new token")


def entry_bounds(sources: list, b0: int, b1: int, topk: int) -> list[int]:
    """Host-known upper bounds [len(sources)] of the entries of query rows b0..b1-1 (of the
    call's new tokens) that lie in each source; the last source is the new tokens."""
    n = (b1 - b0) * topk
    out = [min(n, (b1 - b0) * min(topk, src.k.shape[0])) for src in sources[:-1]]
    t = sources[-1].k.shape[0]
    out.append(min(n, sum(min(topk, t, i + 1) for i in range(b0, b1))))
    return out


def primary_source(sources: list) -> int:
    """The source gathered over every entry: the one with the most rows (the first of ties)."""
    return max(range(len(sources)), key=lambda j: sources[j].k.shape[0])


class BlockPlan:
    """Where each entry of a query block's indices [B, K] lives (see the module docstring).

    primary: the source gathered / scattered over all n entries (`primary_rel`, clamped).
    others: (source index, entry ids [bound] padded with n, rows in that source [bound]).
    in_primary / valid: bool [n] / [B, K]."""

    def __init__(self, idx: torch.Tensor, sources: list, bounds: list[int], primary: int):
        flat = idx.reshape(-1)
        self.n = n = flat.numel()
        self.primary = primary
        p = sources[primary]
        self.primary_rel = (flat - p.start).clamp_(0, p.k.shape[0] - 1)
        self.others = []
        for j, src in enumerate(sources):
            if j == primary or bounds[j] == 0:
                continue
            sel = torch.nonzero_static(_held(flat, src), size=bounds[j], fill_value=n).squeeze(1)
            # a padding slot (n) reads some row of the source into the dummy row, and adds the zero dummy row back
            rel = (flat[sel.clamp(max=n - 1)] - src.start).clamp_(0, src.k.shape[0] - 1)
            self.others.append((j, sel, rel))
        self.in_primary = _held(flat, p)
        self.valid = (flat >= 0).view(idx.shape)

    def gather(self, sources: list, attr: str, buf: torch.Tensor) -> torch.Tensor:
        """Rows [n, width] of `attr` ('k' or 'v') of every entry, written into buf (n + 1 rows), zero at -1."""
        out = buf[:self.n]
        src = getattr(sources[self.primary], attr)
        if src.dtype == out.dtype:
            torch.index_select(src, 0, self.primary_rel, out=out)
        else:
            out.copy_(src.index_select(0, self.primary_rel))
        for j, sel, rel in self.others:
            buf.index_copy_(0, sel, getattr(sources[j], attr).index_select(0, rel).to(buf.dtype))
        out.masked_fill_(~self.valid.view(-1, 1), 0)
        return out

    def scatter(self, targets: list, dk_rows: torch.Tensor, dv_rows: torch.Tensor, latent_sink: bool) -> None:
        """Add the entries' key/value gradient rows [n + 1, D] / [n + 1, Dv] (the last row
        zero) into each source's targets (dk, dv) (either may be None). The first n rows are
        scratch: they get overwritten. `latent_sink`: the primary's dv lives in its dk's first
        Dv columns, so one scatter adds both."""
        n = self.n
        for j, sel, rel in self.others:
            tk, tv = targets[j] or (None, None)
            if tk is not None:
                tk.index_add_(0, rel, dk_rows.index_select(0, sel).to(tk.dtype))
            if tv is not None:
                tv.index_add_(0, rel, dv_rows.index_select(0, sel).to(tv.dtype))
        tk, tv = targets[self.primary] or (None, None)
        if tk is None and tv is None:
            return
        dk_rows, dv_rows = dk_rows[:n], dv_rows[:n]
        if self.others:  # other sources' rows are done; -1 rows are zero already
            dk_rows.masked_fill_(~self.in_primary[:, None], 0)
            dv_rows.masked_fill_(~self.in_primary[:, None], 0)
        if latent_sink:
            dk_rows[:, :dv_rows.shape[1]] += dv_rows
            tv = None
        if tk is not None:
            tk.index_add_(0, self.primary_rel, dk_rows.to(tk.dtype))
        if tv is not None:
            tv.index_add_(0, self.primary_rel, dv_rows.to(tv.dtype))
