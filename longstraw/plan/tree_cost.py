"""The cost of a prefix tree (`PlanConfig.tree`, levels in `tree.py`): its replay's memory
and FLOPs, and the report's 'tree' entry. See `tree.py` for the model. Torch-free."""

from __future__ import annotations

from dataclasses import replace

from ..defaults import recompute_pays
from .arch import BACKWARD_FACTOR
from .config import Basis
from .memory import ReplayPlan, StatePlan, head_grad_transient, held_bytes, plan_replay, plan_state
from .timing import Timing, forward_flops
from .tree import Level, leaf_pieces, levels, segment_chunk
from .working import autograd_pass, recompute_pass


# ----------------------------------------------------------------------------
# memory: the current path's segment states + one piece's or chunk's graph


def plan_tree_replay(s: Basis, state: StatePlan) -> ReplayPlan:
    """The largest working set of the tree's replay: at each level, the states (with
    gradient buffers) of the segments above plus this level's piece (a leaf) or walk
    chunk (a segment with children). A flat tree is `memory.plan_replay` exactly."""
    c, b, arch, st = s.config, s.b, s.arch, state.sizes
    graph_tok = plan_replay(s, state).graph_tok  # per token of one pass: the flat plan's
    dense = c.self_attention != "flash"
    fixed = st["recurrent_fixed"] + st["conv_tail_fixed"]
    all_levels = levels(c.tree)

    def chunks(lv: Level) -> int:  # walk chunks of a segment with children (a GDN snapshot each)
        return -(-lv.tokens // segment_chunk(c, lv.tokens))

    best = None
    for lv in all_levels:
        L, above = lv.tokens, [x for x in all_levels if x.above < lv.above]
        if lv.leaf:  # a branch of L tokens, pieced like a flat one: its earlier pieces are held
            T, own = leaf_pieces(c, L)
            held, own_tokens, own_snaps = lv.above + own, own, own // T
        else:  # its last walk chunk runs while the whole segment's state is held
            T = segment_chunk(c, L)
            held, own_tokens, own_snaps = lv.above + L - T, L, chunks(lv)
        graph, attn = autograd_pass(arch, T, s.p_rank + held, c.attention_block_size, b, s.acc, dense,
                                    c.gdn_kernel)  # as memory.plan_replay's piece
        logits = min(T, c.logits_chunk_size) * arch.vocab * (b + 3 * 4) + T * arch.hidden * b + head_grad_transient(s, T)
        snaps = own_snaps + sum(chunks(x) for x in above)
        branch_state = 2 * (st["per_token"] * (lv.above + own_tokens) + snaps * fixed)  # with gradient buffers
        working = graph + max(attn, logits)
        recompute = recompute_pays(c.recompute_layers, graph, held_bytes(s, state), len(arch.layers))  # as plan_replay
        if recompute:
            kept, moment, layer_graph = recompute_pass(arch, T, s.p_rank + held, c.attention_block_size, b, s.acc,
                                                       dense, c.gdn_kernel)
            graph, working = kept + layer_graph, kept + max(moment, logits)
        plan = ReplayPlan(T=T, held=held, graph_tok=graph_tok, recompute=recompute, graph=graph, attention=attn,
                          logits=logits, branch_state=branch_state, working=working + branch_state)
        best = plan if best is None or plan.working > best.working else best
    return best


# ----------------------------------------------------------------------------
# time: each segment once, plus one forward per segment with children


def tree_replay_flops(s: Basis) -> float:
    """Replay FLOPs of the whole tree on one rank (all leaves and shared segments)."""
    c, arch, params, P, W = s.config, s.arch, s.params, s.P, s.W
    held_anyway = held_bytes(s, plan_state(s))  # the recompute rule's yardstick (as plan_tree_replay)
    dense = c.self_attention != "flash"
    total = 0.0
    for lv in levels(c.tree):
        L, prefix = lv.tokens, P + lv.above
        fwd = forward_flops(arch, params, L, prefix, lm_head=True, world=W)
        if lv.leaf:  # as timing.plan_time's branch: replay, score passes, held pieces' no-grad forward
            held = leaf_pieces(c, L)[1]
            extra = forward_flops(arch, params, held, prefix, lm_head=False, world=W) if held else 0.0
        else:  # its capture before the children, then the walk's recompute
            extra = forward_flops(arch, params, L, prefix, lm_head=False, world=W)
        T = leaf_pieces(c, L)[0] if lv.leaf else segment_chunk(c, L)
        graph = autograd_pass(arch, T, s.p_rank + lv.above, c.attention_block_size, s.b, s.acc, dense,
                              c.gdn_kernel)[0]
        if recompute_pays(c.recompute_layers, graph, held_anyway, len(arch.layers)):  # one more forward of the layers
            extra += forward_flops(arch, params, L, prefix, lm_head=False, world=W)
        total += lv.nodes * ((1 + BACKWARD_FACTOR + c.score_passes) * fwd + extra)
    return total


def tree_timing(s: Basis, timing: Timing) -> Timing:
    """`timing` with the tree's replay in place of G flat branches (flops_branch: the tree's
    replay FLOPs per leaf)."""
    per_leaf = tree_replay_flops(s) / s.G
    shift = s.G * (per_leaf - timing.flops_branch) / timing.throughput
    return replace(timing, flops_branch=per_leaf, t_detached=timing.t_detached + shift,
                   t_exact=timing.t_exact + shift)


def tree_report(s: Basis) -> dict:
    """The report's 'tree' entry: levels as given and merged, leaves, replay tokens (each
    segment once; G x R with `share_response_prefixes=False`, the flat path) against the
    flat group's G x R."""
    lv, shared = levels(s.config.tree), s.config.share_response_prefixes
    return {"levels": [list(x) for x in s.config.tree], "merged_levels": [[x.tokens, x.nodes] for x in lv],
            "leaves": s.G, "share_response_prefixes": shared,
            "replay_tokens": sum(x.nodes * x.tokens for x in lv) if shared else s.G * s.R, "flat_tokens": s.G * s.R,
            "flops_replay_tree": tree_replay_flops(s)}
