"""Tiny built-in models for the demo, benchmarks and docs: stock Hugging Face
classes with random weights, built from configs in code (nothing is downloaded).

`tiny_model("qwen3")` is a Qwen3-shaped dense model: 4 layers, hidden 256, 4 query
heads over 2 KV heads of dim 32 (GQA), vocab 4096, 128K positions.

`tiny_model("qwen3_5")` (the default) is shaped like the paper's Qwen3.6-27B, scaled
down: 4 layers in its 3 Gated DeltaNet : 1 full attention pattern, hidden 256; the
attention layer has an output gate, 4 query heads over 2 KV heads of dim 64; the GDN
layers have 2 QK heads and 6 V heads of dim 32 (Qwen3.6: 16 and 48 of dim 128), conv
kernel 4; vocab 4096, 256K positions.

`tiny_model("glm_moe_dsa")` is shaped like GLM-5.x, scaled down: 4 layers (the first
dense, then MoE with 8 experts, 2 per token, 1 shared), MLA with kv_lora_rank 64, rope
16, nope 32, value 32, q_lora_rank 96, 4 heads; DSA indexer with 8 heads of dim 32 and
top-k 256, run in layers 0 and 2 and shared by layers 1 and 3; vocab 4096.

`tiny_model("nemotron_h")` is shaped like Nemotron-H-56B, scaled down: 8 blocks (3 Mamba2,
1 attention, 4 relu2 MLP), hidden 256; Mamba2 with 16 heads of dim 32, d_state 64, 2
groups, conv 4; attention 4 query heads over 2 KV heads of dim 64; vocab 4096.

`tiny_model("kimi_linear")` is shaped like Kimi-Linear-48B-A3B, scaled down: 3 KDA layers
(4 heads of dim 64, short conv 4) then 1 NoPE MLA layer (4 heads, kv_lora_rank 64, rope
16, nope 32, value 32); the first MLP dense, then MoE with 8 experts, 2 per token, 1
shared; vocab 4096.

`tiny_vlm()` is `tiny_model("qwen3_5")`'s text model inside a stock
`Qwen3_5ForConditionalGeneration`, with a 2-block vision tower (hidden 64, 4 heads,
patches 16 x 16 over 2 frames, 2 x 2 spatial merge: a 512 x 512 screenshot is a
(1, 32, 32) grid, 256 image tokens) and its merger; image / video / vision start / end
ids 4090-4093 (`TINY_VLM_TOKENS`). Its processor (built offline), screenshots and ready
prompt inputs are in `longstraw.tiny_vision`.
"""

from __future__ import annotations

import torch
import transformers

DEFAULT_FAMILY = "qwen3_5"

TINY_CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5_text", vocab_size=4096, hidden_size=256, intermediate_size=768,
                    num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=False,
                    attention_dropout=0.0),
    "glm_moe_dsa": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                        q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        index_head_dim=32, index_n_heads=8, index_topk=256,
                        indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=131072,
                        tie_word_embeddings=False, attention_dropout=0.0),
    "nemotron_h": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, mlp_hidden_act="relu2",
                       num_hidden_layers=8,
                       layers_block_type=["mamba", "mlp", "mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=16,
                       mamba_head_dim=32, ssm_state_size=64, n_groups=2, conv_kernel=4, expand=2, chunk_size=128,
                       use_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=262144,
                       tie_word_embeddings=False, attention_dropout=0.0),
    "kimi_linear": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                        layer_types=["linear_attention"] * 3 + ["full_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4,
                        linear_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False, attention_dropout=0.0),
    "qwen3": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=131072,
                  tie_word_embeddings=False, attention_dropout=0.0),
}


TINY_VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=256, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=256)
TINY_VLM_TOKENS = dict(image_token_id=4090, video_token_id=4091, vision_start_token_id=4092, vision_end_token_id=4093)


def tiny_vlm(*, dtype: torch.dtype = torch.float32, seed: int = 0, text: dict | None = None, **vision):
    """A stock HF `Qwen3_5ForConditionalGeneration` (`tiny_model("qwen3_5")`'s text model,
    `TINY_VISION`'s tower) with random weights, in eval mode. `text` / `vision`: overrides
    of the text / vision config fields (the tower's `out_hidden_size` must stay the text
    model's `hidden_size`)."""
    text = {**{k: v for k, v in TINY_CONFIGS["qwen3_5"].items() if k != "model_type"}, **(text or {})}
    config = transformers.Qwen3_5Config(text_config=text, vision_config={**TINY_VISION, **vision}, **TINY_VLM_TOKENS)
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForConditionalGeneration(config).to(dtype).eval()


def tiny_model(family: str = DEFAULT_FAMILY, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A stock HF causal LM of `family` with random weights, in eval mode."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny preset for {family!r}; have {sorted(TINY_CONFIGS)}")
    fields = {**TINY_CONFIGS[family], **overrides}
    config = transformers.AutoConfig.for_model(fields.pop("model_type", family), **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()
