"""`Engine.generate` against stock Hugging Face models (float64), and the reuse of its
captured prompt state by `step` / `score`.

Per family (dense, sliding window, qwen3_5, qwen3_next, GLM-5 with sparse DSA top-k,
DeepSeek-V3.2 sparse): greedy decoding equals HF's `generate(do_sample=False)` token for
token; sampled responses' log-probs equal `score()` and HF's full-sequence log-probs;
`step(state=rollout.state)` equals `step()`. Then: reproducibility, eos, exact mode, stale
and mismatched states, bad input.
"""

import copy

import pytest
import torch

import longstraw as ls
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    float64_hybrid,
    float64_internals,
    grads_of,
    hf_full_logprobs,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)

FAMILIES = {
    "qwen3": lambda: tiny_model("qwen3"),
    "mistral_window": lambda: tiny_model("mistral", sliding_window=6),
    "qwen3_5": lambda: tiny_hybrid("qwen3_5"),
    "qwen3_next": lambda: tiny_hybrid("qwen3_next"),
    "glm_moe_dsa_sparse": lambda: tiny_mla("glm_moe_dsa"),  # index_topk 8 < P: sparse selection
    "deepseek_v32_sparse": lambda: tiny_mla("deepseek_v32"),
}
EXEC = dict(chunk_size=5, attention_block_size=4)


def _context(name, model):
    """float64 throughout, so that 1e-9 bounds hold on any CPU: HF's MoE routers and norms
    compute in float32 inside a float64 model (`float64_internals` casts them to float64;
    decode and a whole-sequence replay batch those float32 products differently, ~1e-8
    apart), and the hybrids' GDN kernel too (`float64_hybrid`)."""
    if name.startswith("qwen3_"):
        return float64_hybrid(model)
    return float64_internals()


def _count_captures(engine) -> list:
    """Record every capture `engine` runs from now on (a list of the prompts' lengths)."""
    captures, capture = [], engine.capture

    def counting(prompt, **kwargs):
        captures.append(int(prompt.numel()))
        return capture(prompt, **kwargs)

    engine.capture = counting
    return captures


def _hf_greedy(model, prompt, steps):
    """HF's `generate(do_sample=False)` for exactly `steps` tokens: with no eos (the tiny
    configs' eos ids are ordinary tokens here; `min_new_tokens` would suppress them instead)."""
    saved = copy.deepcopy(model.generation_config), model.config.eos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    try:
        out = model.generate(prompt[None], max_new_tokens=steps, do_sample=False)[0, prompt.numel():]
    finally:
        model.generation_config, model.config.eos_token_id = saved
    assert out.numel() == steps
    return out


def _prompt(n=23, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_hf_generate_and_sampled_logprobs_equal_score_and_hf(name):
    model = FAMILIES[name]()
    prompt, steps = _prompt(), 6
    with _context(name, model):
        engine = ls.Engine(model, ls.ExecConfig(**EXEC))
        greedy = engine.generate(prompt, num_samples=2, max_new_tokens=steps, temperature=0)
        hf = _hf_greedy(model, prompt, steps)
        assert all(torch.equal(r, hf) for r in greedy.responses), ([r.tolist() for r in greedy.responses], hf.tolist())

        gen = torch.Generator().manual_seed(5)
        rollout = engine.generate(prompt, num_samples=3, max_new_tokens=steps, temperature=0.7, generator=gen)
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0, 0.5]))
        assert len({tuple(r.tolist()) for r in rollout.responses}) > 1  # sampled, not copies
        reused = engine.score(group, temperature=0.7, state=rollout.state)
        fresh = engine.score(group, temperature=0.7)
        with torch.no_grad():
            for i, response in enumerate(rollout.responses):
                want = hf_full_logprobs(model, prompt, response, temperature=0.7)
                torch.testing.assert_close(rollout.logprobs[i], want, rtol=0, atol=1e-9)
                torch.testing.assert_close(reused[i], rollout.logprobs[i], rtol=0, atol=1e-9)
                torch.testing.assert_close(fresh[i], rollout.logprobs[i], rtol=0, atol=1e-9)

        model.zero_grad(set_to_none=True)
        grpo = ls.GRPOConfig(temperature=0.7)
        captures = _count_captures(engine)
        with_state = engine.step(group, grpo, state=rollout.state)
        assert captures == [], "step(state=...) captured the prompt again"
        got = grads_of(model)
        model.zero_grad(set_to_none=True)
        without = engine.step(group, grpo)
        assert len(captures) == 1
        assert_loss_close(with_state.loss, without.loss, 1e-12)
        assert_grads_close(got, grads_of(model), 1e-12)


def test_exact_mode_reuse_equals_a_fresh_exact_step_and_can_be_stepped_twice():
    model = tiny_hybrid("qwen3_5")
    prompt = _prompt(19, seed=2)
    with float64_hybrid(model):
        engine = ls.Engine(model, ls.ExecConfig(mode="exact", **EXEC))
        rollout = engine.generate(prompt, num_samples=3, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([0.0, 1.0, 0.3]))
        model.zero_grad(set_to_none=True)
        fresh = engine.step(group)
        want = grads_of(model)
        for _ in range(2):  # stepping the same state again gives the same gradient (buffers re-zeroed)
            model.zero_grad(set_to_none=True)
            again = engine.step(group, state=rollout.state)
            assert_loss_close(again.loss, fresh.loss, 1e-12)
            assert_grads_close(grads_of(model), want, 1e-10)


def test_a_fixed_generator_reproduces_the_samples_and_top_k_one_is_greedy():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    runs = [engine.generate(prompt, num_samples=4, max_new_tokens=5, top_p=0.9,
                            generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0].responses, runs[1].responses))
    other = engine.generate(prompt, num_samples=4, max_new_tokens=5, top_p=0.9,
                            generator=torch.Generator().manual_seed(12))
    assert any(not torch.equal(a, b) for a, b in zip(runs[0].responses, other.responses))
    greedy = engine.generate(prompt, num_samples=1, max_new_tokens=5, temperature=0).responses[0]
    top1 = engine.generate(prompt, num_samples=2, max_new_tokens=5, top_k=1,
                           generator=torch.Generator().manual_seed(3)).responses
    assert all(torch.equal(r, greedy) for r in top1)


def test_eos_ends_a_branch_with_it_and_lengths_differ():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    eos = list(range(0, 97, 6))  # ~1 in 6 tokens ends a branch
    rollout = engine.generate(prompt, num_samples=6, max_new_tokens=12, temperature=1.5, eos_token_id=eos,
                              generator=torch.Generator().manual_seed(4))
    lengths = [r.numel() for r in rollout.responses]
    assert len(set(lengths)) > 1, lengths
    for r, lp in zip(rollout.responses, rollout.logprobs):
        assert lp.shape == r.shape
        hits = [i for i, t in enumerate(r.tolist()) if t in eos]
        assert hits == ([r.numel() - 1] if r.numel() < 12 else hits[:1]) and (not hits or hits[0] == r.numel() - 1)
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.rand(6, dtype=torch.float64))
    for got, want in zip(engine.score(group, temperature=1.5, state=rollout.state), rollout.logprobs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def _sgd_step(model):
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    torch.optim.SGD(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("change", ["optimizer_step", "data_assignment"])
def test_a_stale_state_is_refused_and_grad_is_untouched(change):
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    rollout = engine.generate(prompt, num_samples=2, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]))
    engine.step(group, state=rollout.state)
    engine.step(group, state=rollout.state)  # unchanged weights: reusable
    if change == "optimizer_step":
        _sgd_step(model)
    else:  # an update through .data bypasses the version counter
        with torch.no_grad():
            model.lm_head.weight.data.add_(1e-3)
    before = grads_of(model)
    with pytest.raises(ls.StaleStateError, match="changed since this state was captured"):
        engine.step(group, state=rollout.state)
    with pytest.raises(ls.StaleStateError):
        engine.score(group, state=rollout.state)
    after = grads_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_lora_adapter_switch_makes_the_state_stale():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                     init_lora_weights=False))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    rollout = engine.generate(prompt, num_samples=2, max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]))
    model.set_adapter("other")
    with pytest.raises(ls.StaleStateError):
        engine.step(group, state=rollout.state)


def test_a_state_from_another_prompt_engine_or_mode_is_refused():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    rollout = engine.generate(prompt, num_samples=2, max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]))
    other_prompt = ls.Group(prompt=_prompt(seed=9), responses=rollout.responses, rewards=group.rewards)
    with pytest.raises(ls.StateMismatchError, match="another prompt"):
        engine.step(other_prompt, state=rollout.state)
    with pytest.raises(ls.StateMismatchError, match="another Engine"):
        ls.Engine(model, ls.ExecConfig(**EXEC)).step(group, state=rollout.state)
    engine.config.mode = "exact"
    with pytest.raises(ls.StateMismatchError, match="mode"):
        engine.step(group, state=rollout.state)
    with pytest.raises(ls.StateMismatchError, match="Engine.generate"):
        engine.score(group, state="not a state")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_samples=0), ls.ConfigError, "num_samples"),
    (dict(max_new_tokens=0), ls.ConfigError, "max_new_tokens"),
    (dict(top_p=0.0), ls.ConfigError, "top_p"),
    (dict(top_p=1.5), ls.ConfigError, "top_p"),
    (dict(temperature=-1.0), ls.ConfigError, "temperature"),
    (dict(top_k=-2), ls.ConfigError, "top_k"),
    (dict(eos_token_id="x"), ls.ConfigError, "eos_token_id"),
    (dict(max_new_tokens=500), ls.PositionLimitError, "max_position_embeddings"),
])
def test_bad_sampling_input_is_refused_before_any_work(kwargs, error, match, monkeypatch):
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    monkeypatch.setattr(engine, "capture", lambda *a, **k: pytest.fail("capture ran"))
    with pytest.raises(error, match=match):
        engine.generate(_prompt(), **{"num_samples": 2, "max_new_tokens": 3, **kwargs})


def test_bad_prompt_is_refused():
    engine = ls.Engine(tiny_model("qwen3"), ls.ExecConfig(**EXEC))
    with pytest.raises(ls.InvalidGroupError, match="at least 2"):
        engine.generate(torch.tensor([3]), num_samples=2, max_new_tokens=2)
    with pytest.raises(ls.InvalidGroupError, match="outside the vocabulary"):
        engine.generate(torch.tensor([3, 500]), num_samples=2, max_new_tokens=2)
    with pytest.raises(ls.InvalidGroupError, match="integer"):
        engine.generate(torch.tensor([3.0, 4.0]), num_samples=2, max_new_tokens=2)


def test_bf16_rollout_logprobs_are_the_sampled_distribution_and_equal_score():
    """bf16 model, T = 0.7, logits ~ 10 (lm_head scaled by 5): each rollout log-prob is
    log softmax(float32(logits) / T) of the very logits the sampler drew from (cast
    first, then divide; dividing in bf16 is 0.07 nats off here), and `score(group, T)`
    gives the same numbers up to bf16 rounding: replay and decode round the hidden
    states differently, and a logit of ~10 moves in steps of 2^-4 (measured: 0.11)."""
    model = tiny_model("llama", dtype=torch.bfloat16, num_hidden_layers=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(5)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    prompt = torch.tensor([5, 9, 17, 33, 2, 61, 7])
    out = engine.generate(prompt, num_samples=3, max_new_tokens=4, temperature=0.7,
                          generator=torch.Generator().manual_seed(0))
    hook.remove()
    got = torch.stack(out.logprobs)  # (G, n)
    tokens = torch.stack(out.responses)  # (G, n)
    want = torch.stack([torch.log_softmax(step.double() / 0.7, dim=-1).gather(-1, tokens[:, j, None])[:, 0]
                        for j, step in enumerate(seen)], dim=1)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-4, (got.double() - want).abs().max()
    group = ls.Group(prompt=prompt, responses=out.responses, rewards=torch.zeros(3))
    scored = torch.stack(engine.score(group, 0.7, state=out.state))
    assert scored.dtype == torch.float32
    torch.testing.assert_close(scored, got, atol=0.25, rtol=0)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_a_vlm_never_samples_its_image_or_video_placeholders(temperature):
    """The tiny VLM's lm_head rows of the image and video placeholders are made to
    dominate the first step's logits (20x the likeliest text token's row): greedy and
    sampled responses still hold no placeholder (old code: the first token was one, and
    `step` refused the group), the log-probs stay the model's own (= `score`), and the
    group steps."""
    from tests.vision_reference import IMAGE, VIDEO, image_prompt, tiny_vlm

    model = tiny_vlm()
    prompt, inputs = image_prompt([5, "img", 4])
    with torch.no_grad():
        top = int(model(input_ids=prompt[None], **{**inputs, "mm_token_type_ids": inputs["mm_token_type_ids"][None]}
                        ).logits[0, -1].argmax())
        model.lm_head.weight[IMAGE] = model.lm_head.weight[VIDEO] = 20 * model.lm_head.weight[top]
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    rollout = engine.generate(prompt, num_samples=4, max_new_tokens=3, temperature=temperature, prompt_inputs=inputs,
                              generator=torch.Generator().manual_seed(0))
    assert not any(bool(((r == IMAGE) | (r == VIDEO)).any()) for r in rollout.responses)
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.arange(4.0), prompt_inputs=inputs)
    for got, want in zip(rollout.logprobs, engine.score(group, 1.0 if temperature == 0 else temperature)):
        assert torch.allclose(got.double(), want, atol=1e-9)
    engine.step(group, state=rollout.state)
