"""The planner's prefix tree (`PlanConfig.tree`): responses that share segments, as the
engine runs them (`engine/tree.py`, docs/trees.md). This module parses and levels a tree
(`config.py` uses it); its cost is `tree_cost.py`. Torch-free.

A tree is its levels below the prompt, `[(L_1, f_1), (L_2, f_2), ...]`: every node of
level k-1 (the prompt is level 0) has f_k children, each a segment of L_k tokens. So
level k has N_k = f_1 ... f_k segments, there are G = N_K leaves, and each response is
R = L_1 + ... + L_K tokens. `[(R, G)]` is the flat group.

    replay tokens  = sum_k N_k L_k                   (each shared segment once)
    time           = a leaf is a branch of L_K tokens after P + L_1 + .. + L_{K-1}
                     positions; a segment with children adds one no-grad forward
                     (its capture) to its replay (the reverse walk's recompute with
                     autograd: forward + backward)
    memory         = the prompt state, the states (+ gradient buffers, + GDN snapshots
                     per chunk) of the segments on the current path, and one piece's or
                     one chunk's graph, whatever the number of leaves

A level of fan-out 1 below the first is merged into the level above (the trie cannot
tell them apart: one set of responses shares both). Segments with children are chunked
by min(chunk_size, branch_chunk_size); leaves are pieced by branch_chunk_size, as a
flat branch is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


def parse_tree(tree) -> tuple[tuple[int, int], ...]:
    """A validated tree from `[(L, f), ...]` or the CLI's "1024x2,512x4,128x2"."""
    text = tree
    if isinstance(tree, str):
        try:
            tree = [tuple(int(x) for x in level.split("x")) for level in tree.split(",")]
        except ValueError:
            raise ConfigError(f"PlanConfig.tree {text!r}: write levels as LENGTHxFANOUT joined by commas, "
                              "e.g. '2048x1,256x8'") from None
    levels = []
    for level in tree if isinstance(tree, (list, tuple)) else [None]:
        ok = isinstance(level, (list, tuple)) and len(level) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in level)
        if not ok:
            raise ConfigError(f"PlanConfig.tree must be levels (segment_tokens, fan_out) of positive ints, "
                              f"e.g. [(2048, 1), (256, 8)]; got {text!r}")
        levels.append((level[0], level[1]))
    if not levels:
        raise ConfigError("PlanConfig.tree is empty: give at least one level, e.g. [(1024, 8)] for a flat group")
    return tuple(levels)


def merged(tree) -> tuple[tuple[int, int], ...]:
    """The trie's levels: a level of fan-out 1 below the first joins the level above."""
    out = [tree[0]]
    for length, fan in tree[1:]:
        out[-1:] = [(out[-1][0] + length, out[-1][1])] if fan == 1 else [out[-1], (length, fan)]
    return tuple(out)


@dataclass(frozen=True)
class Level:
    """One level of the merged tree: `nodes` segments of `tokens` tokens, each after
    `above` response tokens (the segments above it); `leaf` for the last level."""

    tokens: int
    nodes: int
    above: int
    leaf: bool


def levels(tree) -> list[Level]:
    """The merged tree's levels, root first."""
    out, nodes, above = [], 1, 0
    m = merged(tree)
    for k, (length, fan) in enumerate(m):
        nodes *= fan
        out.append(Level(tokens=length, nodes=nodes, above=above, leaf=k == len(m) - 1))
        above += length
    return out


def leaf_pieces(c, tokens: int) -> tuple[int, int]:
    """(piece, held) of a leaf of `tokens`: pieces of branch_chunk_size, as `memory.plan_replay`
    pieces a flat branch; held: the tokens of its earlier pieces (0 for one piece)."""
    T = min(tokens, c.branch_chunk_size or tokens)
    return T, ((tokens - 1) // T * T if T < tokens else 0)


def segment_chunk(c, tokens: int) -> int:
    """Walk chunk of a segment with children: min(chunk_size, branch_chunk_size), at most its length."""
    return min(tokens, c.chunk_size, c.branch_chunk_size or tokens)


def takes_tree_path(c) -> bool:
    """Whether the engine replays `c`'s responses as a tree (`engine/tree.py` with shared
    segments): a tree of more than one level, shared (`share_response_prefixes`). A flat
    tree, or sharing off, replays as G flat branches."""
    return c.tree is not None and c.share_response_prefixes and len(c.tree) > 1
