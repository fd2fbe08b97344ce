"""Images in `ls.fit_config` (issue 43 item 6f, issue 45's image rows in the budget): the
planned step of a tiny VLM with screenshots in the prompt against its live tensors, and
`fit_config(images=...)` / `fit_config(prompt_inputs=...)` refusing a budget the text step
fits but the images do not."""

import pytest
import torch

import longstraw as ls
from longstraw.errors import ConfigError, DoesNotFitError
from longstraw.plan import PlanConfig, estimate
from longstraw.plan.config import resolve
from longstraw.plan.vision import plan_vision
from longstraw.tiny import tiny_vlm
from longstraw.tiny_vision import screenshot_prompt

G, R = 2, 16


def vlm_step(mode: str, P: int, images: int, image_tokens: int) -> tuple[float, float, float]:
    """(planned with the images, planned as text, measured) bytes of one `Engine.step` of
    the tiny VLM beyond its weights and gradients (allocated before: a later group), no
    optimizer. The pixels are float64, so the tower casts a copy as it copies them to the
    device on a GPU (the planner counts that copy)."""
    from bench.live_peak import live_tensor_peak

    model = tiny_vlm()
    prompt, inputs = screenshot_prompt(P, images, image_tokens)
    inputs["pixel_values"] = inputs["pixel_values"].double()
    g = torch.Generator().manual_seed(0)
    group = ls.Group(prompt=prompt, responses=[torch.randint(0, 4000, (R,), generator=g) for _ in range(G)],
                     rewards=torch.rand(G, generator=g), prompt_inputs=inputs)
    engine = ls.Engine(model, ls.ExecConfig(mode=mode, chunk_size=1024))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    measured = live_tensor_peak(lambda: engine.step(group, ls.GRPOConfig()))
    planned = []
    for n in (images, 0):
        c = PlanConfig(prompt_tokens=P, group=G, response_tokens=R, dtype="float32", mode=mode, chunk_size=1024,
                       images=n, image_tokens=image_tokens if n else 0)
        r = estimate(model.config.to_dict(), c)
        v = plan_vision(resolve(model.config.to_dict(), c))
        tower = v.param_bytes + v.grad_bytes + v.optimizer_bytes if v else 0.0
        planned.append(r["peak_bytes_per_rank"] - r["param_bytes"] - r["grad_bytes"] - r["optimizer_bytes"] - tower)
    return planned[0], planned[1], measured


@pytest.mark.slow
def test_the_planned_vlm_step_matches_its_live_tensors():
    """One screenshot of 256 tokens (1,024 patches) in a 384-token prompt, detached: its
    tower's no-grad pass at capture is the step's peak. When written, planned / measured
    0.97; planned as a text prompt, 0.80. (Exact mode at P = 1,280 with a 1,024-token image
    plans 1.20x, the text plan of the same step 1.17x: the walk's known CPU overestimate,
    `tests/test_plan_live.py`, binds there, not the images.)"""
    planned, as_text, measured = vlm_step("detached", 384, 1, 256)
    assert abs(planned / measured - 1) <= 0.10, (planned, measured)
    assert as_text / measured < 0.9  # the images are what the text plan misses


def test_fit_config_plans_the_images_and_refuses_a_budget_only_the_text_fits():
    model = tiny_vlm()
    prompt, inputs = screenshot_prompt(4096, 8, 256)
    step = dict(prompt_tokens=4096, group=4, response_tokens=256, mode="exact")
    with pytest.raises(DoesNotFitError) as text:
        ls.fit_config(model, memory_budget=1, **step)
    budget = text.value.smallest_budget
    ls.fit_config(model, memory_budget=budget, **step)
    with pytest.raises(DoesNotFitError, match="8 image") as with_images:
        ls.fit_config(model, memory_budget=budget, prompt_inputs=inputs, **step)
    need = with_images.value.smallest_budget
    rows = 8 * 256 * 256 * (4 + 4)  # the image rows and (exact, a trained tower) their fp32 gradient
    assert need >= budget + rows
    assert ls.fit_config(model, memory_budget=need, prompt_inputs=inputs, **step) == ls.fit_config(
        model, memory_budget=need, images=8, image_tokens=256, **step)  # the grid gives N and T


def test_fit_config_refuses_bad_image_arguments():
    model = tiny_vlm()
    _, inputs = screenshot_prompt(1024, 1, 64)
    step = dict(memory_budget="1GiB", prompt_tokens=1024, group=2, response_tokens=16)
    for kw, match in [(dict(images=-1), "images"), (dict(images=1, image_tokens=64, prompt_inputs=inputs), "not both"),
                      (dict(prompt_inputs={"pixel_values": inputs["pixel_values"]}), "image_grid_thw")]:
        with pytest.raises(ConfigError, match=match):
            ls.fit_config(model, **step, **kw)
    from longstraw.tiny import tiny_model

    with pytest.raises(ConfigError, match="vision_config"):
        ls.fit_config(tiny_model("qwen3"), **step, prompt_inputs=inputs)
