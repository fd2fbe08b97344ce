"""Bad input gets a clear error of a project type before any work; .grad stays untouched."""

import pytest
import torch
from torch import nn

import longstraw as ls
from tests.reference import random_group, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", max_position_embeddings=40)


def _group(**changes):
    g = random_group(97, 12, [4, 3], seed=0)
    for k, v in changes.items():
        setattr(g, k, v)
    return g


BAD_GROUPS = {
    "prompt of 1 token": dict(prompt=torch.tensor([5])),
    "prompt not 1-D": dict(prompt=torch.zeros(2, 6, dtype=torch.long)),
    "prompt as floats": dict(prompt=torch.zeros(6)),
    "no responses": dict(responses=[], rewards=torch.zeros(0)),
    "empty response": dict(responses=[torch.tensor([1, 2]), torch.zeros(0, dtype=torch.long)]),
    "rewards length != G": dict(rewards=torch.tensor([1.0, 0.0, 0.5])),
    "NaN reward": dict(rewards=torch.tensor([float("nan"), 1.0])),
    "inf reward": dict(rewards=torch.tensor([float("inf"), 1.0])),
    "token id >= vocab": dict(responses=[torch.tensor([1, 97]), torch.tensor([2])]),
    "negative token id": dict(prompt=torch.tensor([3, -1, 4])),
    "old_logprobs wrong shape": dict(old_logprobs=[torch.zeros(3), torch.zeros(3)]),
    "old_logprobs NaN": dict(old_logprobs=[torch.full((4,), float("nan")), torch.zeros(3)]),
    "loss mask shorter than its response": dict(loss_masks=[torch.ones(3, dtype=torch.bool),
                                                            torch.ones(3, dtype=torch.bool)]),
    "loss mask of 0/1 ints": dict(loss_masks=[torch.ones(4, dtype=torch.long), torch.ones(3, dtype=torch.long)]),
    "loss mask of floats": dict(loss_masks=[torch.ones(4), torch.ones(3)]),
    "one loss mask for two responses": dict(loss_masks=[torch.ones(4, dtype=torch.bool)]),
    "loss masks as one tensor": dict(loss_masks=torch.ones(4, dtype=torch.bool)),
    "advantages length != G": dict(advantages=torch.tensor([1.0, 0.0, 0.5])),
    "advantages as ints": dict(advantages=torch.tensor([1, -1])),
    "advantages as a list": dict(advantages=[1.0, -1.0]),
    "NaN advantage": dict(advantages=torch.tensor([float("nan"), 1.0])),
    "inf advantage": dict(advantages=torch.tensor([1.0, float("-inf")])),
    "neither rewards nor advantages": dict(rewards=None),
}


def _poison_grads(model):
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)


def _assert_grads_untouched(model):
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())


@pytest.mark.parametrize("case", sorted(BAD_GROUPS))
def test_bad_group_raises_before_work(model, case, monkeypatch):
    engine = ls.Engine(model)
    monkeypatch.setattr(engine, "capture", lambda *a, **k: pytest.fail("capture ran on bad input"))
    _poison_grads(model)
    with pytest.raises(ls.InvalidGroupError) as err:
        engine.step(_group(**BAD_GROUPS[case]), ls.GRPOConfig())
    assert "group." in str(err.value)
    _assert_grads_untouched(model)


def test_response_past_max_positions_needs_opt_in(model):
    group = random_group(97, 30, [11], seed=0)  # 41 > 40
    _poison_grads(model)
    with pytest.raises(ls.PositionLimitError, match="max_position_embeddings=40"):
        ls.Engine(model).step(group)
    _assert_grads_untouched(model)
    ls.Engine(model, ls.ExecConfig(allow_position_overflow=True)).score(group)


def test_beta_without_ref_logprobs(model):
    _poison_grads(model)
    with pytest.raises(ls.InvalidGroupError, match="ref_logprobs"):
        ls.Engine(model).step(_group(), ls.GRPOConfig(beta=0.1))
    _assert_grads_untouched(model)


def test_train_mode_with_dropout_is_refused():
    model = tiny_model("qwen2", attention_dropout=0.1).train()
    _poison_grads(model)
    with pytest.raises(ls.ModelStateError, match="dropout"):
        ls.Engine(model).step(_group())
    _assert_grads_untouched(model)
    model.eval()  # eval mode: dropout is off, so it runs
    ls.Engine(model).score(_group())


def test_train_mode_without_dropout_runs():
    model = tiny_model("qwen3").train()
    ls.Engine(model).step(_group())
    assert any(p.grad is not None for p in model.parameters())


def test_unsupported_model_type_lists_supported():
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
    with pytest.raises(ls.UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        ls.Engine(transformers.GPT2LMHeadModel(cfg))
    with pytest.raises(ls.UnsupportedModelError):
        ls.Engine(nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs", [dict(chunk_size=0), dict(mode="fast"), dict(attention_block_size=-1),
                                    dict(chunk_size=2.5)])
def test_bad_exec_config(kwargs):
    with pytest.raises(ls.ConfigError):
        ls.ExecConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(loss_type="ppo"), dict(scale_rewards="batch"), dict(temperature=0),
                                    dict(epsilon_low=1.5), dict(beta=float("nan")), dict(max_completion_length=0)])
def test_bad_grpo_config(kwargs):
    with pytest.raises(ls.ConfigError):
        ls.GRPOConfig(**kwargs)


def test_batch_totals_smaller_than_group(model):
    _poison_grads(model)
    with pytest.raises(ls.InvalidGroupError, match="BatchTotals.of"):
        ls.Engine(model).step(_group(), totals=ls.BatchTotals(num_sequences=1, num_tokens=7, max_response_tokens=4))
    _assert_grads_untouched(model)


def test_autocast_is_refused_before_any_work():
    import torch

    from tests.reference import random_group, tiny_model

    model = tiny_model("llama")
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    group = random_group(97, 9, [3, 2], seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ls.ConfigError, match="autocast"):
            engine.step(group)
        with pytest.raises(ls.ConfigError, match="autocast"):
            engine.score(group)
    assert all(p.grad is None for p in model.parameters())


def test_bad_loss_masks_are_refused_by_batch_totals_and_score(model, monkeypatch):
    """BatchTotals.of counts loss tokens, so it checks the masks too; score does as well."""
    group = _group(loss_masks=[torch.ones(4, dtype=torch.bool), torch.ones(5, dtype=torch.bool)])
    with pytest.raises(ls.InvalidGroupError, match=r"loss_masks\[1\] has shape \(5,\).*\(3,\)"):
        ls.BatchTotals.of([group])
    engine = ls.Engine(model)
    monkeypatch.setattr(engine, "capture", lambda *a, **k: pytest.fail("capture ran on bad input"))
    with pytest.raises(ls.InvalidGroupError, match="loss_masks"):
        engine.score(group)


def test_no_rewards_and_no_advantages_names_both(model):
    with pytest.raises(ls.InvalidGroupError, match=r"rewards is None.*advantages"):
        ls.Engine(model).step(_group(rewards=None))
