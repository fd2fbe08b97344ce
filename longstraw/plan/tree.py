"""The planner's prefix tree (`PlanConfig.tree`): responses that share segments, as the
engine runs them (`engine/tree.py`, docs/trees.md). Torch-free.

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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:  # config imports this module
    from .config import Basis
    from .memory import ReplayPlan, StatePlan
    from .timing import Timing


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


# ----------------------------------------------------------------------------
# memory: the current path's segment states + one piece's or chunk's graph


def plan_tree_replay(s: "Basis", state: "StatePlan") -> "ReplayPlan":
    """The largest working set of the tree's replay: at each level, the states (with
    gradient buffers) of the segments above plus this level's piece (a leaf) or walk
    chunk (a segment with children). A flat tree is `memory.plan_replay` exactly."""
    from .memory import ReplayPlan, _autograd, _graph_tok

    c, b, arch, st = s.config, s.b, s.arch, state.sizes
    fixed = st["recurrent_fixed"] + st["conv_tail_fixed"]
    all_levels = levels(c.tree)

    def chunks(lv: Level) -> int:  # walk chunks of a segment with children (a GDN snapshot each)
        return -(-lv.tokens // _chunk(c, lv.tokens))

    best = None
    for lv in all_levels:
        L, above = lv.tokens, [x for x in all_levels if x.above < lv.above]
        if lv.leaf:  # a branch of L tokens, pieced like a flat one: its earlier pieces are held
            T, own = leaf_pieces(c, L)
            held, own_tokens, own_snaps = lv.above + own, own, own // T
        else:  # its last walk chunk runs while the whole segment's state is held
            T = _chunk(c, L)
            held, own_tokens, own_snaps = lv.above + L - T, L, chunks(lv)
        graph, attn = _autograd(s, T, s.p_rank + held)
        logits = min(T, c.logits_chunk_size) * arch.vocab * (b + 3 * 4) + T * arch.hidden * b
        snaps = own_snaps + sum(chunks(x) for x in above)
        branch_state = 2 * (st["per_token"] * (lv.above + own_tokens) + snaps * fixed)  # with gradient buffers
        plan = ReplayPlan(T=T, held=held, graph_tok=_graph_tok(s), graph=graph, attention=attn, logits=logits,
                          branch_state=branch_state, working=graph + max(attn, logits) + branch_state)
        best = plan if best is None or plan.working > best.working else best
    return best


def leaf_pieces(c, tokens: int) -> tuple[int, int]:
    """(piece, held) of a leaf of `tokens`: pieces of branch_chunk_size, as `memory.plan_replay`
    pieces a flat branch; held: the tokens of its earlier pieces (0 for one piece)."""
    T = min(tokens, c.branch_chunk_size or tokens)
    return T, ((tokens - 1) // T * T if T < tokens else 0)


def _chunk(c, tokens: int) -> int:
    """Walk chunk of a segment with children: min(chunk_size, branch_chunk_size), at most its length."""
    return min(tokens, c.chunk_size, c.branch_chunk_size or tokens)


# ----------------------------------------------------------------------------
# time: each segment once, plus one forward per segment with children


def tree_replay_flops(s: "Basis") -> float:
    """Replay FLOPs of the whole tree on one rank (all leaves and shared segments)."""
    from .arch import BACKWARD_FACTOR
    from .timing import forward_flops

    c, arch, params, P, W = s.config, s.arch, s.params, s.P, s.W
    total = 0.0
    for lv in levels(c.tree):
        L, prefix = lv.tokens, P + lv.above
        fwd = forward_flops(arch, params, L, prefix, lm_head=True, world=W)
        if lv.leaf:  # as timing.plan_time's branch: replay, score passes, held pieces' no-grad forward
            held = leaf_pieces(c, L)[1]
            extra = forward_flops(arch, params, held, prefix, lm_head=False, world=W) if held else 0.0
        else:  # its capture before the children, then the walk's recompute
            extra = forward_flops(arch, params, L, prefix, lm_head=False, world=W)
        total += lv.nodes * ((1 + BACKWARD_FACTOR + c.score_passes) * fwd + extra)
    return total


def tree_timing(s: "Basis", timing: "Timing") -> "Timing":
    """`timing` with the tree's replay in place of G flat branches (flops_branch: the tree's
    replay FLOPs per leaf)."""
    per_leaf = tree_replay_flops(s) / s.G
    shift = s.G * (per_leaf - timing.flops_branch) / timing.throughput
    return replace(timing, flops_branch=per_leaf, t_detached=timing.t_detached + shift,
                   t_exact=timing.t_exact + shift)


def tree_report(s: "Basis") -> dict:
    """The report's 'tree' entry: levels as given and merged, leaves, replay tokens (each
    segment once) against the flat group's G x R."""
    lv = levels(s.config.tree)
    return {"levels": [list(x) for x in s.config.tree], "merged_levels": [[x.tokens, x.nodes] for x in lv],
            "leaves": s.G, "replay_tokens": sum(x.nodes * x.tokens for x in lv), "flat_tokens": s.G * s.R,
            "flops_replay_tree": tree_replay_flops(s)}
