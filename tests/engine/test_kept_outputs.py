"""Exact mode with kept attention outputs (`ExecConfig.keep_attention_outputs`): capture
keeps each attention layer's output and LSE, and the reverse walk runs attention's
backward from them (`ops/flash.KeptAttention`) without attending over the prompt again.
The loss and every gradient equal one HF forward/backward per full sequence (float64),
and the walk that recomputes attention (the naive twin); the walk's attention forwards
are all kept ones."""

import contextlib

import pytest
import torch

import longstraw as ls
import longstraw.ops.attention as attention
import longstraw.ops.flash as flash
from longstraw.errors import ConfigError
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    float64_hybrid,
    float64_norms,
    grads_of,
    hf_full_logprobs,
    random_group,
    reference_grpo_loss,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)


@contextlib.contextmanager
def counted(monkeypatch):
    """Counts of FlashAttention forwards (attention computed with autograd) and of
    KeptAttention forwards (the kept output returned) while the block runs."""
    counts = {"flash": 0, "kept": 0, "kept_blockwise": 0}
    fwd, kept_fwd = flash.FlashAttention.forward, flash.KeptAttention.forward
    blockwise_fwd = attention.KeptPrefixAttention.forward

    def flash_forward(ctx, *a):
        counts["flash"] += 1
        return fwd(ctx, *a)

    def kept_forward(ctx, *a):
        counts["kept"] += 1
        return kept_fwd(ctx, *a)

    def blockwise_forward(ctx, *a):
        counts["kept_blockwise"] += 1
        return blockwise_fwd(ctx, *a)

    monkeypatch.setattr(attention.KeptPrefixAttention, "forward", staticmethod(blockwise_forward))
    monkeypatch.setattr(flash.FlashAttention, "forward", staticmethod(flash_forward))
    monkeypatch.setattr(flash.KeptAttention, "forward", staticmethod(kept_forward))
    yield counts


def _step(model, group, monkeypatch, **exec_kwargs):
    """(result, grads, forward counts) of one exact step."""
    model.zero_grad(set_to_none=True)
    with counted(monkeypatch) as counts:
        result = ls.Engine(model, ls.ExecConfig(mode="exact", **exec_kwargs)).step(group, ls.GRPOConfig())
    return result, grads_of(model), dict(counts)


def _full_sequence_reference(model, group):
    model.zero_grad(set_to_none=True)
    logps = [hf_full_logprobs(model, group.prompt, r) for r in group.responses]
    loss = reference_grpo_loss(logps, group)
    loss.backward()
    return float(loss.detach()), grads_of(model)


@pytest.mark.parametrize("recompute_layers", [False, True])
def test_kept_outputs_give_the_full_sequence_gradient_without_a_second_attention(recompute_layers, monkeypatch):
    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 21, [5, 1, 8], seed=11)  # prompt[:-1] = 20 tokens: chunks at 0, 6, 12, 18
    kw = dict(chunk_size=6, attention_block_size=4, recompute_layers=recompute_layers)
    base, want_engine, plain = _step(model, group, monkeypatch, keep_attention_outputs=False, **kw)
    result, got, kept = _step(model, group, monkeypatch, keep_attention_outputs=True, **kw)
    loss, want = _full_sequence_reference(model, group)
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)
    assert_grads_close(got, want_engine, 1e-12)  # the naive twin: the walk that attends again
    layers, chunks = model.config.num_hidden_layers, 4
    runs = 2 if recompute_layers else 1  # a checkpointed layer runs its forward again in backward
    assert plain["kept"] == 0 and kept["kept"] == layers * chunks * runs  # every walk attention: the kept output
    assert kept["flash"] == plain["flash"] - kept["kept"]  # the replay's attention only
    heads, dv = model.config.num_attention_heads, model.config.head_dim
    assert result.metrics["kept_attention_bytes"] == layers * 20 * heads * (dv + 1) * 8  # o and lse, float64
    assert base.metrics["kept_attention_bytes"] == 0


@pytest.mark.parametrize("family,overrides", [("qwen3", {}),
                                              ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1))])
def test_kept_outputs_through_the_blockwise_kernel(family, overrides, monkeypatch):
    """Without the fused kernels (CUDA's autograd path, sliding windows): the walk's attention
    is `KeptPrefixAttention` from the kept outputs, and the gradient is the full sequence's."""
    monkeypatch.setattr(flash, "FUSED_ENABLED", False)
    model = float64_norms(tiny_model(family, **overrides))
    group = random_group(97, 17, [3, 6], seed=13)  # prompt[:-1] = 16 tokens: chunks at 0, 4, 8, 12
    _, want_engine, plain = _step(model, group, monkeypatch, chunk_size=4, attention_block_size=3,
                                  keep_attention_outputs=False)
    result, got, kept = _step(model, group, monkeypatch, chunk_size=4, attention_block_size=3,
                              keep_attention_outputs=True)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-9)
    assert_grads_close(got, want_engine, 1e-12)
    assert kept["kept_blockwise"] == model.config.num_hidden_layers * 4 and plain["kept_blockwise"] == 0
    assert kept["kept"] == kept["flash"] == 0 and result.metrics["kept_attention_bytes"] > 0


@pytest.mark.parametrize("family,overrides", [("deepseek_v3", {}), pytest.param("glm_moe_dsa", dict(index_topk=64),
                                                                                  marks=pytest.mark.slow)])
def test_kept_outputs_of_dense_mla_layers(family, overrides, monkeypatch):
    """MLA over the latent (absorbed, so blockwise; GLM's DSA with a top-k above P, so every
    query selects all it sees): the walk's attention is the kept latent output's, and the
    gradient is the walk's that attends again (itself checked against HF: tests/models/test_mla.py)."""
    model = tiny_mla(family, **overrides)
    group = random_group(97, 17, [3, 6], seed=13)  # prompt[:-1] = 16 tokens: chunks at 0, 4, 8, 12
    _, want, plain = _step(model, group, monkeypatch, chunk_size=4, attention_block_size=3,
                           keep_attention_outputs=False)
    result, got, kept = _step(model, group, monkeypatch, chunk_size=4, attention_block_size=3,
                              keep_attention_outputs=True)
    assert_grads_close(got, want, 1e-10)
    assert kept["kept_blockwise"] == model.config.num_hidden_layers * 4 and plain["kept_blockwise"] == 0
    assert result.metrics["kept_attention_bytes"] > 0


@pytest.mark.slow
def test_kept_outputs_in_a_hybrid_model_keep_its_attention_layers(monkeypatch):
    model = tiny_hybrid("qwen3_5")  # GDN layers and one full-attention layer
    group = random_group(97, 18, [4, 7], seed=3)
    with float64_hybrid(model):
        _, want, plain = _step(model, group, monkeypatch, chunk_size=5, attention_block_size=4,
                               keep_attention_outputs=False)
        result, got, kept = _step(model, group, monkeypatch, chunk_size=5, attention_block_size=4,
                                  keep_attention_outputs=True)
    assert_grads_close(got, want, 1e-10)
    attention_layers = sum(t == "full_attention" for t in model.config.layer_types)
    assert kept["kept"] == attention_layers * 4 and plain["kept"] == 0  # 17 positions: chunks at 0, 5, 10, 15


def test_kept_outputs_with_kept_graphs_keep_only_the_recomputed_chunks(monkeypatch):
    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 21, [5, 3], seed=2)
    _, want, _ = _step(model, group, monkeypatch, chunk_size=6, keep_attention_outputs=False)
    result, got, kept = _step(model, group, monkeypatch, chunk_size=6, keep_graph_bytes=1 << 40,
                              keep_attention_outputs=True)
    assert_grads_close(got, want, 1e-12)
    assert result.metrics["kept_graph_chunks"] == 4 and kept["kept"] == 0  # no chunk recomputed: none kept
    assert result.metrics["kept_attention_bytes"] == 0


def test_keep_attention_outputs_is_validated():
    with pytest.raises(ConfigError, match="keep_attention_outputs must be True, False or None"):
        ls.ExecConfig(mode="exact", keep_attention_outputs=1)
    with pytest.raises(ConfigError, match="keep_attention_outputs=False or state_device=None"):
        ls.ExecConfig(mode="exact", keep_attention_outputs=True, state_device="cpu")


def test_a_state_from_capture_alone_keeps_no_outputs():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=4, keep_attention_outputs=True))
    assert engine.capture(torch.arange(9)).outputs is None  # only a step's own capture keeps them
    assert engine.capture(torch.arange(9), exact=True, keep_attention_outputs=True).outputs.nbytes() > 0


def test_exact_mode_keeps_the_outputs_by_default_where_the_fused_backward_runs(monkeypatch):
    """`keep_attention_outputs=None` (the default) on CPU's fused kernel: the step's walk runs
    from kept outputs, with the gradient of the walk that attends again (float64)."""
    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 21, [5, 1, 8], seed=11)  # prompt[:-1] = 20 tokens: chunks at 0, 6, 12, 18
    assert ls.ExecConfig().keep_attention_outputs is None
    _, want, plain = _step(model, group, monkeypatch, chunk_size=6, keep_attention_outputs=False)
    result, got, auto = _step(model, group, monkeypatch, chunk_size=6)
    assert_grads_close(got, want, 1e-12)
    assert auto["kept"] == model.config.num_hidden_layers * 4 and plain["kept"] == 0
    assert result.metrics["kept_attention_bytes"] > 0


def test_the_default_keeps_no_outputs_off_the_fused_kernel_or_above_the_share(monkeypatch):
    """None keeps none where the walk's backward is the blockwise kernel (a GPU's), nor where the
    outputs per position exceed `KEPT_OUTPUTS_SHARE` times the state's rows and gradients."""
    from longstraw import defaults

    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 13, [3, 2], seed=5)
    monkeypatch.setattr(flash, "FUSED_ENABLED", False)
    result, _, counts = _step(model, group, monkeypatch, chunk_size=4)
    assert result.metrics["kept_attention_bytes"] == 0 and counts["kept_blockwise"] == 0
    monkeypatch.setattr(flash, "FUSED_ENABLED", True)
    monkeypatch.setattr(defaults, "KEPT_OUTPUTS_SHARE", 0.1)  # tiny qwen3 keeps ~0.5 of its state per position
    result, _, counts = _step(model, group, monkeypatch, chunk_size=4)
    assert result.metrics["kept_attention_bytes"] == 0 and counts["kept"] == 0


def test_the_kept_outputs_rule():
    from longstraw.defaults import keeps_attention_outputs as rule

    on = dict(exact=True, offload_state=False, parallel=False, fused_backward=True, output_bytes=10.0, state_bytes=20.0)
    assert rule(None, **on)
    assert not rule(None, **{**on, "exact": False}) and not rule(True, **{**on, "exact": False})
    for fact in ("offload_state", "parallel"):
        assert not rule(None, **{**on, fact: True})
    assert not rule(None, **{**on, "fused_backward": False}) and rule(True, **{**on, "fused_backward": False})
    assert rule(None, **{**on, "output_bytes": 20.0}) and not rule(None, **{**on, "output_bytes": 21.0})
    assert not rule(None, **{**on, "output_bytes": 0.0}) and not rule(False, **on)
