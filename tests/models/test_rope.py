"""Every rope_type transformers defines, on a tiny Llama (float64), at a chunk size that
splits the prompt, against HF's one-pass forward over the group (prompt + response,
right-padded to the longest: the frequencies of P + longest response at every position;
`longstraw/models/rope.py`). Length-dependent types ("dynamic", "longrope") on both
sides of their threshold; detached and exact mode; then rollouts.
"""

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import longstraw as ls
from tests.reference import compare_step, float64_norms, gather_logprobs, random_group, tiny_model

THRESHOLD = 32  # original_max_position_embeddings (longrope) / max_position_embeddings (dynamic)
_SCALED = dict(factor=2.0, original_max_position_embeddings=THRESHOLD)
ROPE = {  # head_dim 8: 4 frequencies
    "default": dict(max_position_embeddings=64),
    "linear": dict(max_position_embeddings=64, rope_parameters=dict(rope_type="linear", rope_theta=100.0, factor=2.0)),
    "dynamic": dict(max_position_embeddings=THRESHOLD, rope_parameters=dict(rope_type="dynamic", rope_theta=100.0,
                                                                             factor=2.0)),
    "yarn": dict(max_position_embeddings=64, rope_parameters=dict(rope_type="yarn", rope_theta=100.0, **_SCALED)),
    "longrope": dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=100.0, original_max_position_embeddings=THRESHOLD,
        short_factor=[1.0, 1.3, 1.7, 2.0], long_factor=[2.0, 4.0, 8.0, 16.0])),
    "llama3": dict(max_position_embeddings=64, rope_parameters=dict(rope_type="llama3", rope_theta=100.0,
                                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                                     **_SCALED)),
    "proportional": dict(max_position_embeddings=64, rope_parameters=dict(rope_type="proportional", rope_theta=100.0,
                                                                           factor=2.0, partial_rotary_factor=0.5)),
}
SIDES = {"short": (20, [3, 6]), "long": (30, [2, 9])}  # P + longest: 26 <= 32 < 39


def test_every_rope_type_is_covered():
    assert set(ROPE) == {"default", *ROPE_INIT_FUNCTIONS}


def padded_logprobs(length):
    """HF's one-pass forward over prompt + response right-padded to `length` tokens (a
    batch of the group): [R] log-probs of the response."""
    def reference(model, prompt, response):
        ids = torch.cat([prompt, response, torch.zeros(length - prompt.numel() - response.numel(), dtype=torch.long)])
        logits = model(ids[None]).logits[0, prompt.numel() - 1 : prompt.numel() - 1 + response.numel()]
        return gather_logprobs(logits, response, 1.0)
    return reference


def _model(rope):
    return float64_norms(tiny_model("llama", **ROPE[rope]))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("rope", sorted(ROPE))
def test_chunked_run_equals_hf_one_pass(rope, side):
    """score (log-probs), and exact mode's step (loss and every gradient: the reverse
    walk recomputes the prompt chunks with the same frequencies)."""
    model = _model(rope)
    prompt_len, lens = SIDES[side]
    group = random_group(97, prompt_len, lens, seed=3)
    cfg = ls.ExecConfig(chunk_size=7, attention_block_size=4, mode="exact", allow_position_overflow=True)
    reference = padded_logprobs(prompt_len + max(lens))
    with torch.no_grad():
        want = [reference(model, group.prompt, r) for r in group.responses]
    for got, w in zip(ls.Engine(model, cfg).score(group), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-10)
    compare_step(model, group, cfg, reference, 1e-9)


def test_the_threshold_changes_the_frequencies():
    """The long side really differs: HF's forward over the sequence cut at the short side
    gives other log-probs (the check above can fail)."""
    model = _model("longrope")
    prompt_len, lens = SIDES["long"]
    group = random_group(97, prompt_len, lens, seed=3)
    with torch.no_grad():
        long = padded_logprobs(prompt_len + max(lens))(model, group.prompt, group.responses[0])
        short = padded_logprobs(THRESHOLD)(model, group.prompt, group.responses[0])
    assert (long - short).abs().max() > 1e-3


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_rollout_uses_the_frequencies_of_prompt_plus_max_new_tokens(rope):
    """generate pins the frequencies to P + max_new_tokens (here across the threshold:
    the prompt alone is on the short side); its log-probs are HF's one-pass forward over
    that length, `step(state=rollout.state)` and `score` reuse them, and a group longer
    than the state's length is refused before any work."""
    model = _model(rope)
    prompt = random_group(97, 26, [1], seed=5).prompt
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=7, allow_position_overflow=True))
    out = engine.generate(prompt, num_samples=2, max_new_tokens=10, generator=torch.Generator().manual_seed(0))
    reference = padded_logprobs(26 + 10)
    group = ls.Group(prompt=prompt, responses=out.responses, rewards=torch.tensor([1.0, 0.0], dtype=torch.float64))
    with torch.no_grad():
        want = [reference(model, prompt, r) for r in out.responses]
    for got, scored, w in zip(out.logprobs, engine.score(group, state=out.state), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-10)
        torch.testing.assert_close(scored, w, rtol=0, atol=1e-10)
    longer = ls.Group(prompt=prompt, responses=[torch.arange(11), torch.arange(3)], rewards=torch.tensor([1.0, 0.0]))
    with pytest.raises(ls.StateMismatchError, match="36-position"):
        engine.step(longer, state=out.state)
    assert all(p.grad is None for p in model.parameters())
