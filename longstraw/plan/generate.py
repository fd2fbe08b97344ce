"""The planner's rollout phase (`PlanConfig.generate`): `Engine.generate` decoding the G
branches together from the captured prompt state, one token per step. Torch-free.

What the engine holds while it decodes (`engine/episode.run_episodes`,
`engine/rollout.sample_tokens`), beside the prompt state and the weights:

    branch state   each branch's own tokens' state, allocated once for R + 1 positions
                   (`state/branch.py`): K/V of every attention layer (sliding-window
                   ones too: the branch keeps all its rows), MLA latent rows and indexer
                   keys, and one copy of each GDN layer's recurrent state + conv tail;
                   G x [(R + 1) x per-token state + recurrent state]; not sharded under
                   context parallelism (every rank decodes every branch)
    logits         the G branches' next-token logits [G, V] in the compute dtype, held
                   through the loop
    sampling       of the live rows: their logits [G, V] (b), the scaled scores (acc),
                   top-p's sorted scores (acc) and order (int64), the softmax, its
                   cumulative sum and their difference (acc each), the drop mask (bool):
                   G x V x (b + 5 acc + 9); the worst case (a temperature, top-p)
    decode step    one layer's no-grad moment for G tokens over the prompt and the
                   branch's own rows (`working.nograd_layer_bytes`), a GDN layer's stepped
                   decayed state, its write (the outer product) and the new state (3 x G x the
                   layer's state, acc: `ops/gated_delta.gated_delta_step`'s torch form; a DSA
                   layer's top-k latent rows gathered once, `_shared_value_rows`), then
                   lm_head's [G, V] output

The phase's working set is the branch state + the held logits + the larger of sampling
and a decode step. Measured on tiny qwen3, qwen3_5 and glm_moe_dsa (`tests/test_plan_generate.py`:
`LiveBytes` over the engine's "generate" phase hook).

Kept capture graphs and attention outputs are still planned when set: a step that
reuses generate's state (`step(state=rollout.state)`: `longstraw train`, the TRL trainer
with kept states) has neither, since generate's capture keeps none, but one that captures
again (the TRL trainer without kept states) does. The search does not offer them with
`generate` (`plan/fit.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Basis
from .state_sizes import state_sizes
from .arch import SPARSE_QUERY_BLOCK
from .working import nograd_layer_bytes


@dataclass(frozen=True)
class GeneratePlan:
    """The rollout's memory per rank, bytes (see the module docstring).

    Fields:
        branch_state: the G branches' own state for R + 1 positions each.
        logits: the held next-token logits [G, V].
        sampling: the sampling temporaries of [G, V].
        decode: one decode step's largest layer moment and lm_head's output.
        working: branch_state + logits + the larger of sampling and decode.
    """

    branch_state: float
    logits: float
    sampling: float
    decode: float
    working: float


def plan_generate(s: Basis) -> GeneratePlan | None:
    """The generate phase of `s`, or None when the step does not generate."""
    c, a, G, b, acc = s.config, s.arch, s.G, s.b, s.acc
    if not c.generate:
        return None
    own = state_sizes(a, b, s.rb, s.R + 1, keep_windows=True)
    branch = G * ((s.R + 1) * own["per_token"] + own["recurrent_fixed"] + own["conv_tail_fixed"])
    logits = G * a.vocab * b
    sampling = G * a.vocab * (b + 5 * acc + 9)
    keys = s.p_rank + s.R + 1
    fused = c.self_attention != "dense"
    recurrent = a.gdn_v_heads * a.gdn_k_dim * a.gdn_v_dim * max(acc, s.rb) if a.count(mixer="gdn") else 0
    layer = max(nograd_layer_bytes(a, l, G, keys, c.attention_block_size, acc, b, c.gdn_kernel, fused=fused)
                + (3 * G * recurrent if l.mixer == "gdn" else 0) - _shared_value_rows(a, l, G, keys, acc)
                for l in a.layers)
    decode = layer + G * a.vocab * b
    return GeneratePlan(branch_state=branch, logits=logits, sampling=sampling, decode=decode,
                        working=branch + logits + max(sampling, decode))


def _shared_value_rows(a, layer, G: int, keys: int, acc: int) -> float:
    """What a DSA layer's decode holds less than `nograd_layer_bytes` plans for G queries:
    that plans the gathered top-k rows of a block of queries as a key and a value block
    ([qb, K, 2 kv_lora_rank + rope], `working.attention_working`); decode gathers all G
    branches' rows once and reads the value as a view of them
    (`ops/decode_attention.gathered_partial`: [G, K, kv_lora_rank + rope]). Found on tiny
    glm_moe_dsa (P = 256, G = 8): 655 KB of gathered rows alive at the decode peak, 1.18 MB
    planned before. Negative where G exceeds the query block."""
    if layer.mixer != "mla" or not layer.sparse:
        return 0.0
    K, kl, r = min(a.index_topk, keys + G), a.kv_lora_rank, a.rope_dim
    return (min(G, SPARSE_QUERY_BLOCK) * (2 * kl + r) - G * (kl + r)) * K * acc


def generate_report(g: GeneratePlan | None) -> dict:
    """The report's generate figures, bytes per rank (zeros without generate)."""
    if g is None:
        return {"generate_working_bytes": 0, "generate_branch_state_bytes": 0}
    return {"generate_working_bytes": int(g.working), "generate_branch_state_bytes": int(g.branch_state)}
