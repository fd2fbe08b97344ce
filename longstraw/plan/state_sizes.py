"""The prompt state's bytes by kind (K/V, MLA latent, indexer keys, windows, recurrent
state, conv tails): the per-token and constant terms every state plan starts from. Torch-free."""

from __future__ import annotations

from .arch import Arch


def state_sizes(arch: Arch, b: int, rb: int, prompt: int, layers=None, keep_windows: bool = False) -> dict:
    """Per-token and constant state bytes by kind, over `layers` (default: all).
    b: state dtype bytes; rb: recurrent state bytes. keep_windows: sliding-window layers
    keep every position (exact mode: the reverse walk recomputes every chunk)."""
    s = {"attention_kv_per_token": 0, "mla_latent_per_token": 0, "indexer_keys_per_token": 0,
         "window_kv_fixed": 0, "recurrent_fixed": 0, "conv_tail_fixed": 0}
    kv = arch.kv_heads * 2 * arch.head_dim * b  # K and V per position
    for layer in arch.layers if layers is None else layers:
        if layer.mixer == "attention":
            if layer.window is None or keep_windows:
                s["attention_kv_per_token"] += kv
            else:
                s["window_kv_fixed"] += min(layer.window - 1, prompt) * kv
        elif layer.mixer == "gdn":
            s["recurrent_fixed"] += arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * rb
            s["conv_tail_fixed"] += arch.conv_dim * (arch.gdn_kernel - 1) * b
        else:
            s["mla_latent_per_token"] += (arch.kv_lora_rank + arch.rope_dim) * b
            s["indexer_keys_per_token"] += arch.index_dim * b if layer.indexer else 0
    s["per_token"] = s["attention_kv_per_token"] + s["mla_latent_per_token"] + s["indexer_keys_per_token"]
    s["fixed"] = s["window_kv_fixed"] + s["recurrent_fixed"] + s["conv_tail_fixed"]
    return s
