"""Hybrid recurrent + attention families (Qwen3.5 / 3.6, Qwen3.5-MoE, Qwen3-Next)
against the stock HF models, float64.

Tolerances, and why:
* Stock HF computes its gated delta rule, RMSNorms and gated norms in float32 even in a
  float64 model, so against stock HF we can only agree to float32 precision: relative
  gradient error <= 1e-3 (measured ~1e-4 on these tiny models).
* `float64_throughout` runs those HF internals in float64 (same maths), and the GDN
  gate's `A_log.float()` too: with that cast left in float32, A_log's gradient is rounded
  to float32 once per backward call, and exact mode (one backward per chunk) and pieces
  (one per piece) agree with the per-branch reference to ~1e-7 only. With it, both modes
  agree to FLOAT64.
"""


import pytest
import torch

import longstraw as ls
from longstraw.state.prompt import AttentionKV, RecurrentState
from tests.reference import (
    FLOAT64,
    HYBRID_FAMILIES,
    compare_step,
    float64_hybrid,
    float64_throughout,
    hf_cached_logprobs,
    hf_full_logprobs,
    random_group,
    tiny_hybrid,
)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_detached_matches_hf_cached_continuation(family):
    model = tiny_hybrid(family)
    group = random_group(97, 20, [5, 1, 7], seed=1)
    with float64_hybrid(model):
        compare_step(model, group, ls.ExecConfig(chunk_size=6, attention_block_size=4), hf_cached_logprobs, 1e-9)
        scores = ls.Engine(model, ls.ExecConfig(chunk_size=7)).score(group)
        with torch.no_grad():
            for s, r in zip(scores, group.responses):
                torch.testing.assert_close(s, hf_cached_logprobs(model, group.prompt, r), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_exact_matches_full_sequence(family):
    model = tiny_hybrid(family)
    group = random_group(97, 18, [4, 6], seed=2)
    with float64_throughout(model):
        result = compare_step(model, group, ls.ExecConfig(chunk_size=5, mode="exact"), hf_full_logprobs, FLOAT64)
    assert result.metrics["state_grad_bytes"] > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_against_stock_hf_float32_internals(family):
    model = tiny_hybrid(family)
    group = random_group(97, 16, [4, 3], seed=3)
    compare_step(model, group, ls.ExecConfig(chunk_size=6), hf_cached_logprobs, 1e-3)
    compare_step(model, group, ls.ExecConfig(chunk_size=6, mode="exact"), hf_full_logprobs, 1e-3)


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("chunk,prompt_len,lens,piece", [
    (1, 9, [3, 2], None),      # chunk of 1 token
    (5, 19, [1, 4], None),     # a chunk that divides neither P nor the GDN kernel's internal chunk (64)
    (100, 12, [6, 2], 4),      # a chunk larger than P, and branch pieces
    (4, 3, [5, 1], 2),         # P = 3 < conv kernel 4: the conv tail is mostly padding
])
def test_edges(mode, chunk, prompt_len, lens, piece):
    model = tiny_hybrid("qwen3_5")
    group = random_group(97, prompt_len, lens, seed=4)
    reference = hf_cached_logprobs if mode == "detached" else hf_full_logprobs
    with float64_throughout(model):
        compare_step(model, group, ls.ExecConfig(chunk_size=chunk, mode=mode, branch_chunk_size=piece), reference,
                     FLOAT64)


def test_state_bytes_match_the_formula_and_state_is_read_only():
    model = tiny_hybrid("qwen3_5", dtype=torch.float32)
    cfg = model.config
    group = random_group(97, 40, [5, 3], seed=5)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=16))
    state = engine.capture(group.prompt)
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    n_gdn = cfg.num_hidden_layers - n_attn
    kv = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * (group.prompt.numel() - 1)
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32
    tail = conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4
    assert state.nbytes() == kv + n_gdn * (recurrent + tail)
    # the GDN part is constant in P
    longer = engine.capture(torch.cat([group.prompt, group.prompt]))
    gdn = lambda s: sum(l.nbytes() for l in s.layers if isinstance(l, RecurrentState))  # noqa: E731
    assert gdn(longer) == gdn(state) and all(isinstance(l, (AttentionKV, RecurrentState)) for l in state.layers)
    # replay only reads the state
    before = [tuple(t.clone() for t in l.snapshots[39]) for l in state.layers if isinstance(l, RecurrentState)]
    for r in group.responses:
        engine.replay_branch(state, group.prompt, r, lambda h, a, b: engine.logprobs(h, r[a:b], 1.0).sum())
    after = [l.snapshots[39] for l in state.layers if isinstance(l, RecurrentState)]
    assert all(torch.equal(x, y) for pair_a, pair_b in zip(before, after) for x, y in zip(pair_a, pair_b))


def test_lora_on_gdn_projections():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_hybrid("qwen3_5"), peft.LoraConfig(
        r=2, target_modules=["in_proj_qkv", "out_proj", "q_proj", "v_proj"], init_lora_weights=False)).eval()
    group = random_group(97, 12, [4, 3], seed=6)
    with float64_hybrid(model):
        compare_step(model, group, ls.ExecConfig(chunk_size=5), hf_cached_logprobs, 1e-9)
    assert all(("lora_" in n) == (p.grad is not None) for n, p in model.named_parameters())


def test_multimodal_qwen3_5_runs_its_text_model():
    """Qwen3_5ForConditionalGeneration (vision + text): text prompts run through its
    language model and score like HF's own full forward of the multimodal model."""
    import transformers

    from tests.reference import hf_full_logprobs

    text = tiny_hybrid("qwen3_5").config.to_dict()
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).double().eval()
    group = random_group(97, 12, [4, 3], seed=1)
    with float64_hybrid(model):
        got = ls.Engine(model, ls.ExecConfig(chunk_size=5)).score(group)
        want = [hf_full_logprobs(model, group.prompt, r).detach() for r in group.responses]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_backbone_without_decoder_layers_is_unsupported():
    model = tiny_hybrid("qwen3_5")
    model.model = torch.nn.Module()  # what a wrapper with another layout looks like
    model.model.embed_tokens = torch.nn.Embedding(97, 32)
    with pytest.raises(ls.UnsupportedModelError, match="no decoder .layers"):
        ls.Engine(model)
