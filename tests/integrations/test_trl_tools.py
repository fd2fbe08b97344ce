"""`LongStrawGRPOTrainer` with TRL's tools against stock `trl.GRPOTrainer` (float64).

TRL runs its own tool loop in both trainers (`_tool_call_loop`: parsing with the
tokenizer's response template, calling the tool, building `tool_mask`); only where a
post-tool continuation is generated differs. Stock TRL regenerates over prompt +
completion + tool result; LongStraw absorbs completion + tool result as a `prefix=` into
a branch of the prompt's one captured state.

Sampling is bypassed the same way in both, as in `test_trl.py`: completions are a fixed
function of the ids generated from (`_script`), which in turn 1 calls the tool once or
not at all and after a tool result calls it again or answers. LongStraw's
`engine.generate` still runs for real (the capture, and every continuation from the held
state with its prefix); only its sampled tokens are replaced.
"""

import copy

import pytest
import torch

import longstraw as ls
from tests.integrations.test_trl import (EXACT, VOCAB, _assert_same, _Grads, _norms, _Reward, _train_recorded,  # noqa: F401
                                         float64_default, float64_trl)
from tests.reference import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from longstraw.integrations.chat import call_word, tool_chat_tokenizer  # noqa: E402
from longstraw.integrations.trl import LongStrawGRPOTrainer  # noqa: E402

TOK = tool_chat_tokenizer(VOCAB)
EOS, TOOL, OPEN, CLOSE = (TOK.convert_tokens_to_ids(t) for t in ("<eos>", "<tool>", "<tool_call>", "</tool_call>"))
CALLS = [TOK.convert_tokens_to_ids(call_word("lookup", "key", v)) for v in range(10)]
NUMBERS = [TOK.convert_tokens_to_ids(str(n)) for n in range(50)]
G = 4


def lookup(key: str) -> str:
    """Look up a record.

    Args:
        key: the record's key.
    """
    return " ".join(str((7 * int(key) + i) % 50) for i in range(1 + int(key) % 3))


def _script(ids, j):
    """The completion after `ids` (prompt, or prompt + completion + tool result) for
    sample j: turn 1 answers (j = 0) or calls lookup; after a tool result it calls again
    until it made 1 + (first key % 2) calls, then answers; every turn ends with eos."""
    seed = (sum((i + 1) * t for i, t in enumerate(ids)) + 7919 * j) % (2**31)
    g = torch.Generator().manual_seed(seed)
    made = ids.count(OPEN)
    key = int(torch.randint(0, 10, (), generator=g))
    if made == 0:
        wants = 0 if j == 0 else 1
    else:
        first = CALLS.index(ids[ids.index(OPEN) + 1])
        wants = 1 + first % 2
    if made < wants:
        return [OPEN, CALLS[key], CLOSE, EOS]
    return [NUMBERS[int(t)] for t in torch.randint(0, 50, (1 + seed % 4,), generator=g)] + [EOS]


def _patch_trl(trainer):
    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [_script(list(p), j % num_generations) for j, p in enumerate(prompt_ids)], None

    trainer._generate_single_turn = generate


def _patch_longstraw(trainer):
    """Real `engine.generate` (capture, or `state=` + `prefix=`), scripted tokens; records
    every capture and every generate call. The real call samples one token past the
    prefix, not up to `max_new_tokens`: its tokens are replaced, and the trainer takes
    only the responses, the held state and the metrics from a rollout."""
    engine = trainer.longstraw_engine
    real_generate, real_capture, seen = engine.generate, engine.capture, dict(captures=[], generates=[])

    def generate(prompt, num_samples, max_new_tokens, prefix=None, state=None, **kwargs):
        head = [] if prefix is None else prefix.tolist()
        rollout = real_generate(prompt, num_samples=num_samples, max_new_tokens=len(head) + 1, prefix=prefix,
                                state=state, **kwargs)
        rollout.responses = [torch.tensor((head + _script(prompt.tolist() + head, j))[:max_new_tokens])
                             for j in range(num_samples)]
        seen["generates"].append((len(head), state is not None))
        return rollout

    def capture(*a, **k):
        seen["captures"].append(a[0].numel())
        return real_capture(*a, **k)

    engine.generate, engine.capture = generate, capture
    return seen


def _dataset(n):
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": " ".join(
        str(int(t)) for t in torch.randint(0, 50, (9,), generator=g))}] for _ in range(n)]})


def _args(tmp_path, name, **overrides):
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=G, gradient_accumulation_steps=2,
                num_generations=G, max_completion_length=24, max_steps=1, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, bf16=False,
                report_to=[], save_strategy="no", logging_steps=1, seed=0, temperature=0.7, epsilon_high=0.28,
                disable_dropout=True, gradient_checkpointing=False, use_bias_correction_kl=False)
    return trl.GRPOConfig(**{**base, **overrides})


def _run_pair(model, tmp_path, *, args, num_prompts=2, keep_states=True):
    out = []
    for cls in (trl.GRPOTrainer, LongStrawGRPOTrainer):
        reward, grads = _Reward(), _Grads()
        kwargs = dict(longstraw_config=EXACT, longstraw_keep_states=keep_states) if cls is LongStrawGRPOTrainer else {}
        trainer = cls(model=copy.deepcopy(model), reward_funcs=[reward], args=_args(tmp_path, cls.__name__, **args),
                      train_dataset=_dataset(num_prompts), processing_class=tool_chat_tokenizer(VOCAB),
                      tools=[lookup], callbacks=[grads], **kwargs)
        _norms(trainer)
        seen = _patch_longstraw(trainer) if cls is LongStrawGRPOTrainer else _patch_trl(trainer)
        out.append(dict(_train_recorded(trainer), reward=reward, grads=grads.steps, seen=seen))
    return out


def _tool_results(completion):
    return completion.count(TOOL)


# ----------------------------------------------------------------------------
# equivalence


@pytest.mark.parametrize("iterations,overrides,captures", [
    (1, dict(loss_type="dapo"), 2), (2, dict(loss_type="dapo"), 2), (1, dict(loss_type="grpo"), 2),
    (2, dict(loss_type="grpo"), 2),
    (2, dict(loss_type="dr_grpo", num_iterations=2, max_steps=2), 4),  # old log-probs; step 2 recaptures
])
def test_tool_step_equals_trl(tmp_path, float64_trl, iterations, overrides, captures):
    """2 prompts x G=4 over 2 micro-steps with lookup as the tool: completions with no
    call, one call and two (the second executed only when max_tool_calling_iterations=2)."""
    theirs, ours = _run_pair(tiny_model("qwen3"), tmp_path, args=dict(max_tool_calling_iterations=iterations,
                                                                      **overrides))
    _assert_same(theirs, ours)
    completions = [c for _, batch in ours["reward"].seen for c in batch]
    results = sorted({_tool_results(c) for c in completions})
    assert results == list(range(iterations + 1))  # no tool turn, one, and (iterations=2) two
    seen = ours["seen"]
    assert len(seen["captures"]) == captures  # per prompt and step, one: generation, continuations, update
    continuations = [g for g in seen["generates"] if g[0] > 0]
    assert len(continuations) == sum(_tool_results(c) for c in completions) and all(s for _, s in continuations)
    logs = [h for h in ours["logs"] if "loss" in h]
    assert logs[0]["longstraw/captures"] == 2 and logs[0]["longstraw/tool_continuations"] == len(continuations)


# ----------------------------------------------------------------------------
# the real path: a model that calls the tool itself


def _calling_model():
    """A tiny Qwen3 whose next token is (almost surely, margin ~100 logits) a fixed
    function of the current one: <a> -> <tool_call> -> CALLS[3] -> </tool_call> -> <eos>.
    Each of those tokens' embedding is a large one-hot that dominates the residual stream;
    lm_head maps it to its successor. After TRL's tool turn (`<tool> 21 </tool> <a>`) it
    calls again, so every executed call is followed by a real continuation."""
    model = tiny_model("qwen3")
    chain = [TOK.convert_tokens_to_ids("<a>"), OPEN, CALLS[3], CLOSE, EOS]
    with torch.no_grad():
        for d, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, d] = 30.0
            model.lm_head.weight[successor, d] += 20.0
    return model


@pytest.mark.parametrize("iterations", [1, 2])
def test_sampled_tool_calls_equal_trl_without_recapture(tmp_path, float64_default, iterations):
    """No patching: TRL's HF generate regenerates over prompt + completion + tool result
    each turn; LongStraw samples from the prompt's one capture. Same completions, tool
    masks and number of executed calls; one capture per prompt."""
    model, out = _calling_model(), []
    for cls in (trl.GRPOTrainer, LongStrawGRPOTrainer):
        reward = _Reward()
        kwargs = dict(longstraw_config=EXACT) if cls is LongStrawGRPOTrainer else {}
        trainer = cls(model=copy.deepcopy(model), reward_funcs=[reward], train_dataset=_dataset(2),
                      args=_args(tmp_path, cls.__name__, max_tool_calling_iterations=iterations),
                      processing_class=tool_chat_tokenizer(VOCAB), tools=[lookup], **kwargs)
        captures = []
        if cls is LongStrawGRPOTrainer:
            real = trainer.longstraw_engine.capture
            trainer.longstraw_engine.capture = lambda *a, **k: captures.append(a[0].numel()) or real(*a, **k)
        batch = trainer._generate_and_score_completions([row for row in trainer.train_dataset for _ in range(G)][:G])
        out.append(dict(seen=reward.seen, tool_mask=batch["tool_mask"], captures=captures, trainer=trainer))
    theirs, ours = out
    assert theirs["seen"] == ours["seen"]
    assert torch.equal(theirs["tool_mask"], ours["tool_mask"])
    call = [OPEN, CALLS[3], CLOSE, EOS]
    result = TOK(" ".join(["<tool>", lookup("3"), "</tool>", "<a>"]))["input_ids"]
    want = call + (result + call) * iterations  # the last call is never executed
    assert all(c == want for c in ours["seen"][0][1])
    assert ours["tool_mask"][0, :len(want)].tolist() == [1] * 4 + ([0] * len(result) + [1] * 4) * iterations
    assert len(ours["captures"]) == 1  # the prompt's one capture served all G x iterations continuations
    assert ours["trainer"]._window["tool_continuations"] == G * iterations


class _Records:
    """A TRL environment (`environment_factory`): its public methods are the tools."""

    def reset(self, **kwargs):
        self.calls = 0

    def lookup(self, key: str) -> str:
        """Look up a record.

        Args:
            key: the record's key.
        """
        self.calls += 1
        return lookup(key)


def test_environment_factory_trains_with_dropped_states(tmp_path, monkeypatch):
    """environment_factory=, longstraw_keep_states=False, train(): the tool loop still
    continues from generation's capture (held until the loop ends); the update, with the
    state dropped, captures once more."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rewards differ per row, so the update is not skipped
    trainer = LongStrawGRPOTrainer(
        model=_calling_model().float(), reward_funcs=[lambda completion_ids, **k: [float(i) for i in range(len(completion_ids))]],
        args=_args(tmp_path, "env", max_tool_calling_iterations=1, gradient_accumulation_steps=1, optim="adamw_torch",
                   learning_rate=1e-3),
        train_dataset=_dataset(1), processing_class=tool_chat_tokenizer(VOCAB), environment_factory=_Records,
        longstraw_keep_states=False)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["tools/call_frequency"] == 1.0 and log["longstraw/tool_continuations"] == G
    assert log["longstraw/captures"] == 2  # generation (served every continuation), then the update
    assert all(e.calls == 1 for e in trainer.environments)


def test_rollout_func_is_refused(tmp_path):
    with pytest.raises(ls.ConfigError, match="rollout_func is not supported"):
        LongStrawGRPOTrainer(model=tiny_model("qwen3", dtype=torch.float32), reward_funcs=[_Reward()],
                             args=_args(tmp_path, "refused"), train_dataset=_dataset(1),
                             processing_class=tool_chat_tokenizer(VOCAB), rollout_func=lambda prompts, trainer: {})


def test_tokenizer_too_small_is_refused():
    with pytest.raises(ls.ConfigError, match="vocab_size=19"):
        tool_chat_tokenizer(19)
