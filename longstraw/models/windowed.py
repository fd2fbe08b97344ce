"""Families whose `layer_types` alternate sliding-window and full attention, with a
RoPE per layer type: OLMo 3 (`olmo3`), Gemma 3 (`gemma3_text`, and
`Gemma3ForConditionalGeneration` (`gemma3`) on text prompts) and gpt-oss (`gpt_oss`).

What each layer keeps is `DenseAdapter`'s: a sliding layer (its attention module's
`sliding_window` W) keeps the last W - 1 prompt positions once capture is done
(`AttentionKV` with a window; exact mode keeps them all for the reverse walk, which
masks by position), and a full layer keeps every position. Every phase masks a sliding
layer by position (HF's rule: a key is visible iff 0 <= q - k < W): capture's chunks,
replay, decode and the reverse walk (`ops/attention.py`, `ops/decode_attention.py`).

The model's own modules do the rest, in every phase:
* RoPE per layer type (Gemma 3's `rope_local_base_freq` as the sliding layers'
  `rope_parameters`, gpt-oss's YaRN) is computed by the backbone's rotary module per
  layer type, and each layer receives its own cos / sin;
* OLMo 3's post-norms (after attention and after the MLP) and its q/k norms over the
  whole projection, Gemma 3's q/k norms, pre- and post-norms and
  `query_pre_attn_scalar` (the softmax scale the module passes) are inside HF's layers;
* gpt-oss's attention sinks: the module passes its learned per-head logit `sinks`
  (`s_aux`), which joins the softmax denominator once (`attention.py`);
* gpt-oss's MoE (softmax over the top-k router logits, clamped SwiGLU experts) is the
  model's own block.

Refused, with the reason: a logit soft-cap (`final_logit_softcapping`: LongStraw calls
the lm_head itself), and Gemma 3's bidirectional attention (not a causal LM).
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .dense import DenseAdapter


class WindowedAdapter(DenseAdapter):
    """`DenseAdapter` plus the checks of the per-layer-window families."""

    model_types = ("olmo3", "gemma3_text", "gemma3", "gpt_oss")

    def check_config(self) -> None:
        super().check_config()
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            raise UnsupportedModelError(
                f"final_logit_softcapping={cap}: LongStraw computes log-probs from the lm_head itself and does not "
                "apply a logit soft-cap; set config.final_logit_softcapping = None (Gemma 3's published configs do)")
        if getattr(self.config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "use_bidirectional_attention=True makes the sliding layers attend to later tokens; LongStraw runs "
                "causal language models only (set it to False)")
