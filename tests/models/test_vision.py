"""Images in the shared prompt (issue 39): Qwen3.5's `...ForConditionalGeneration`, its
vision tower and M-RoPE, against HF's own forward over prompt + response with the same
pixels, float64 with HF's float32 casts made float64 (`float64_throughout`, FLOAT64).

The prompt holds two images of different grids ((1, 4, 4): 4 tokens on a 2 x 2 M-RoPE
grid; (1, 2, 6): 3 tokens on 1 x 3) between text, so chunk sizes 1, 3, 5 and 6 cut
through images and text around them, and the height / width axes differ.
"""

import pytest
import torch

import longstraw as ls
from tests.reference import FLOAT64, compare_step, float64_throughout, grads_of
from tests.vision_reference import (
    IMAGE,
    hf_vlm_cached_logprobs,
    hf_vlm_full_logprobs,
    hf_vlm_greedy,
    image_prompt,
    text_responses,
    tiny_vlm,
)

LAYOUT = [3, "img", 2, "img", 4]
GRIDS = [(1, 4, 4), (1, 2, 6)]


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


def _group(lengths=(4, 1, 6), seed=0):
    prompt, inputs = image_prompt(LAYOUT, grids=GRIDS, seed=seed)
    return ls.Group(prompt=prompt, responses=text_responses(lengths, seed=seed + 1),
                    rewards=torch.tensor([1.0, 0.0, 0.5][:len(lengths)]), prompt_inputs=inputs)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 6, 64])
def test_score_matches_hf_full_forward(vlm, chunk_size):
    group = _group()
    with float64_throughout(vlm), torch.no_grad():
        got = ls.Engine(vlm, ls.ExecConfig(chunk_size=chunk_size, attention_block_size=4)).score(group)
        for s, r in zip(got, group.responses):
            want = hf_vlm_full_logprobs(vlm, group.prompt, r, group.prompt_inputs)
            torch.testing.assert_close(s, want, rtol=FLOAT64, atol=FLOAT64)


def test_exact_step_matches_full_backward_vision_tower_included(vlm):
    group = _group()
    with float64_throughout(vlm):
        compare_step(vlm, group, ls.ExecConfig(chunk_size=5, attention_block_size=4, mode="exact"),
                     lambda m, p, r: hf_vlm_full_logprobs(m, p, r, group.prompt_inputs), FLOAT64)
        compare_step(vlm, group, ls.ExecConfig(chunk_size=5, mode="exact", share_response_prefixes=False,
                                               branch_chunk_size=2),
                     lambda m, p, r: hf_vlm_full_logprobs(m, p, r, group.prompt_inputs), FLOAT64)
    tower = {n: g for n, g in grads_of(vlm).items() if ".visual." in n}
    assert tower and all(g is not None and g.abs().max() > 0 for g in tower.values())  # the reference's


def test_detached_step_matches_hf_cached_continuation(vlm):
    group = _group(lengths=(4, 2, 6))  # HF's one-token cached GDN step writes its state in place
    config = ls.ExecConfig(chunk_size=3, attention_block_size=4)
    with float64_throughout(vlm):
        vlm.zero_grad(set_to_none=True)
        ls.Engine(vlm, config).step(group)
        assert all(g is None for n, g in grads_of(vlm).items() if ".visual." in n)  # the tower ran without grad
        compare_step(vlm, group, config, lambda m, p, r: hf_vlm_cached_logprobs(m, p, r, group.prompt_inputs),
                     FLOAT64)


def test_greedy_generate_matches_hf_generate(vlm):
    prompt, inputs = image_prompt(LAYOUT, grids=GRIDS, seed=4)  # greedy emits no special token
    with float64_throughout(vlm):
        engine = ls.Engine(vlm, ls.ExecConfig(chunk_size=4))
        rollout = engine.generate(prompt, num_samples=2, max_new_tokens=6, temperature=0, prompt_inputs=inputs)
        want = hf_vlm_greedy(vlm, prompt, inputs, 6)
        assert all(torch.equal(r, want) for r in rollout.responses), ([r.tolist() for r in rollout.responses], want)
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]),
                         prompt_inputs=inputs)
        fork = engine.generate(prompt, num_samples=1, max_new_tokens=6, temperature=0, prefix=want[:2],
                               state=rollout.state, prompt_inputs=inputs)  # a fork from the same state
        assert torch.equal(fork.responses[0], want)
        reused = engine.score(group, state=rollout.state)  # the rollout's state, no second capture
        with torch.no_grad():
            torch.testing.assert_close(reused[0], hf_vlm_full_logprobs(vlm, prompt, want, inputs),
                                       rtol=FLOAT64, atol=FLOAT64)


def test_a_state_remembers_its_inputs(vlm):
    group = _group(lengths=(3, 2))
    engine = ls.Engine(vlm, ls.ExecConfig(chunk_size=4))
    state = engine.capture(group.prompt, prompt_inputs=group.prompt_inputs)
    assert state.nbytes() >= state.inputs.nbytes() > 0
    engine.score(group, state=state)  # the same inputs: fine
    other = dict(group.prompt_inputs, pixel_values=group.prompt_inputs["pixel_values"] + 1)
    for inputs in (other, None):
        with pytest.raises(ls.StateMismatchError, match="prompt_inputs"):
            engine.score(ls.Group(prompt=group.prompt, responses=group.responses, prompt_inputs=inputs), state=state)
    text = engine.capture(group.prompt)  # captured without images: refused for a group with them
    with pytest.raises(ls.StateMismatchError, match="prompt_inputs"):
        engine.score(group, state=text)


def _bad(inputs, **change):
    out = dict(inputs)
    out.update(change)
    return {k: v for k, v in out.items() if v is not None}


def test_bad_inputs_are_refused_before_any_work(vlm):
    prompt, inputs = image_prompt(LAYOUT, grids=GRIDS)
    types, pixels = inputs["mm_token_type_ids"], inputs["pixel_values"]
    shifted = types.clone()
    shifted[3], shifted[2] = 0, 1
    cases = [
        ("not a dict", ls.PromptInputsError, "dict"),
        (_bad(inputs, pixel_value=pixels), ls.PromptInputsError, "unknown keys"),
        (_bad(inputs, image_grid_thw=None), ls.PromptInputsError, "lacks"),
        (_bad(inputs, pixel_values=pixels[:-1]), ls.PromptInputsError, "shape"),
        (_bad(inputs, pixel_values=pixels[:, :-1]), ls.PromptInputsError, "shape"),
        (_bad(inputs, pixel_values=pixels.long()), ls.PromptInputsError, "floating"),
        (_bad(inputs, image_grid_thw=inputs["image_grid_thw"].double()), ls.PromptInputsError, "integer"),
        (_bad(inputs, image_grid_thw=torch.tensor([[1, 4, 4], [1, 3, 6]])), ls.PromptInputsError, "multiples"),
        (_bad(inputs, image_grid_thw=torch.tensor([[1, 2, 6], [1, 4, 4]])), ls.PromptInputsError, "runs"),
        (_bad(inputs, mm_token_type_ids=shifted), ls.PromptInputsError, "same tokens"),
        (_bad(inputs, mm_token_type_ids=types[:-1]), ls.PromptInputsError, "shape"),
        (_bad(inputs, pixel_values_videos=pixels), ls.UnsupportedInputError, "videos"),
    ]
    engine = ls.Engine(vlm, ls.ExecConfig(mode="exact"))
    vlm.zero_grad(set_to_none=True)
    for bad, error, match in cases:
        group = ls.Group(prompt=prompt, responses=text_responses([3]), rewards=torch.tensor([1.0]),
                         prompt_inputs=bad)
        for call in (lambda: engine.step(group), lambda: engine.score(group),
                     lambda: engine.generate(prompt, num_samples=1, max_new_tokens=2, prompt_inputs=bad)):
            with pytest.raises(error, match=match):
                call()
    assert all(p.grad is None for p in vlm.parameters())
    ends_on_image, last = image_prompt([3, "img"], grids=[(1, 4, 4)])
    last["mm_token_type_ids"], ends_on_image = last["mm_token_type_ids"][:-1], ends_on_image[:-1]
    with pytest.raises(ls.PromptInputsError, match="last token"):
        engine.capture(ends_on_image, prompt_inputs=last)


def test_images_in_responses_and_on_other_families_are_refused(vlm):
    group = _group(lengths=(3, 2))
    with_image = [group.responses[0], torch.tensor([5, IMAGE])]
    engine = ls.Engine(vlm)
    with pytest.raises(ls.UnsupportedInputError, match=r"responses\[1\].*prompt only"):
        engine.step(ls.Group(prompt=group.prompt, responses=with_image, rewards=torch.tensor([1.0, 0.0]),
                             prompt_inputs=group.prompt_inputs))
    with pytest.raises(ls.UnsupportedInputError, match="prefix"):
        engine.generate(group.prompt, num_samples=1, max_new_tokens=3, prefix=torch.tensor([IMAGE]))
    import transformers

    from tests.reference import tiny_family, tiny_hybrid

    text_only = ls.Engine(tiny_hybrid("qwen3_5"))
    with pytest.raises(ls.UnsupportedInputError, match="text prompts only"):
        text_only.score(group)
    gemma = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=tiny_family("gemma3_text").config.to_dict(), mm_tokens_per_image=4,
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4))).double().eval()
    with pytest.raises(ls.UnsupportedInputError, match="bidirectionally"):  # Gemma 3: refused, with the reason
        ls.Engine(gemma).score(group)


def test_an_offloaded_state_with_images(vlm):
    """State offload (`state_device="cpu"`): the per-token rows staged from host memory,
    the image rows on the model's device; both modes equal HF's (full backward / cached
    continuation)."""
    group = _group(lengths=(4, 2, 6))
    with float64_throughout(vlm):
        for mode, reference in (("exact", hf_vlm_full_logprobs), ("detached", hf_vlm_cached_logprobs)):
            config = ls.ExecConfig(chunk_size=5, attention_block_size=4, mode=mode, state_device="cpu")
            result = compare_step(vlm, group, config, lambda m, p, r: reference(m, p, r, group.prompt_inputs),
                                  FLOAT64)
            assert result.metrics["offload_h2d_bytes"] > 0, mode


def test_agent_episode_over_screenshots_with_a_tool_observation(vlm):
    """A prompt of three screenshots; the branches call a tool (its observation is text,
    loss mask False) and go on: the rollout's log-probs and the exact step equal HF's
    full forward over prompt + episode with the same pixels."""
    prompt, inputs = image_prompt([2, "img", 3, "img", 1, "img", 2], grids=[(1, 4, 4), (1, 2, 6), (1, 4, 2)], seed=5)
    observation = torch.tensor([11, 12, 13])
    with float64_throughout(vlm):
        engine = ls.Engine(vlm, ls.ExecConfig(chunk_size=7, mode="exact"))
        rollout = engine.generate(prompt, num_samples=2, max_new_tokens=12, temperature=0.8,
                                  generator=torch.Generator().manual_seed(0), eos_token_id=list(range(0, 90, 6)),
                                  environment=lambda i, r: observation, max_turns=1, prompt_inputs=inputs)
        assert sum(rollout.turns) > 0 and not any(bool((r == IMAGE).any()) for r in rollout.responses)
        with torch.no_grad():
            for r, lp, mask in zip(rollout.responses, rollout.logprobs, rollout.loss_masks):
                want = hf_vlm_full_logprobs(vlm, prompt, r, inputs, temperature=0.8)
                torch.testing.assert_close(lp[mask], want[mask], rtol=FLOAT64, atol=FLOAT64)
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0]),
                         loss_masks=rollout.loss_masks, prompt_inputs=inputs)
        compare_step(vlm, group, engine.config, lambda m, p, r: hf_vlm_full_logprobs(m, p, r, inputs), FLOAT64)


def test_exact_step_with_kept_capture_graphs(vlm):
    """The chunks whose capture graph is kept: their image rows' gradient flows, in the
    walk, from that graph rather than from a recompute."""
    group = _group(lengths=(3, 5))
    with float64_throughout(vlm):
        result = compare_step(vlm, group, ls.ExecConfig(chunk_size=4, mode="exact", keep_graph_bytes=1 << 30),
                              lambda m, p, r: hf_vlm_full_logprobs(m, p, r, group.prompt_inputs), FLOAT64)
    assert result.metrics["state_grad_bytes"] > 0


def test_recomputed_layers_change_nothing_with_images():
    """Layers recomputed in backward (replay pieces, walk chunks) against the same step
    without: equal loss and .grad, the tower's included. (Outside `float64_throughout`:
    the recompute runs in backward, where its float32 -> float64 mode is not active; the
    norms are made float64 for the model's lifetime instead.)"""
    from tests.models.test_recompute import assert_recompute_changes_nothing
    from tests.reference import float64_hybrid_norms

    group = _group(lengths=(3, 5))
    assert_recompute_changes_nothing(float64_hybrid_norms(tiny_vlm()), group,
                                     dict(chunk_size=4, mode="exact", branch_chunk_size=2), rel=FLOAT64)


def test_a_frozen_tower_gets_no_backward_and_no_gradient_buffer():
    """The tower frozen (LoRA on the text model trains nothing else): the exact step still
    equals HF's full backward, and the state holds no image-row gradient."""
    model = tiny_vlm()
    model.model.visual.requires_grad_(False)
    group = _group(lengths=(3, 2))
    with float64_throughout(model):
        frozen = compare_step(model, group, ls.ExecConfig(chunk_size=5, mode="exact"),
                              lambda m, p, r: hf_vlm_full_logprobs(m, p, r, group.prompt_inputs), FLOAT64)
    with float64_throughout(model):
        model.model.visual.requires_grad_(True)
        trained = ls.Engine(model, ls.ExecConfig(chunk_size=5, mode="exact")).step(group)
    rows = sum(n for _, n in ls.Engine(model).capture(group.prompt, prompt_inputs=group.prompt_inputs).inputs.spans)
    assert trained.metrics["state_grad_bytes"] - frozen.metrics["state_grad_bytes"] == rows * 32 * 8


def test_qwen3_5_moe_images():
    moe = tiny_vlm(moe=True)
    group = _group(lengths=(3, 4))
    with float64_throughout(moe):
        compare_step(moe, group, ls.ExecConfig(chunk_size=5, mode="exact"),
                     lambda m, p, r: hf_vlm_full_logprobs(m, p, r, group.prompt_inputs), FLOAT64)
