"""Route a Hugging Face Gated DeltaNet layer (Qwen3.5 / Qwen3.6, Qwen3-Next) through
LongStraw's own state.

HF's GDN forward reads and writes its cache with in-place `copy_`, which breaks
autograd in branch replay, so we never hand it a cache. Instead, inside `routed_gdn`,
each GDN module's `forward` is replaced (on the instance, for the duration only) by
`gdn_forward`, which calls the module's own projections, conv weight, gates, gated
norm and output projection, and our `causal_conv1d_with_tail` and
`chunk_gated_delta_rule`, starting from the snapshot in LongStraw's `RecurrentState`.

Per phase (see `attention_hook.py`):
    capture    start from the snapshot at `start`, record the snapshot at the end
    replay     start from the snapshot at `start`, record nothing
    recompute  start from the snapshot as a leaf that requires grad when its owner
               tracks gradients (a hook adds dL/dsnapshot into the owner); seed the
               end state with the gradient accumulated for it, if any
    decode     one token for each of G branches: step each branch's own copy of the
               state (`BranchRecurrent`) with the recurrent form of the rule
    divided    context parallelism's divided capture (`divided.py`); a divided reverse
               walk's recompute also goes there (`divided_recompute_gdn`)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.state.branch import BranchRecurrent
from ..ops.causal_conv import causal_conv1d_step, causal_conv1d_with_tail
from ..ops.gated_delta import chunk_gated_delta_rule, gated_delta_step
from longstraw.state.prompt import RecurrentState
from .attention_hook import current_call
from .base import forwards_replaced
from .divided import divided_gdn, divided_recompute_gdn


def initial_snapshot(states, layer_idx: int, position: int):
    """(recurrent, conv_tail) at `position`, found in the stacked states (latest first).
    Where the owner tracks gradients and grad is on, they are fresh leaves whose
    gradient is added into the owner's `grads[position]`."""
    for state in reversed(states):
        layer: RecurrentState = state.layers[layer_idx]
        if position in layer.snapshots:
            pair = layer.snapshots[position]
            if layer.grads is None or not torch.is_grad_enabled():
                return pair
            out = []
            for which, t in enumerate(pair):
                if t is None:
                    out.append(None)
                    continue
                leaf = t.detach().requires_grad_()
                leaf.register_hook(lambda g, layer=layer, which=which: layer.add_grad(position, which, g))
                out.append(leaf)
            return tuple(out)
    raise AssertionError(f"layer {layer_idx}: no recurrent snapshot at position {position}")


def _project(module, x):
    """(mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) from x [T, d],
    with each family's own projection layout."""
    t = x.shape[0]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: grouped per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None]))
        mixed = torch.cat([y.reshape(1, t, -1) for y in (q, k, v)], dim=-1)[0]
        return mixed, z[0], b[0], a[0]
    mixed = module.in_proj_qkv(x)  # Qwen3.5 / 3.6: flat [q | k | v]
    z = module.in_proj_z(x).reshape(t, -1, module.head_v_dim)
    return mixed, z, module.in_proj_b(x), module.in_proj_a(x)


def _split_heads(module, conv):
    """q, k [N, Hk, Dk] and v [N, Hv, Dv] from the post-conv features conv [N, conv_dim]."""
    n = conv.shape[0]
    q, k, v = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.reshape(n, -1, module.head_k_dim), k.reshape(n, -1, module.head_k_dim),
            v.reshape(n, -1, module.head_v_dim))


def _log_decay(module, a, params=None):
    """The rule's log decay g [N, Hv] (<= 0) from the `a` projection, as HF computes it
    (`params`: (A_log, dt_bias) to use instead of the module's own)."""
    a_log, dt_bias = (module.A_log, module.dt_bias) if params is None else params
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def _gated_output(module, out, z, shape):
    """The module's gated norm and output projection: out, z [N, Hv, Dv] -> [*shape, d]."""
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(*shape, -1))


def gdn_forward(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Drop-in for a GDN module's forward: hidden_states [1, T, d] -> [1, T, d]
    (phase "decode": [G, 1, d] -> [G, 1, d])."""
    call = current_call()
    if call.phase == "decode":
        return _gdn_decode(module, hidden_states, call.branches.layers[module.layer_idx])
    helpers = (_project, _split_heads, _log_decay, _gated_output)
    if call.phase == "divided":  # context parallelism: this rank's own positions (`divided.py`)
        return divided_gdn(module, hidden_states[0], call, helpers)
    if call.phase == "recompute" and call.divided is not None:  # a divided reverse walk (`divided.py`)
        return divided_recompute_gdn(module, hidden_states[0], call, helpers, initial_snapshot)
    x = hidden_states[0]  # (T, d)
    t = x.shape[0]
    mixed, z, b, a = _project(module, x)
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, call.start)
    weight = module.conv1d.weight[:, 0, :]  # (conv_dim, K)
    conv, tail1 = causal_conv1d_with_tail(mixed.transpose(0, 1), weight, module.conv1d.bias, tail0,
                                          activation=module.activation)  # (conv_dim, T)
    q, k, v = _split_heads(module, conv.transpose(0, 1))
    out, rec1 = chunk_gated_delta_rule(q, k, v, _log_decay(module, a), b.sigmoid(), rec0,
                                       use_qk_l2norm=True)  # (T, Hv, Dv)
    out = _gated_output(module, out, z, (1, t))

    end = call.start + t
    layer: RecurrentState = call.states[-1].layers[module.layer_idx]
    if call.phase == "capture":
        layer.put(end, rec1, tail1)
    if call.records_roots() and layer.grads is not None:  # seeded by what later readers of the snapshot added
        call.states[-1].seeds.append(((rec1, tail1), lambda: tuple(layer.grads.get(end, (None, None)))))
    return out


def _gdn_decode(module, hidden_states, own: BranchRecurrent):
    """One token per branch: hidden_states [G, 1, d] -> [G, 1, d], stepping `own` (the
    branches' recurrent states and conv tails). The projections see the G tokens as a
    sequence of G (they are per-token); the conv and the rule are per branch."""
    x = hidden_states[:, 0]  # (G, d)
    b = x.shape[0]
    mixed, z, beta_logit, a = _project(module, x)  # (G, conv_dim), (G, Hv, Dv), (G, Hv), (G, Hv)
    conv, tail = causal_conv1d_step(mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias, own.conv_tail,
                                    activation=module.activation)  # (G, conv_dim)
    q, k, v = _split_heads(module, conv)
    out, recurrent = gated_delta_step(q, k, v, _log_decay(module, a), beta_logit.sigmoid(), own.recurrent,
                                      use_qk_l2norm=True)  # (G, Hv, Dv)
    own.update(recurrent, tail)
    return _gated_output(module, out, z, (b, 1))


def routed_gdn(modules):
    """Within the block, each GDN module in `modules` runs `gdn_forward`."""
    return forwards_replaced(modules, [gdn_forward.__get__(m) for m in modules])
