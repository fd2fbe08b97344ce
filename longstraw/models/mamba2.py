"""Mamba2 mixers (Nemotron-H, Bamba, Granite 4.0 hybrids) in every phase, context
parallelism included, on LongStraw's own state.

As for Gated DeltaNet (`gated_deltanet.py`): HF's mixer writes its cache in place, so
inside `routed_mamba2` each mixer's `forward` is replaced on the instance by
`mamba2_forward`, which calls the module's own `in_proj`, conv weight, `dt_bias`,
`A_log`, `D`, gated norm and `out_proj`, with our `causal_conv1d_with_tail` and
`chunk_ssd_scan` (`ops/ssd.py`), starting from the snapshot in a `RecurrentState`
(recurrent = the SSM state [H, P, N], conv tail [conv_dim, K-1]). The maths is HF's
`torch_forward`: in_proj -> [gate | xBC | dt]; causal conv + act on xBC -> [x | B | C];
dt = clamp(softplus(dt + dt_bias), time_step_limit); A = -exp(A_log); y = SSD + D x;
the module's gated RMSNorm (groups of intermediate / n_groups) of (y, gate); out_proj.

The phases are GDN's (`gated_deltanet.py`'s docstring): CAPTURE / REPLAY / RECOMPUTE
run consecutive positions from the snapshot at `start`; DECODE steps each branch's own
copy (`BranchRecurrent`); DIVIDED (context parallelism) conv tails from the previous
block's owner, each own segment's affine transition (a diagonal decay per head,
`ops/ssd.ssd_transition`), a relay of the state across ranks, snapshots summed from
their owners; a divided reverse walk gathers the chunk's projected rows and recomputes
the conv and the scan over the whole chunk on every rank, keeping its own rows.

One deliberate difference from HF: HF's single-token decode (`selective_state_update`)
skips the `time_step_limit` clamp its chunked forward applies; decoding here clamps
too, so a rollout is the model that `step` trains (the two agree whenever
softplus(dt + dt_bias) lies inside the limits, as with the default (0, inf)).

Shapes: T tokens (N: this rank's own), C = conv_dim, I = intermediate size (H * P), H
heads, P head dim, G groups, Ns d_state, K the conv kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.ops.causal_conv import causal_conv1d_step, causal_conv1d_with_tail
from longstraw.ops.gated_delta_scan import chain_states
from longstraw.ops.ssd import chunk_ssd_scan, diagonal_transition, finish_ssd_outputs, ssd_step, ssd_transition
from longstraw.parallel.collectives import GradOnFirstRank
from longstraw.state.branch import BranchRecurrent

from .gated_deltanet import block_tails, initial_snapshot, keep_snapshot, share_snapshots, tail_before
from .routing import AttentionCall, Divided, DividedChunk, current_call, forwards_replaced

SSD_CHUNK = 64
"""Tokens per chunk of the SSD scan (any size gives the same result up to rounding)."""


def _project(module, x):
    """(gate [T, I], xBC [T, C], dt [T, H]) from x [T, d]: the module's in_proj, with
    Falcon-H1's input multiplier and per-column mup vector when it has them."""
    if getattr(module, "ssm_in_multiplier", None) is not None:
        x = x * module.ssm_in_multiplier
    projected = module.in_proj(x)
    if getattr(module, "mup_vector", None) is not None:
        projected = projected * module.mup_vector.reshape(-1)
    return projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)


def _split(module, conv):
    """x [T, H, P], B, C [T, G, Ns] from the post-conv features conv [T, C]."""
    t = conv.shape[0]
    gn = module.n_groups * module.ssm_state_size
    x, b, c = conv.split([module.intermediate_size, gn, gn], dim=-1)
    return (x.reshape(t, module.num_heads, module.head_dim), b.reshape(t, module.n_groups, -1),
            c.reshape(t, module.n_groups, -1))


def _time_step(module, dt, dt_bias=None):
    """dt [T, H] -> clamp(softplus(dt + dt_bias), *time_step_limit), as HF's chunked path."""
    dt_bias = module.dt_bias if dt_bias is None else dt_bias
    low, high = module.time_step_limit
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    return dt if (low, high) == (0.0, float("inf")) else dt.clamp(min=low, max=high)


def _a(module, a_log=None):
    """The heads' A [H] = -exp(A_log), HF's float32 (float64 in float64 internals)."""
    return -torch.exp((module.A_log if a_log is None else a_log).float())


def _skip(module, y, x, d=None):
    """y + D x per head: y [T, H, P] (accumulation dtype), x [T, H, P]."""
    d = module.D if d is None else d
    return y + d[:, None] * x.to(y.dtype)


def _gated_output(module, y, gate, dtype):
    """The module's gated norm (or Falcon-H1's plain silu gate) and out_proj: y [T, H, P],
    gate [T, I] -> [T, d] in `dtype`."""
    y = y.reshape(y.shape[0], -1)[None]  # (1, T, I)
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate[None])
    else:
        y = y * F.silu(gate[None])
    return module.out_proj(y.to(dtype))[0]


def _conv(module, xbc, tail):
    """The short conv of xBC [T, C] after `tail` [C, K-1] -> (features [T, C], new tail)."""
    weight = module.conv1d.weight[:, 0, :]  # (C, K)
    conv, tail = causal_conv1d_with_tail(xbc.transpose(0, 1), weight, module.conv1d.bias, tail,
                                         activation=module.activation)
    return conv.transpose(0, 1), tail


def mamba2_forward(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Drop-in for a Mamba2 mixer's forward: hidden_states [1, T, d] -> [1, T, d]
    (phase DECODE: [G, 1, d] -> [G, 1, d])."""
    call = current_call()
    run = call.route(chunk=_chunk, decode=_decode, divided=divided_mamba2, divided_walk=divided_recompute_mamba2)
    return run(module, hidden_states, call)


def _chunk(module, hidden_states, call: AttentionCall):
    """Phases CAPTURE, REPLAY, RECOMPUTE: [1, T, d] at positions start.. -> [1, T, d]."""
    x = hidden_states[0]  # (T, d)
    gate, xbc, dt = _project(module, x)
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, call.start, x.device)
    conv, tail1 = _conv(module, xbc, tail0)
    xs, b, c = _split(module, conv)
    y, rec1 = chunk_ssd_scan(xs, _time_step(module, dt), _a(module), b, c, rec0, chunk_size=SSD_CHUNK)
    out = _gated_output(module, _skip(module, y, xs), gate, x.dtype)

    keep_snapshot(call, module.layer_idx, call.start + x.shape[0], rec1, tail1)
    return out[None]


def _decode(module, hidden_states, call: AttentionCall):
    """Phase DECODE, one token per branch: [G, 1, d] -> [G, 1, d], stepping the branches'
    own SSM states and conv tails."""
    own: BranchRecurrent = call.branches.layers[module.layer_idx]
    x = hidden_states[:, 0]  # (G, d): the projections are per token
    gate, xbc, dt = _project(module, x)
    state, tail = own.state(call.rows)
    conv, tail = causal_conv1d_step(xbc, module.conv1d.weight[:, 0, :], module.conv1d.bias, tail,
                                    activation=module.activation)  # (G, C)
    xs, b, c = _split(module, conv)
    y, state = ssd_step(xs, _time_step(module, dt), _a(module), b, c, state)  # (G, H, P)
    own.update(state, tail, call.rows)
    return _gated_output(module, _skip(module, y, xs), gate, x.dtype)[:, None]


# ----------------------------------------------------------------------------
# context parallelism


def divided_mamba2(module, hidden_states, call: AttentionCall):
    """Phase DIVIDED: [1, N, d] of this rank's positions -> [1, N, d] (module docstring)."""
    d: Divided = call.divided
    x = hidden_states[0]  # (N, d)
    gate, xbc, dt_raw = _project(module, x)
    width = module.conv1d.weight.shape[-1] - 1
    table = block_tails(xbc, d, width)
    a = _a(module)
    segments = d.segments()
    parts, transitions, links, ends = [], [], [], {}
    for s, e in segments:
        r0, r1 = d.local_row(s), d.local_row(s) + (e - s)
        conv, ends[e] = _conv(module, xbc[r0:r1], tail_before(s, xbc, table, d, width))
        xs, b, c = _split(module, conv)
        read, out0, decay, end0 = ssd_transition(xs, _time_step(module, dt_raw[r0:r1]), a, b, c,
                                                 chunk_size=SSD_CHUNK)
        parts.append((read, out0, xs))
        transitions.append(diagonal_transition(decay, end0))
        links.append((-1 if s == 0 else d.owner(s - 1), d.owner(e) if e < d.total and d.owner(e) != d.rank else None))
    shape = (module.num_heads, module.head_dim, module.ssm_state_size)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    chained = chain_states(transitions, links, d.cp, shape, acc, x.device)
    ys = [_skip(module, finish_ssd_outputs(read, out0, start), xs) for (read, out0, xs), (start, _) in zip(parts, chained)]
    y = torch.cat(ys) if ys else x.new_zeros(0, module.num_heads, module.head_dim, dtype=acc)
    share_snapshots(call.states[-1].layers[module.layer_idx], d, {e: end for (_, e), (_, end) in zip(segments, chained)},
                    ends, shape, acc, xbc.new_zeros(xbc.shape[1], width))
    return _gated_output(module, y, gate, x.dtype)[None]


def divided_recompute_mamba2(module, hidden_states, call: AttentionCall):
    """A divided reverse walk's Mamba2 layer (exact mode): [1, n, d] of this rank's n
    positions of the chunk -> [1, n, d]. As `gated_deltanet.divided_recompute_gdn`: the
    projections, the gated norm and out_proj run on this rank's rows; the conv and the
    scan run over the whole chunk on every rank (gathered projected rows), and this rank
    keeps its rows. The replicated part's parameters (conv, dt_bias, A_log, D) pass their
    gradient on the first rank only. dt and A are computed per capture chunk, as the
    replicated walk computes them (HF rounds A_log through float32 once per call)."""
    d: DividedChunk = call.divided
    x = hidden_states[0]  # (n, d)
    gate, xbc, dt_raw = _project(module, x)
    full_xbc, full_dt = d.gather(torch.cat([xbc, dt_raw], 1)).split([xbc.shape[1], dt_raw.shape[1]], 1)
    weight, bias, dt_bias, a_log, skip = (None if p is None else GradOnFirstRank.apply(p, d.cp) for p in (
        module.conv1d.weight, module.conv1d.bias, module.dt_bias, module.A_log, module.D))
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, d.start, x.device)
    conv, tail1 = causal_conv1d_with_tail(full_xbc.transpose(0, 1), weight[:, 0, :], bias, tail0,
                                          activation=module.activation)
    xs, b, c = _split(module, conv.transpose(0, 1))
    assert d.start % d.chunk_size == 0, "a hybrid's walk chunk starts at a capture chunk"
    ys, state = [], rec0
    for i in range(0, xs.shape[0], d.chunk_size):  # per capture chunk, as the replicated walk
        j = slice(i, i + d.chunk_size)
        y, state = chunk_ssd_scan(xs[j], _time_step(module, full_dt[j], dt_bias), _a(module, a_log), b[j], c[j],
                                  state, chunk_size=SSD_CHUNK)
        ys.append(_skip(module, y, xs[j], skip))
    y = d.own_rows(torch.cat(ys), rows_dim=0)  # (n, H, P)
    keep_snapshot(call, module.layer_idx, d.end, state, tail1)
    return _gated_output(module, y, gate, x.dtype)[None]


def routed_mamba2(modules):
    """Within the block, each Mamba2 mixer in `modules` runs `mamba2_forward`."""
    return forwards_replaced(modules, [mamba2_forward.__get__(m) for m in modules])
