"""The planner's state offload figures (`--offload-state`, `ExecConfig(state_device="cpu")`):
what stays on the device, what moves to host, and the host <-> device traffic of one
step, counted the way `longstraw/state/offload.py` moves it.

The engine (`offload.Stager`) stages every layer with per-token rows into one of two
device slots each time a pass visits it, and forgets the slots after each pass, so
per rank:

    slots on the device   2 x the largest layer's rows [S rows] (+ its fp32 gradient
                          rows in exact mode)
    a forward pass        H2D: every staged layer's rows before the pass's first query
    capture chunk k       + D2H: the chunk's new rows (write-back)
    a divided capture     D2H only: each rank's own rows, written once (nothing staged in)
    a backward pass       H2D: the rows of every staged layer autograd reaches (replay:
                          all; the reverse walk: all but the model's last layer, whose
                          attention output feeds no state), and in exact mode their
                          gradient rows H2D and D2H (accumulated in the slot, written back)
    the walk's seeds      H2D: each chunk's own gradient rows (read from host; every
                          position of the chunk, zeros where another rank holds it)

S is the rank's rows of the prompt (the fullest rank under context parallelism). The
time is the traffic over a stated host bandwidth; the copies overlap compute, so a step
takes at least the larger of the two. Planned, not measured.

Host memory is one arena per state (`host_arena.py`): one buffer for the rows, and in
exact mode one for the gradient rows, each tensor starting at a multiple of
`ARENA_ALIGN` bytes. `host_bytes` is the arenas' size, padding included: what offload
allocates (page-locked at exactly that size on CUDA), not torch's power-of-two pinned
blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..parallel.deal import Deal
from .snapshots import snapshot_grad_bytes

if TYPE_CHECKING:  # annotations only
    from .config import Basis
    from .memory import CapturePlan, ReplayPlan, StatePlan

ARENA_ALIGN = 64
"""Bytes: every tensor in a host arena starts at a multiple of this (a cache line; a
multiple of every element size)."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ARENA_ALIGN`."""
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


def arena_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of tensors of `sizes` bytes laid out in one arena, in order, each
    aligned to `ARENA_ALIGN`, and the arena's total bytes (sum of the aligned sizes)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += aligned(n)
    return offsets, total


def layer_tensors(arch, b: int, acc: int, exact: bool) -> list[tuple[int, list[int], list[int]]]:
    """(layer index, bytes per position of each host row tensor, of each gradient row
    tensor) of every layer whose per-token rows offload keeps in host memory, in the
    arenas' order (`host_arena.py`): K and V [Hkv, S, D] and dK, dV per attention layer;
    the latent [1, S, R + Dr], indexer keys [S, Di] and the latent's gradient per MLA
    layer. A detached sliding window (trimmed to W - 1 rows) and GDN layers stay on the
    device; exact mode keeps a window's every row, so it is staged then."""
    out = []
    for i, layer in enumerate(arch.layers):
        if layer.mixer == "attention" and (layer.window is None or exact):
            kv = arch.kv_heads * arch.head_dim
            out.append((i, [kv * b, kv * b], [kv * acc, kv * acc]))
        elif layer.mixer == "mla":
            latent = arch.kv_lora_rank + arch.rope_dim
            out.append((i, [latent * b] + ([arch.index_dim * b] if layer.indexer else []), [latent * acc]))
    return out


def staged_layers(arch, b: int, acc: int, exact: bool) -> list[tuple[int, int, int]]:
    """(layer index, row bytes per position, gradient bytes per position) of every layer
    whose per-token rows offload keeps in host memory (`layer_tensors`, summed per layer)."""
    return [(i, sum(rows), sum(grads)) for i, rows, grads in layer_tensors(arch, b, acc, exact)]


def host_bytes(arch, *, b: int, acc: int, exact: bool, rows: int) -> int:
    """Bytes of the host arenas of a state holding `rows` positions per tensor: the rows'
    arena, and in exact mode the gradient rows' arena, alignment padding included."""
    tensors = layer_tensors(arch, b, acc, exact)
    total = arena_offsets([r * rows for _, rs, _ in tensors for r in rs])[1]
    if exact:
        total += arena_offsets([g * rows for _, _, gs in tensors for g in gs])[1]
    return total


def offload_plan(arch, *, b: int, acc: int, exact: bool, prompt: int, chunk: int, world: int, block: int,
                 group: int, pieces: int, held_pieces: int, score_passes: int,
                 divided_capture: bool = False, decode_steps: int = 0) -> dict:
    """Bytes on the device (slots), in host memory, and moved per step, for one rank.

    Args:
        b / acc: state / gradient dtype bytes. prompt: P (capture holds P - 1 rows).
        chunk: capture chunk C. world / block: context-parallel ranks and shard block.
        group: G branches; pieces / held_pieces: pieces per branch and those captured
        before the walk; score_passes: no-grad forwards per branch.
        divided_capture: capture runs divided over the ranks (each rank writes its own
            rows straight to host and stages nothing in).
        decode_steps: `Engine.generate`'s decode steps (R with `PlanConfig.generate`, else
            0): each stages every layer's rows once (H2D), read only.
    """
    layers = staged_layers(arch, b, acc, exact)
    rows = [r for _, r, _ in layers]
    grads = [g for _, _, g in layers] if exact else [0] * len(layers)
    r_all, g_all = sum(rows), sum(grads)
    last = len(arch.layers) - 1
    r_walk = sum(r for i, r, _ in layers if i != last)  # the walk's backward never reaches the last layer
    g_walk = sum(g for (i, _, _), g in zip(layers, grads) if i != last)
    n = prompt - 1  # positions the prompt state holds
    deal = Deal(world, block)
    S = deal.fullest(n)  # the fullest rank's rows (every position for one rank)
    starts = range(0, n, chunk)
    prefix_rows = sum(deal.fullest(a) for a in starts)  # rows read by each chunk, summed

    h2d = {"capture": 0 if divided_capture else r_all * prefix_rows}
    d2h = {"capture": r_all * S}
    # each branch: held pieces captured, then every piece recomputed forward and backward
    forwards = held_pieces + pieces + score_passes
    h2d["replay"] = group * (forwards * r_all * S + pieces * (r_all + g_all) * S)
    d2h["replay"] = group * pieces * g_all * S
    if decode_steps:
        h2d["generate"] = decode_steps * r_all * S
    if exact:
        # + the seeds: each chunk's gradient rows, full width (zeros where another rank holds them)
        h2d["reverse"] = r_all * prefix_rows + (r_walk + g_walk) * prefix_rows + g_all * n
        d2h["reverse"] = g_walk * prefix_rows
    slots = min(2, len(layers))  # layers alternate between two slots; one staged layer fills one
    return {
        "staged_layers": len(layers),
        "host_bytes": host_bytes(arch, b=b, acc=acc, exact=exact, rows=S),
        "slot_bytes": slots * (max(rows, default=0) + max(grads, default=0)) * S,
        "grad_slot_bytes": slots * max(grads, default=0) * S,
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "traffic_bytes": sum(h2d.values()) + sum(d2h.values()),
        "decode_bytes_per_token": r_all * S,
        "chunks": math.ceil(n / chunk) if n else 0,
        "prompt_rows": S,
    }


@dataclass(frozen=True)
class OffloadPlan:
    """Where the state lives under state offload (without it: all on the device).

    Fields:
        figures: `offload.offload_plan`'s dict (None without offload).
        state_gpu / state_host: the rank's state bytes on the device / in host memory.
        state_grad_gpu: exact mode's state gradient bytes on the device.
        assumptions: the report's line about it (none without offload).
    """

    figures: dict | None
    state_gpu: float
    state_host: int
    state_grad_gpu: float
    assumptions: tuple


def plan_offload(s: Basis, state: StatePlan, replay: ReplayPlan, capture: CapturePlan) -> OffloadPlan:
    """Per-token rows (and their gradients) in host memory, two layers' slots on the device."""
    c, st, acc, b, exact = s.config, state.sizes, s.acc, s.b, s.exact
    if not c.offload_state:
        return OffloadPlan(figures=None, state_gpu=state.rank, state_host=0, state_grad_gpu=state.grad,
                           assumptions=())
    T = replay.T
    figures = offload_plan(s.arch, b=b, acc=acc, exact=exact, prompt=s.P, chunk=c.chunk_size, world=s.W,
                           block=s.block, group=s.G, pieces=-(-s.R // T),
                           held_pieces=replay.held // T, score_passes=c.score_passes,
                           divided_capture=capture.divided, decode_steps=s.R if c.generate else 0)
    line = (f"offload: {figures['staged_layers']} layers' per-token rows (+ exact mode's gradient rows) in host "
            "memory; on the device two slots (one if one layer is staged) of the largest layer's rows (+ its "
            "gradient rows, after capture) and the constant "
            "state; every pass stages each layer it visits once (traffic and its time at "
            f"{c.host_bandwidth_gbs:g} GB/s host link; copies overlap compute, so the step takes at least the "
            "larger of the two)")
    grad_slots = figures["grad_slot_bytes"]  # exact mode's gradient sinks: with the state gradients, after capture
    return OffloadPlan(figures=figures, state_gpu=st["fixed"] + figures["slot_bytes"] - grad_slots,
                       state_host=figures["host_bytes"],
                       state_grad_gpu=(snapshot_grad_bytes(st, b, acc) + grad_slots) if exact else 0,
                       assumptions=(line,))
