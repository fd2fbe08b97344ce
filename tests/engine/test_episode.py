"""Agent episodes (`Engine.generate(environment=, max_turns=, prefix=, state=)`) against
stock Hugging Face models in float64.

The reference is TRL's tool loop done with HF: `generate` greedily to eos over the whole
prompt + response so far, append the environment's observation, generate again. The
engine instead absorbs each observation as one chunk into the branch's own state, and
never captures the prompt again. Per family (dense, qwen3_5 hybrid, GLM-5 sparse DSA):
tokens equal, log-probs of sampled tokens equal HF's full-sequence ones, masks True
exactly at sampled tokens; the same with `prefix=`; observation absorption is one call
per observation, not one decode step per token; bad input is refused.
"""

import copy

import pytest
import torch

import longstraw as ls
from longstraw.engine import episode as episode_module
from longstraw.phase import Phase
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    FLOAT64,
    float64_norms,
    float64_throughout,
    grads_of,
    hf_cached_logprobs,
    hf_full_logprobs,
    reference_grpo_loss,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)

FAMILIES = {
    "qwen3": lambda: tiny_model("qwen3"),
    "qwen3_5": lambda: tiny_hybrid("qwen3_5"),
    "glm_moe_dsa_sparse": lambda: tiny_mla("glm_moe_dsa"),  # index_topk 8 < P: sparse selection
}
EXEC = dict(chunk_size=5, attention_block_size=4)


def _context(name, model):
    """float64 throughout (HF's float32 MoE router and GDN internals cast too): FLOAT64."""
    return float64_throughout(model)


def _prompt(n=23, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _environment(calls: list):
    """Deterministic: branch i's k-th observation has 2 + i + 2k tokens, ids from the
    response; `calls` records (branch, response, observation)."""
    def env(branch, response):
        k = sum(1 for b, _, _ in calls if b == branch)
        base = int(response.sum()) + 7 * branch
        obs = torch.tensor([(base + 13 * j) % 97 for j in range(2 + branch + 2 * k)], dtype=torch.long)
        calls.append((branch, response.clone(), obs))
        return obs
    return env


def _hf_episode(model, prompt, env, branch, *, n, eos, max_turns, prefix=()):
    """TRL's loop with HF: greedy `generate` to eos over prompt + response, append the
    observation, again. Returns (response, mask, turns)."""
    response, mask, turns = list(prefix), [True] * len(prefix), 0
    saved = copy.deepcopy(model.generation_config)
    try:
        while len(response) < n:
            ids = torch.cat([prompt, torch.tensor(response, dtype=torch.long)])
            out = model.generate(ids[None], max_new_tokens=n - len(response), do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)[0, ids.numel():].tolist()
            if eos in out:
                out = out[: out.index(eos) + 1]
            response, mask = response + out, mask + [True] * len(out)
            if out[-1] != eos or len(response) >= n or turns >= max_turns:
                break
            obs = env(branch, torch.tensor(response))
            turns += 1
            if obs is None or len(response) + obs.numel() > n:
                break
            response, mask = response + obs.tolist(), mask + [False] * obs.numel()
    finally:
        model.generation_config = saved
    return torch.tensor(response), torch.tensor(mask), turns


def _greedy_eos(engine, prompt):
    """An eos the greedy continuation emits early (its 3rd token), so the episode takes turns."""
    return int(engine.generate(prompt, num_samples=1, max_new_tokens=3, temperature=0).responses[0][-1])


def _check_logprobs(model, prompt, rollout, tol, temperature=1.0):
    with torch.no_grad():
        for r, lp, m in zip(rollout.responses, rollout.logprobs, rollout.loss_masks):
            want = hf_full_logprobs(model, prompt, r, temperature=temperature)
            torch.testing.assert_close(lp[m], want[m], rtol=0, atol=tol)
            assert torch.equal(lp[~m], torch.zeros_like(lp[~m]))  # observations: log-prob 0.0, as TRL


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_episode_equals_the_hf_tool_loop_token_for_token(name):
    model = FAMILIES[name]()
    prompt, n, turns = _prompt(), 24, 2
    with _context(name, model):
        engine = ls.Engine(model, ls.ExecConfig(**EXEC))
        eos = _greedy_eos(engine, prompt)
        calls = []
        rollout = engine.generate(prompt, num_samples=3, max_new_tokens=n, temperature=0, eos_token_id=eos,
                                  environment=_environment(calls), max_turns=turns)
        for i in range(3):
            want, mask, made = _hf_episode(model, prompt, _environment([]), i, n=n, eos=eos, max_turns=turns)
            assert torch.equal(rollout.responses[i], want), (i, rollout.responses[i].tolist(), want.tolist())
            assert torch.equal(rollout.loss_masks[i], mask), i
            assert rollout.turns[i] == made, (i, rollout.turns, made)
        assert sum(rollout.turns) >= 3 and not all(m.all() for m in rollout.loss_masks)  # turns were taken
        assert len({r.numel() for r in rollout.responses}) > 1 or n == rollout.responses[0].numel()
        _check_logprobs(model, prompt, rollout, FLOAT64)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_sampled_episode_logprobs_equal_hf_full_sequence_and_masks_mark_sampled_tokens(name):
    model = FAMILIES[name]()
    prompt, n = _prompt(seed=1), 20
    with _context(name, model):
        engine = ls.Engine(model, ls.ExecConfig(**EXEC))
        eos = list(range(0, 97, 5))  # ~1 in 5 tokens ends a turn
        calls = []
        rollout = engine.generate(prompt, num_samples=4, max_new_tokens=n, temperature=0.9, eos_token_id=eos,
                                  environment=_environment(calls), max_turns=3,
                                  generator=torch.Generator().manual_seed(2))
        assert len(calls) == sum(rollout.turns) >= 2
        for i, (r, m) in enumerate(zip(rollout.responses, rollout.loss_masks)):
            assert r.numel() <= n and m.shape == r.shape and rollout.logprobs[i].shape == r.shape
            # masks: True exactly at the sampled tokens, i.e. outside the observations appended
            observed = torch.zeros_like(m)
            for b, seen, obs in calls:
                a, z = seen.numel(), seen.numel() + obs.numel()
                if b == i and z <= n:
                    assert torch.equal(seen, r[:a]) and torch.equal(r[a:z], obs)
                    observed[a:z] = True
            assert torch.equal(m, ~observed), i
        _check_logprobs(model, prompt, rollout, 1e-9, temperature=0.9)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefix_continues_from_the_same_state_without_a_second_capture(name):
    model = FAMILIES[name]()
    prompt, n = _prompt(seed=2), 14
    with _context(name, model):
        engine = ls.Engine(model, ls.ExecConfig(**EXEC))
        first = engine.generate(prompt, num_samples=1, max_new_tokens=n, temperature=0)
        prefix = torch.tensor([11, 3, 50, 8, 29])
        captures, capture = [], engine.capture
        engine.capture = lambda *a, **k: captures.append(1) or capture(*a, **k)
        mask = torch.tensor([True, False, True, True, False])
        more = engine.generate(prompt, num_samples=2, max_new_tokens=n, temperature=0, prefix=prefix,
                               prefix_loss_mask=mask, state=first.state)
        assert captures == [], "generate(state=...) captured the prompt again"
        want, _, _ = _hf_episode(model, prompt, None, 0, n=n, eos=None, max_turns=0, prefix=prefix.tolist())
        for r, m, lp in zip(more.responses, more.loss_masks, more.logprobs):
            assert torch.equal(r, want), (r.tolist(), want.tolist())
            assert torch.equal(m[:5], mask) and bool(m[5:].all())
            with torch.no_grad():  # prefix tokens too: their log-probs under the current weights
                torch.testing.assert_close(lp, hf_full_logprobs(model, prompt, r), rtol=0,
                                           atol=FLOAT64)
        sampled = engine.generate(prompt, num_samples=3, max_new_tokens=n, temperature=1.0, prefix=prefix,
                                  state=first.state, generator=torch.Generator().manual_seed(1))
        assert all(torch.equal(r[:5], prefix) and bool(m.all()) for r, m in zip(sampled.responses,
                                                                                sampled.loss_masks))
        assert len({tuple(r.tolist()) for r in sampled.responses}) > 1  # each branch its own state after the prefix
        _check_logprobs(model, prompt, sampled, FLOAT64)


def _poisoned(engine):
    """Fill every fresh branch state with NaN: a decode that reads a row its branch has not
    written (past a shorter branch's length) fails loudly."""
    new = engine.adapter.new_branch_state

    def poisoned(*args, **kwargs):
        branches = new(*args, **kwargs)
        for layer in branches.layers:
            for name in ("k", "v", "rows", "index_keys"):
                if getattr(layer, name, None) is not None:
                    getattr(layer, name).fill_(float("nan"))
        return branches
    engine.adapter.new_branch_state = poisoned


def _counted(engine, calls: list):
    """Record each DECODE call's branch positions (all at `start` when none are given)."""
    run = engine.adapter.run

    def counting(ids, start, states, *, phase, positions=None, **kwargs):
        if Phase(phase) is Phase.DECODE:
            calls.append(list(positions) if positions is not None else [start] * int(ids.numel()))
        return run(ids, start, states, phase=phase, positions=positions, **kwargs)
    engine.adapter.run = counting


# GLM-5 with dense MLPs: HF's float32 MoE router rounds differently for different batches
# of tokens (1.8e-7 here), which would hide the decode's own float64 agreement
TWIN_FAMILIES = dict(FAMILIES, glm_moe_dsa_sparse=lambda: tiny_mla("glm_moe_dsa", first_k_dense_replace=3))


@pytest.mark.parametrize("name", list(TWIN_FAMILIES))
def test_drifted_branches_decode_in_one_call_per_step_as_the_grouped_twin(name, monkeypatch):
    """Observations of different lengths put the branches at different positions. The
    episode still makes ONE decode call per step (each branch at its own position, RoPE
    and own-cache length) and gives the tokens, log-probs and masks of its naive twin,
    which makes one call per distinct position; branch state is NaN-poisoned."""
    model = TWIN_FAMILIES[name]()
    prompt, n = _prompt(seed=4), 18
    with _context(name, model):
        results = {}
        for mode in ("one", "grouped"):
            if mode == "grouped":
                monkeypatch.setattr(episode_module, "decode_live", episode_module.decode_live_grouped)
            engine = ls.Engine(model, ls.ExecConfig(**EXEC))
            _poisoned(engine)
            calls = []
            _counted(engine, calls)
            ro = engine.generate(prompt, num_samples=4, max_new_tokens=n, temperature=1.0,
                                 eos_token_id=list(range(0, 97, 6)), environment=_environment([]), max_turns=3,
                                 generator=torch.Generator().manual_seed(5))
            results[mode] = ro, calls
        (one, one_calls), (grouped, grouped_calls) = results["one"], results["grouped"]
        assert any(len(set(c)) > 1 for c in one_calls), one_calls  # the branches drifted apart
        assert len(one_calls) <= one.metrics["decode_steps"] + 1  # one call per step (+ the first logits)
        assert len(grouped_calls) > len(one_calls)  # the twin split a drifted step
        assert one.turns == grouped.turns and sum(one.turns) >= 3
        for a, b, la, lb, ma, mb in zip(one.responses, grouped.responses, one.logprobs, grouped.logprobs,
                                        one.loss_masks, grouped.loss_masks):
            assert torch.equal(a, b) and torch.equal(ma, mb), (a.tolist(), b.tolist())
            torch.testing.assert_close(la, lb, rtol=0, atol=1e-9)
        _check_logprobs(model, prompt, one, 1e-9)


def test_an_observation_is_absorbed_in_one_call_not_one_decode_step_per_token():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    eos = _greedy_eos(engine, prompt)
    runs, run = [], engine.adapter.run

    def counting(ids, start, states, *, phase, **kwargs):
        runs.append((Phase(phase), int(ids.numel()), start))
        return run(ids, start, states, phase=phase, **kwargs)

    engine.adapter.run = counting
    obs = torch.arange(40, 52)  # 12 tokens
    rollout = engine.generate(prompt, num_samples=1, max_new_tokens=30, temperature=0, eos_token_id=eos,
                              environment=lambda i, r: obs, max_turns=1)
    engine.adapter.run = run
    m = rollout.loss_masks[0]
    assert rollout.turns == [1] and int((~m).sum()) == 12
    absorbed = [t for p, t, start in runs if p is Phase.CAPTURE and start >= prompt.numel() - 1]  # not the prompt's
    decoded = [t for p, t, _ in runs if p is Phase.DECODE]
    assert absorbed == [13], runs  # eos + the observation, one chunk
    assert sum(decoded) == int(m.sum()) - 1, runs  # one decode token per sampled token but the turn's eos and the last


def test_an_observation_that_would_pass_max_new_tokens_is_not_appended():
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    eos = _greedy_eos(engine, prompt)
    first = engine.generate(prompt, num_samples=1, max_new_tokens=10, temperature=0, eos_token_id=eos).responses[0]
    k = first.numel()  # the first turn's length (it ends with eos)
    room = 10 - k

    def episode(env, g=1):
        return engine.generate(prompt, num_samples=g, max_new_tokens=10, temperature=0, eos_token_id=eos,
                               environment=env, max_turns=2)

    long = episode(lambda i, r: torch.arange(room + 1))
    assert torch.equal(long.responses[0], first) and long.turns == [1] and bool(long.loss_masks[0].all())
    exact = episode(lambda i, r: torch.arange(room))
    assert exact.responses[0].numel() == 10 and exact.loss_masks[0].tolist() == [True] * k + [False] * room
    ended = episode(lambda i, r: None if i == 0 else torch.arange(2), g=2)
    assert ended.turns[0] == 1 and torch.equal(ended.responses[0], first)
    assert ended.responses[1].numel() > k + 2 and ended.loss_masks[1][k:k + 2].tolist() == [False, False]


@pytest.mark.parametrize("obs, match", [
    (torch.tensor([3, 97]), "token id 97, outside the vocabulary"),
    (torch.tensor([-1]), "token id -1"),
    ([3, 4], "got list"),
    (torch.tensor([1.0, 2.0]), "float"),
    (torch.tensor([[1, 2]]), r"shape \(1, 2\)"),
])
def test_a_bad_observation_is_refused_before_it_is_absorbed(obs, match, monkeypatch):
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    prompt = _prompt()
    eos = _greedy_eos(engine, prompt)
    absorbed = []
    monkeypatch.setattr(episode_module, "absorb", lambda *a, **k: absorbed.append(1))
    with pytest.raises(ls.EpisodeError, match=match):
        engine.generate(prompt, num_samples=2, max_new_tokens=10, temperature=0, eos_token_id=eos,
                        environment=lambda i, r: obs, max_turns=1)
    assert absorbed == []


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(environment=lambda i, r: None, max_turns=-1, eos_token_id=1), ls.EpisodeError, "max_turns must be"),
    (dict(environment=lambda i, r: None, max_turns=True, eos_token_id=1), ls.EpisodeError, "max_turns must be"),
    (dict(environment=lambda i, r: None), ls.ConfigError, "pass eos_token_id"),
    (dict(environment="tool", eos_token_id=1), ls.EpisodeError, "must be callable"),
    (dict(prefix=torch.tensor([[1, 2]])), ls.EpisodeError, "1-D torch.LongTensor"),
    (dict(prefix=torch.tensor([1.0])), ls.EpisodeError, "1-D torch.LongTensor"),
    (dict(prefix=torch.tensor([1, 200])), ls.EpisodeError, "token id 200"),
    (dict(prefix=torch.arange(9)), ls.EpisodeError, "more than max_new_tokens=8"),
    (dict(prefix=torch.arange(3), prefix_loss_mask=torch.ones(2, dtype=torch.bool)), ls.EpisodeError,
     "prefix_loss_mask must be a bool tensor"),
    (dict(prefix_loss_mask=torch.ones(2, dtype=torch.bool)), ls.EpisodeError, "no prefix given"),
    (dict(state="not a state"), ls.StateMismatchError, "must be a prompt state"),
])
def test_bad_episode_input_is_refused_before_any_work(kwargs, error, match, monkeypatch):
    model = tiny_model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(**EXEC))
    monkeypatch.setattr(engine, "capture", lambda *a, **k: pytest.fail("captured before refusing"))
    monkeypatch.setattr(engine.adapter, "run", lambda *a, **k: pytest.fail("ran the model before refusing"))
    with pytest.raises(error, match=match):
        engine.generate(_prompt(), num_samples=2, max_new_tokens=8, **kwargs)


@pytest.mark.parametrize("name", ["qwen3_5", "glm_moe_dsa_sparse"])
def test_an_offloaded_prompt_state_gives_the_same_episode(name):
    model = FAMILIES[name]()
    prompt = _prompt()
    with _context(name, model):
        plain = ls.Engine(model, ls.ExecConfig(**EXEC))
        eos = _greedy_eos(plain, prompt)
        kwargs = dict(num_samples=2, max_new_tokens=16, temperature=0, eos_token_id=eos, max_turns=2)
        want = plain.generate(prompt, environment=_environment([]), **kwargs)
        got = ls.Engine(model, ls.ExecConfig(state_device="cpu", **EXEC)).generate(
            prompt, environment=_environment([]), **kwargs)
    assert sum(want.turns) >= 2
    for a, b, la, lb in zip(got.responses, want.responses, got.logprobs, want.logprobs):
        assert torch.equal(a, b)
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_an_episode_trains_with_its_masks_from_its_own_state(mode):
    """The whole agent iteration: a sampled multi-turn episode, then `step` on it with its
    own `loss_masks` and log-probs and its captured state (no second capture); loss and
    every grad equal HF's with TRL's masked loss (observation tokens: no term, no count)."""
    model = float64_norms(tiny_model("qwen3"))  # exact mode: HF's float32 norms would round (reference.py)
    prompt = _prompt(seed=3)
    engine = ls.Engine(model, ls.ExecConfig(**EXEC, mode=mode))
    calls = []
    rollout = engine.generate(prompt, num_samples=4, max_new_tokens=16, temperature=1.0,
                              eos_token_id=list(range(0, 97, 4)), environment=_environment(calls), max_turns=2,
                              generator=torch.Generator().manual_seed(5))
    assert sum(rollout.turns) >= 2 and any(not bool(m.all()) for m in rollout.loss_masks)
    group = ls.Group(prompt=prompt, responses=rollout.responses, loss_masks=rollout.loss_masks,
                     old_logprobs=[lp.detach() for lp in rollout.logprobs], rewards=torch.tensor([1.0, 0.0, 0.5, 0.25]))
    model.zero_grad(set_to_none=True)
    grpo = ls.GRPOConfig()
    result = engine.step(group, grpo, state=rollout.state if mode == "detached" else None)
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    reference = hf_cached_logprobs if mode == "detached" else hf_full_logprobs
    logps = [reference(model, prompt, r) for r in group.responses]
    loss = reference_grpo_loss(logps, group, loss_type=grpo.loss_type, epsilon_low=grpo.epsilon_low,
                               epsilon_high=grpo.epsilon_high, beta=grpo.beta, scale_rewards=grpo.scale_rewards,
                               max_completion_length=grpo.max_completion_length)
    loss.backward()
    assert_loss_close(result.loss, float(loss.detach()), 1e-9)
    assert_grads_close(got, grads_of(model), 1e-9)
