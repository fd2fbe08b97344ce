"""Naive twins of the efficient ops: obvious, full-size, slow. Tests and benchmarks
compare against these; the engine never calls them."""

from __future__ import annotations

import torch


def naive_attention(q, k, v, q_pos, k_pos, scale, window=None, sinks=None):
    """Dense masked softmax attention with GQA expanded.

    Args:
        q: [H, T, D] at absolute positions q_pos [T].
        k, v: [Hkv, N, D] / [Hkv, N, Dv] at absolute positions k_pos [N].
        sinks: [H] logits of one extra column every query sees, with no value (gpt-oss's
            attention sinks, as HF's eager attention writes them), or None.
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
    if sinks is not None:
        column = sinks[:, None, None].to(scores.dtype).expand(-1, scores.shape[1], 1)  # (H, T, 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v
    return torch.softmax(scores, dim=-1) @ v


def naive_token_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    """log softmax(hidden @ weight^T / temperature)[targets], with full [T, vocab] logits
    (half-precision logits are cast to float32 before the division, as the sampler does).

    hidden [T, d], weight [V, d], targets [T] -> [T]."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]


def naive_gated_delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm=True):
    """Gated delta rule token by token, in the inputs' dtype.

    q, k [T, Hk, Dk] (value head h reads q/k head h // (Hv // Hk)), v [T, Hv, Dv],
    g, beta [T, Hv], initial_state [Hv, Dk, Dv] or None. q (and k) are L2-normalised
    with eps 1e-6 inside the sqrt when use_qk_l2norm, then q is scaled by Dk^-1/2.
    Returns (out [T, Hv, Dv], final_state [Hv, Dk, Dv]).
    """
    t, hv, dv = v.shape
    dk = k.shape[-1]
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / dk ** 0.5
    q = q.repeat_interleave(hv // q.shape[1], dim=1)
    k = k.repeat_interleave(hv // k.shape[1], dim=1)
    state = v.new_zeros(hv, dk, dv) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for i in range(t):
        state = state * torch.exp(g[i])[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[i], state)
        delta = (v[i] - predicted) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[i], state))
    out = torch.stack(outs) if outs else v.new_zeros(0, hv, dv)
    return out, state


def naive_causal_conv1d(x, weight, bias=None, tail=None, activation="silu"):
    """Depthwise causal conv by an explicit loop over output positions.

    x [C, T], weight [C, K], bias [C] or None, tail [C, K-1] or None (zeros).
    Returns (y [C, T], new_tail [C, K-1] = last K-1 columns of cat(tail, x)).
    """
    c, t = x.shape
    kw = weight.shape[1]
    if tail is None:
        tail = x.new_zeros(c, kw - 1)
    full = torch.cat([tail, x], dim=1)
    cols = []
    for i in range(t):
        col = (full[:, i:i + kw] * weight).sum(-1)
        cols.append(col if bias is None else col + bias)
    y = torch.stack(cols, dim=1) if cols else x.new_zeros(c, 0)
    if activation is not None:
        y = y * torch.sigmoid(y)
    return y, full[:, full.shape[1] - (kw - 1):]


def naive_indexer_scores(q_idx, weights, keys_all, key_positions, q_positions, scale):
    """Dense DSA index scores, HF's formula: sum_h weights[t,h] * relu(scale * q_idx[t,h] . key[n]).

    q_idx [T, Hi, Di], weights [T, Hi], keys_all [N, Di] at absolute positions key_positions [N],
    queries at q_positions [T]. Returns [T, N] with -inf where key_positions > q_positions (causal)."""
    scores = torch.relu(torch.einsum("thd,nd->thn", q_idx, keys_all) * scale)
    index = (weights[:, :, None] * scores).sum(1)
    return index.masked_fill(key_positions[None, :] > q_positions[:, None], float("-inf"))


def naive_indexer_topk(q_idx, weights, keys_all, key_positions, q_positions, topk, scale):
    """Top-k by Python sort on (-score, position) over the visible keys: best first, ties by lower
    position, rows padded with -1 when fewer than topk keys are visible. Returns LongTensor [T, topk]."""
    scores = naive_indexer_scores(q_idx, weights, keys_all, key_positions, q_positions, scale)
    rows = []
    for t in range(scores.shape[0]):
        cand = sorted((-float(scores[t, n]), int(key_positions[n])) for n in range(scores.shape[1])
                      if int(key_positions[n]) <= int(q_positions[t]))
        picked = [p for _, p in cand[:topk]]
        rows.append(picked + [-1] * (topk - len(picked)))
    return torch.tensor(rows, dtype=torch.long).reshape(scores.shape[0], topk)


def naive_sparse_attention(q, keys_all, values_all, positions_all, indices, q_positions, scale):
    """Dense masked softmax over all N keys, masked to the selected positions (MQA: one key/value head).

    q [H, T, D], keys_all [N, D], values_all [N, Dv] at absolute positions positions_all [N],
    indices [T, K] selected absolute positions (-1 = none), q_positions [T] (unused: the selection
    alone decides visibility). Returns [H, T, Dv]."""
    selected = (positions_all[None, None, :] == indices[:, :, None]).any(1)  # [T, N]
    scores = (q @ keys_all.T) * scale  # (H, T, N)
    scores = scores.masked_fill(~selected[None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ values_all


def naive_gated_delta_transition(q, k, v, g, beta, use_qk_l2norm=True):
    """The segment's affine map token by token: A = prod_t e^(g_t) (I - beta_t k_t k_t^T)
    (later tokens on the left), C = the end state from zero, and per token the read of the
    start state R_t = q_t^T A_t and the output from zero O_t.

    q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] -> (read [T, Hv, Dk], out0 [T, Hv, Dv],
    A [Hv, Dk, Dk], C [Hv, Dk, Dv]), as `ops.gated_delta_scan.gated_delta_transition`."""
    t, hv, dv = v.shape
    dk = k.shape[-1]
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = (q / dk ** 0.5).repeat_interleave(hv // q.shape[1], dim=1)
    k = k.repeat_interleave(hv // k.shape[1], dim=1)
    a = torch.eye(dk, dtype=v.dtype).repeat(hv, 1, 1)
    c = v.new_zeros(hv, dk, dv)
    reads, outs = [], []
    for i in range(t):
        step = torch.exp(g[i])[:, None, None] * (torch.eye(dk, dtype=v.dtype)
                                                 - beta[i][:, None, None] * k[i][:, :, None] * k[i][:, None, :])
        a = step @ a
        c = step @ c + beta[i][:, None, None] * k[i][:, :, None] * v[i][:, None, :]
        reads.append(torch.einsum("hk,hkj->hj", q[i], a))
        outs.append(torch.einsum("hk,hkv->hv", q[i], c))
    empty = v.new_zeros(0, hv, dk), v.new_zeros(0, hv, dv)
    read = torch.stack(reads) if reads else empty[0]
    out0 = torch.stack(outs) if outs else empty[1]
    return read, out0, a, c


def naive_select_candidates(scores, positions, topk: int):
    """`dsa.select_candidates` by sorting every candidate: [T, n] scores and positions (-1:
    empty) -> (positions [T, topk] -1 padded, scores [T, topk] -inf padded), best score
    first, ties to the lower position."""
    scores = torch.where(positions < 0, torch.full_like(scores, float("-inf")), scores)
    key = torch.where(positions < 0, torch.full_like(positions, torch.iinfo(torch.long).max), positions)
    by_pos = torch.sort(key, dim=-1, stable=True).indices
    scores, positions = scores.gather(-1, by_pos), positions.gather(-1, by_pos)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    out, kept = positions.gather(-1, order), scores.gather(-1, order)
    out = torch.where(torch.isinf(kept), torch.full_like(out, -1), out)
    pad = topk - out.shape[1]
    if pad > 0:
        out = torch.cat([out, out.new_full((out.shape[0], pad), -1)], dim=1)
        kept = torch.cat([kept, kept.new_full((kept.shape[0], pad), float("-inf"))], dim=1)
    return out, kept


def naive_ssd_scan(x, dt, a, b, c, initial_state=None):
    """Mamba2's SSD recurrence token by token, in the inputs' dtype:
    S_t = exp(dt_t A) S_(t-1) + dt_t x_t B_t^T, y_t = S_t C_t, per head.

    x [T, H, P], dt [T, H], a [H], b, c [T, G, N] (head h reads group h // (H // G)),
    initial_state [H, P, N] or None. Returns (y [T, H, P], final_state [H, P, N])."""
    t, h, p = x.shape
    b = b.repeat_interleave(h // b.shape[1], dim=1)
    c = c.repeat_interleave(h // c.shape[1], dim=1)
    state = x.new_zeros(h, p, b.shape[-1]) if initial_state is None else initial_state.to(x.dtype)
    outs = []
    for i in range(t):
        state = torch.exp(dt[i] * a)[:, None, None] * state + (dt[i][:, None] * x[i])[:, :, None] * b[i][:, None, :]
        outs.append(torch.einsum("hpn,hn->hp", state, c[i]))
    return (torch.stack(outs) if outs else x.new_zeros(0, h, p)), state


def naive_kda(q, k, v, g, beta, initial_state=None, use_qk_l2norm=True):
    """Kimi Delta Attention token by token, in the inputs' dtype (HF's recurrent form):
    S' = diag(e^g_t) S, u = beta (v - S'^T k), S = S' + k u^T, o = S^T q.

    q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H], initial_state [H, Dk, Dv] or None;
    q, k L2-normalised (eps 1e-6 inside the sqrt) when use_qk_l2norm, q scaled by Dk^-1/2.
    Returns (out [T, H, Dv], final_state [H, Dk, Dv])."""
    t, h, dv = v.shape
    dk = k.shape[-1]
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / dk ** 0.5
    state = v.new_zeros(h, dk, dv) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for i in range(t):
        state = state * torch.exp(g[i])[:, :, None]
        delta = (v[i] - torch.einsum("hk,hkv->hv", k[i], state)) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[i], state))
    return (torch.stack(outs) if outs else v.new_zeros(0, h, dv)), state
