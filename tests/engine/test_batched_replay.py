"""Batched replay (`ExecConfig.replay_batch`, `engine/batched.py`): b branches through the
model as one batch against the shared prompt state give the gradients of one branch at a
time (its naive twin, b = 1) to 1e-12 in float64, in both modes, flat and as a tree, with
branches replayed in pieces among them, and through the blockwise kernel; the batches
really run (counted); families that take no batch refuse before any work."""

import pytest
import torch

import longstraw as ls
import longstraw.engine.batched as batched
import longstraw.ops.flash as flash
from longstraw.errors import ConfigError
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    float64_norms,
    float64_throughout,
    grads_of,
    masked_group,
    random_group,
    tiny_hybrid,
    tiny_mamba,
    tiny_mla,
    tiny_model,
    tree_group,
)

LENGTHS = [5, 1, 8, 6, 3]  # G = 5; with branch_chunk_size=4, the 5, 8 and 6 run in pieces


def _model(family):
    if family == "qwen3":
        return float64_norms(tiny_model("qwen3"))
    if family == "qwen3_5":
        return tiny_hybrid("qwen3_5")
    return tiny_mla("glm_moe_dsa", index_topk=4)  # top-k below P: DSA's sparse selection runs


def _float64_decay(module, a, params=None):
    """The GDN decay without HF's float32 cast of A_log (it rounds A_log's gradient once per
    call, so b branches in one call round differently from b calls: ~1e-7)."""
    a_log, dt_bias = (module.A_log, module.dt_bias) if params is None else params
    return -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)


def _step(model, group, monkeypatch, **kw):
    """(loss, grads, sizes of the batches run) of one step."""
    sizes = []
    padded = batched.padded

    def counting(inputs):
        sizes.append(len(inputs))
        return padded(inputs)

    monkeypatch.setattr(batched, "padded", counting)
    model.zero_grad(set_to_none=True)
    with float64_throughout(model):
        result = ls.Engine(model, ls.ExecConfig(chunk_size=6, attention_block_size=4, **kw)).step(group)
    return result.loss, grads_of(model), sizes


def _check(family, group, monkeypatch, batches, mode, **kw):
    if family == "qwen3_5":
        from longstraw.models import gated_deltanet
        monkeypatch.setattr(gated_deltanet, "_log_decay", _float64_decay)
    model = _model(family)
    want_loss, want, none = _step(model, group, monkeypatch, mode=mode, replay_batch=1, **kw)
    assert none == []
    for b, expected in batches.items():
        loss, got, sizes = _step(model, group, monkeypatch, mode=mode, replay_batch=b, **kw)
        assert sizes == expected, (b, sizes)
        assert_loss_close(loss, want_loss, 1e-12)
        assert_grads_close(got, want, 1e-12)


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                    pytest.param("glm_moe_dsa", marks=pytest.mark.slow)])
def test_batched_replay_equals_one_branch_at_a_time(family, mode, monkeypatch):
    """Flat replay, every branch one piece: b = 2, 3 and G = 5 against b = 1."""
    group = random_group(97, 21, LENGTHS, seed=11)  # prompt[:-1] = 20 tokens: chunks at 0, 6, 12, 18
    _check(family, group, monkeypatch, {2: [2, 2], 3: [3, 2], 5: [5]}, mode, share_response_prefixes=False)


@pytest.mark.parametrize("family,mode", [("qwen3", "detached"), ("qwen3", "exact"), ("qwen3_5", "exact"),
                                         ("glm_moe_dsa", "exact"),
                                         pytest.param("qwen3_5", "detached", marks=pytest.mark.slow),
                                         pytest.param("glm_moe_dsa", "detached", marks=pytest.mark.slow)])
def test_batched_replay_with_pieces_masks_and_a_tree(family, mode, monkeypatch):
    """Branches of more than one piece replay alone (as before), the rest in batches; loss
    masks; and a tree, whose leaves under one fork batch on top of the shared segment."""
    group = masked_group(97, 21, LENGTHS, seed=5)
    _check(family, group, monkeypatch, {2: [2], 5: [2]}, mode, share_response_prefixes=False, branch_chunk_size=4)
    tree = tree_group(["AB", "AC", "AD", "E"], prompt_len=11)  # P -> {A -> {B, C, D}, E}
    _check(family, tree, monkeypatch, {2: [2], 3: [3], 4: [3]}, mode)


@pytest.mark.parametrize("family,overrides", [("qwen3", {}),
                                              ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1))])
def test_batched_replay_through_the_blockwise_kernel(family, overrides, monkeypatch):
    """Without the fused kernels (CUDA's path, and sliding windows): the blockwise kernel's
    batch (each branch's own causal part, the prefix over every branch's rows)."""
    monkeypatch.setattr(flash, "FUSED_ENABLED", False)
    model = float64_norms(tiny_model(family, **overrides))
    group = random_group(97, 21, LENGTHS, seed=3)
    for mode in ("detached", "exact"):
        want_loss, want, _ = _step(model, group, monkeypatch, mode=mode, replay_batch=1)
        loss, got, sizes = _step(model, group, monkeypatch, mode=mode, replay_batch=3)
        assert sizes == [3, 2]
        assert_loss_close(loss, want_loss, 1e-12)
        assert_grads_close(got, want, 1e-12)


def test_families_without_a_batch_and_context_parallelism_refuse_before_any_work():
    model = tiny_mamba("bamba")
    with pytest.raises(ConfigError, match="replay_batch=2.*one branch at a time"):
        ls.Engine(model, ls.ExecConfig(replay_batch=2))
    ls.Engine(model, ls.ExecConfig(replay_batch=1))
    with pytest.raises(ConfigError, match="context_parallel"):
        ls.Engine(tiny_model("qwen3"), ls.ExecConfig(replay_batch=2, context_parallel=True))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="replay_batch"):
            ls.ExecConfig(replay_batch=bad)
