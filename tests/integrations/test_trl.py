"""`LongStrawGRPOTrainer` against stock `trl.GRPOTrainer` (float64), and end to end.

Equivalence: the same tiny model, dataset, seed and config go to both trainers; one
(or two) optimizer steps with SGD (lr 1, so an updated parameter differs from TRL's by
exactly the gradient difference). Sampling is bypassed the same way in both:
completions are a fixed function of the prompt ids (`_fixed`). Stock TRL gets them from
a patched `_generate_single_turn`; LongStraw's `engine.generate` still runs its real
capture (the state the update reuses), and only its sampled responses are replaced.
The test then shows it was fair: both reward functions saw identical (prompt,
completion) ids in the same order, and LongStraw captured once per prompt.

Precision: TRL's chunked log-prob kernel keeps its softmax statistics in float32 even
for a float64 model, so stock TRL is only float32-accurate (gradients ~1e-7 apart,
`test_stock_kernel_agrees_to_float32`). `float64_trl` swaps that kernel for the plain
log-softmax in the model's dtype (same maths), as `float64_norms` / `float64_hybrid` do
for HF's float32 internals; then the trainers agree to 1e-9.
"""

import copy

import pytest
import torch

import longstraw as ls
from tests.reference import assert_grads_close, assert_loss_close, float64_hybrid, float64_norms, tiny_hybrid, tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer  # noqa: E402

VOCAB, EOS = 97, 1
EXACT = ls.ExecConfig(mode="exact", chunk_size=5, attention_block_size=4)


@pytest.fixture
def float64_default():
    """TRL builds its reward and advantage tensors in the default dtype: float64 here, so
    both trainers compute advantages at the precision the comparison asks for."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(saved)


class _PlainLogProbs:
    """TRL's `ChunkedLogProbFunction` interface, computed in the input dtype."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None
        logits = hidden @ weight.t() if bias is None else hidden @ weight.t() + bias
        logp = torch.log_softmax(logits * logit_scale / temperature, dim=-1)  # (N, vocab)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return logp.gather(-1, labels[:, None])[:, 0], entropy, None, None, None


@pytest.fixture
def float64_trl(float64_default, monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _PlainLogProbs)


def _prompts(n, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (length,), generator=g)) for _ in range(n)]


def _fixed(prompt_ids, n):
    """n completions [R_j], lengths 1..5 (differing), a fixed function of the prompt ids."""
    seed = sum((i + 1) * int(t) for i, t in enumerate(prompt_ids)) % (2**31)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (1 + (seed + j) % 5,), generator=g).tolist() for j in range(n)]


class _Reward:
    """A reward that depends on every completion token; records what it was shown."""

    __name__ = "token_reward"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.seen.append((list(prompts), [list(c) for c in completion_ids]))
        return [float(sum((k + 1) * t for k, t in enumerate(c)) % 11) / 11 for c in completion_ids]


class _Grads(trl.trainer.grpo_trainer.TrainerCallback):
    """The gradient each optimizer step applies."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _args(tmp_path, name, **overrides):
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=5, max_steps=1, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, bf16=False,
                report_to=[], save_strategy="no", logging_steps=1, seed=0, temperature=0.7, epsilon_high=0.28,
                disable_dropout=True, gradient_checkpointing=False, use_bias_correction_kl=False)
    return trl.GRPOConfig(**{**base, **overrides})


def _patch_trl(trainer):
    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [c for p in prompt_ids[::num_generations] for c in _fixed(p, num_generations)], None

    trainer._generate_single_turn = generate


def _patch_longstraw(trainer):
    engine = trainer.longstraw_engine
    real_generate, real_capture, captures = engine.generate, engine.capture, []

    def generate(prompt, num_samples, max_new_tokens, **kwargs):
        rollout = real_generate(prompt, num_samples=num_samples, max_new_tokens=1, **kwargs)  # the real capture
        rollout.responses = [torch.tensor(c) for c in _fixed(prompt.tolist(), num_samples)]
        return rollout

    def capture(*a, **k):
        captures.append(a[0].numel())
        return real_capture(*a, **k)

    engine.generate, engine.capture = generate, capture
    return captures


def _norms(trainer):
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            float64_norms(model)


def _train_recorded(trainer) -> dict:
    """`trainer.train()`; the parameters before and after, the losses and the log."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(before=before, after=after, losses=losses, logs=trainer.state.log_history)


def _run_pair(model, tmp_path, *, args=None, peft_config=None, prepare=lambda trainer: None, num_prompts=2):
    """Train a copy of `model` with each trainer; return (trl, ours) results."""
    dataset = datasets.Dataset.from_dict({"prompt": _prompts(num_prompts)})
    out = []
    for cls in (trl.GRPOTrainer, LongStrawGRPOTrainer):
        reward, grads = _Reward(), _Grads()
        kwargs = {"longstraw_config": EXACT} if cls is LongStrawGRPOTrainer else {}
        trainer = cls(model=copy.deepcopy(model), reward_funcs=[reward], args=_args(tmp_path, cls.__name__, **args),
                      train_dataset=dataset, processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS),
                      callbacks=[grads], peft_config=peft_config, **kwargs)
        prepare(trainer)
        captures = _patch_longstraw(trainer) if cls is LongStrawGRPOTrainer else _patch_trl(trainer)
        out.append(dict(_train_recorded(trainer), reward=reward, grads=grads.steps, captures=captures))
    return out


def _assert_same(theirs, ours, rel=1e-9):
    assert theirs["reward"].seen == ours["reward"].seen  # the same prompts and completions, in order
    assert all(torch.equal(theirs["before"][n], ours["before"][n]) for n in theirs["before"])
    assert len(theirs["losses"]) == len(ours["losses"]) >= 1
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert_loss_close(a, b, rel)
    assert len(theirs["grads"]) == len(ours["grads"])
    for got, want in zip(ours["grads"], theirs["grads"]):
        assert set(got) == set(want)
        assert any(g.abs().sum() > 0 for g in want.values())
        assert_grads_close(got, want, rel)
    for name, want in theirs["after"].items():  # SGD lr 1: after = before - grad
        got = ours["after"][name]
        assert (got - want).abs().max() <= rel * want.abs().max() + 1e-12, name


# ----------------------------------------------------------------------------
# equivalence


@pytest.mark.parametrize("loss_type,scale_rewards", [("dapo", "group"), ("grpo", "batch"), ("dr_grpo", "none")])
def test_one_step_equals_trl_dense(tmp_path, float64_trl, loss_type, scale_rewards):
    """2 prompts x G=4 over 2 accumulation micro-steps; every TRL loss type we map."""
    theirs, ours = _run_pair(tiny_model("qwen3"), tmp_path, prepare=_norms,
                             args=dict(loss_type=loss_type, scale_rewards=scale_rewards))
    _assert_same(theirs, ours)
    assert len(ours["captures"]) == 2  # one capture per prompt: generation's state served the update


def test_one_step_equals_trl_hybrid(tmp_path, float64_trl, monkeypatch):
    """HF's GDN gate computes `A_log.float()` and `a.float()`, so in a float64 model those
    gradients are rounded to float32 once per backward call: once per batch in TRL, once
    per branch or chunk in LongStraw (~1e-7 apart, tests/models/test_hybrid.py). Here `.float()`
    leaves float64 tensors as they are, in both trainers."""
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self, *a, **k: self if self.dtype == torch.float64 else real_float(self, *a, **k))
    model = tiny_hybrid("qwen3_5")
    with float64_hybrid(model):
        theirs, ours = _run_pair(model, tmp_path, args=dict(gradient_accumulation_steps=1, per_device_train_batch_size=8))
    _assert_same(theirs, ours)
    assert len(ours["captures"]) == 2


def test_peft_beta_num_iterations_equal_trl(tmp_path, float64_trl):
    """LoRA, beta > 0 (reference = adapter disabled, a separate capture), num_iterations=2
    (old log-probs; the second pass recaptures after the optimizer step): two steps."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    theirs, ours = _run_pair(tiny_model("qwen3"), tmp_path, peft_config=lora, prepare=_norms,
                             args=dict(beta=0.1, num_iterations=2, max_steps=2))
    _assert_same(theirs, ours)
    assert ours["logs"][0]["kl"] > 0
    # per prompt: generation, reference (adapter off); step 2: the update recaptures
    assert len(ours["captures"]) == 2 + 2 + 2


def test_ref_model_beta_equals_trl(tmp_path, float64_trl):
    """beta > 0 without PEFT: TRL loads `ref_model` from the policy's path (here a perturbed
    copy, so the KL is not 0); LongStraw scores it through a second engine."""
    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "ref")
    model.config._name_or_path = str(tmp_path / "ref")
    theirs, ours = _run_pair(model, tmp_path, prepare=_norms, args=dict(beta=0.2, gradient_accumulation_steps=1))
    _assert_same(theirs, ours)
    assert ours["logs"][0]["kl"] > 0
    assert len(ours["captures"]) == 1  # the policy engine captured once; the reference engine on its own


def test_stock_kernel_agrees_to_float32(tmp_path, float64_default):
    """Without the swap, only TRL's float32 softmax statistics separate the two."""
    theirs, ours = _run_pair(tiny_model("qwen3"), tmp_path, prepare=_norms, args=dict(gradient_accumulation_steps=1))
    _assert_same(theirs, ours, rel=1e-5)


# ----------------------------------------------------------------------------
# end to end, and refusals


def _reward_even(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]


def _e2e_trainer(tmp_path, keep_states=True, replica_check_every=0, **overrides):
    model = tiny_model("qwen3", dtype=torch.float32)
    args = dict(output_dir=str(tmp_path / "e2e"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, max_steps=3, save_strategy="steps", save_steps=2, logging_steps=1,
                learning_rate=5e-2, use_cpu=True, bf16=False, report_to=[], seed=0)
    return LongStrawGRPOTrainer(model=model, reward_funcs=_reward_even, args=trl.GRPOConfig(**{**args, **overrides}),
                                train_dataset=datasets.Dataset.from_dict({"prompt": _prompts(6)}),
                                processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS),
                                longstraw_config=ls.ExecConfig(chunk_size=4), longstraw_keep_states=keep_states,
                                longstraw_replica_check_every=replica_check_every)


def test_train_logs_checkpoints_and_resumes(tmp_path):
    trainer = _e2e_trainer(tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert 0 <= h["reward"] <= 1 and "rewards/_reward_even/mean" in h
        assert h["longstraw/captures"] == 1 and h["longstraw/state_bytes"] > 0  # generation's capture served the step
        assert h["longstraw/peak_memory_bytes"] > 0 and h["longstraw/time_generate_s"] > 0
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert any(not torch.equal(before[n], final[n]) for n in before)
    checkpoint = tmp_path / "e2e" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists()

    resumed = _e2e_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3]  # 1, 2 from the checkpoint
    for name, p in resumed.model.named_parameters():  # RNG, optimizer and data order restored
        torch.testing.assert_close(p.detach(), final[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides,needle", [
    (dict(use_vllm=True), "use_vllm"),
    (dict(loss_type="bnpo"), "loss_type='bnpo'"),
    (dict(loss_type="cispo"), "loss_type='cispo'"),
    (dict(steps_per_generation=2), "steps_per_generation"),
    (dict(beta=0.1), "use_bias_correction_kl"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions"),
    (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(eval_strategy="steps", eval_steps=1), "evaluation"),
])
def test_unsupported_settings_refused_at_construction(tmp_path, overrides, needle):
    with pytest.raises(ls.ConfigError, match="LongStrawGRPOTrainer cannot run") as info:
        _e2e_trainer(tmp_path, **overrides)
    assert needle in str(info.value)


def test_dropped_states_are_captured_again(tmp_path):
    trainer = _e2e_trainer(tmp_path, keep_states=False, max_steps=1, save_strategy="no")
    trainer.train()
    assert trainer.state.log_history[0]["longstraw/captures"] == 2  # generation, then the update


def test_gradient_checkpointing_is_turned_off(tmp_path):
    trainer = _e2e_trainer(tmp_path, gradient_checkpointing=True)
    assert not trainer.args.gradient_checkpointing


def test_replicas_are_checked_every_n_optimizer_steps(tmp_path, monkeypatch):
    """longstraw_replica_check_every=2 over 5 optimizer steps: check_replicas after steps 2
    and 4, on the policy (in one process it compares nothing and returns 0)."""
    from longstraw.integrations import trl as integration

    calls = []
    real = integration.check_replicas
    monkeypatch.setattr(integration, "check_replicas", lambda model: calls.append(model) or real(model))
    trainer = _e2e_trainer(tmp_path, replica_check_every=2, max_steps=5, save_strategy="no",
                           gradient_accumulation_steps=1)
    trainer.train()
    assert len(calls) == 2 and all(m is trainer.longstraw_engine.model for m in calls)
    with pytest.raises(ls.ConfigError, match="longstraw_replica_check_every"):
        _e2e_trainer(tmp_path, replica_check_every=-1)


def test_each_distinct_prompt_is_tokenised_once():
    """TRL repeats each prompt num_generations times; the trainer tokenises it once and
    hands TRL the same ids, row by row, as TRL's own tokenisation."""
    seen = []
    tokenizer = token_id_tokenizer(64)
    encode = tokenizer.__call__

    class Counting(type(tokenizer)):
        def __call__(self, text=None, **kwargs):
            seen.extend(text)
            return encode(text=text, **kwargs)

    tokenizer.__class__ = Counting
    trainer = object.__new__(LongStrawGRPOTrainer)  # _tokenize_prompts reads only processing_class
    trainer.processing_class = tokenizer
    prompts = ["1 2 3 4"] * 3 + ["5 6"] * 3
    ids, images, fields = trainer._tokenize_prompts(prompts)
    assert seen == ["1 2 3 4", "5 6"]
    seen.clear()
    assert (ids, images, fields) == trl.GRPOTrainer._tokenize_prompts(trainer, prompts)
    assert ids == [[1, 2, 3, 4]] * 3 + [[5, 6]] * 3 and ids[0] is not ids[1]  # rows TRL may change one by one
