"""The planner's FSDP2 backward buffers (`--shard-params`, `plan/peak.py`
`fsdp2_backward_phases`), by hand on a small dense config: two gradient-sized buffers of a
decoder layer (its unsharded gradients, the last reduce-scatter input) in replay's and the
walk's backward, beside the two gathered layers; at the logits no layer gathered and no
buffer. The live check is `tests/parallel/test_fit_config_fsdp.py` (-m slow). No model is built."""

from dataclasses import replace

import pytest

from longstraw.plan import PlanConfig, estimate

# 2 layers, H = 64, MLP 128, 4 heads of 16 (2 KV heads), vocab 1,000
SMALL = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "intermediate_size": 128,
         "tie_word_embeddings": False, "max_position_embeddings": 65536, "torch_dtype": "float32"}
LAYER = (64 * 64 + 64 * 32 * 2 + 64 * 64) + 3 * 64 * 128 + 2 * 64 + 2 * 16  # q/k/v/o, MLP, norms, q/k norms


def plan(model=None, **kw):
    kw = {"prompt_tokens": 4096, "group": 4, "response_tokens": 256, "gpus": 2, "dtype": "float32", **kw}
    return estimate(dict(model or SMALL), PlanConfig(**kw))


WIDE_VOCAB = {**SMALL, "vocab_size": 100_000}
"""the logits moment binds replay (its logits 100x a layer's gradients)"""


def _phases(r: dict) -> dict:
    return {k: v - r["static_bytes_per_rank"] for k, v in r["breakdown"]["phase_peak_bytes"].items()}


@pytest.mark.parametrize("model", [SMALL, WIDE_VOCAB], ids=["layers bind", "logits bind"])
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_backward_phases_hold_two_layers_gradients_more_under_fsdp2(mode, model, monkeypatch):
    import importlib

    estimate_mod = importlib.import_module("longstraw.plan.estimate")
    from longstraw.plan.config import resolve
    from longstraw.plan.memory import plan_replay, plan_state

    sharded = plan(model, shard_params=True, mode=mode)
    g, w = sharded["gathered_grad_bytes"], sharded["gathered_param_bytes"]
    assert w == 2 * LAYER * 4
    assert g == 2 * LAYER * 4  # full training: a layer's gradients are its weights' size
    assert plan(model, mode=mode)["gathered_grad_bytes"] == 0
    weights = estimate_mod.plan_weights
    monkeypatch.setattr(estimate_mod, "plan_weights", lambda s: replace(weights(s), gathered_grads=0.0))
    without = _phases(plan(model, shard_params=True, mode=mode))  # the same plan, FSDP2's gradient buffers left out
    monkeypatch.undo()
    s = resolve(dict(model), PlanConfig(prompt_tokens=4096, group=4, response_tokens=256, gpus=2, dtype="float32",
                                        shard_params=True, mode=mode))
    replay = plan_replay(s, plan_state(s))
    kept = without["replay"] - replay.working  # kept capture graphs (none under FSDP2)
    # a layer's backward moment carries both buffers; the logits moment neither, nor a gathered layer
    assert _phases(sharded)["replay"] == pytest.approx(kept + max(replay.layers_working + g,
                                                                  replay.working - w))
    logits_bind = replay.working - w > replay.layers_working + g
    assert logits_bind == (model is WIDE_VOCAB)
    if logits_bind:  # no gathered layer, no gradient buffer
        assert _phases(sharded)["replay"] == pytest.approx(without["replay"] - w)
    if mode == "exact":  # the walk's backward: every layer's, both buffers
        assert _phases(sharded)["recompute"] == pytest.approx(without["recompute"] + g)
    for phase in ("capture", "generate", "score"):  # no backward: the two gathered layers only (static)
        assert _phases(sharded).get(phase) == without.get(phase)


def test_lora_counts_only_the_adapters_gradients():
    lora = plan(shard_params=True, lora_rank=8)
    full = plan(shard_params=True)
    assert 0 < lora["gathered_grad_bytes"] < full["gathered_grad_bytes"] / 10
    assert lora["gathered_param_bytes"] == full["gathered_param_bytes"]
