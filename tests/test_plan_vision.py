"""The planner's images in the prompt (`--images N --image-tokens T`, `plan/vision.py`):
the tower's parameter count equals HF's tower, its one-image graph estimate is within 10%
of the activations HF's tower saves, and the figures enter the static memory and a
"vision" phase; what the engine refuses, the planner refuses."""

import json

import pytest
import torch

from longstraw.cli import main
from longstraw.errors import ConfigError
from longstraw.plan import PlanConfig, estimate
from longstraw.plan.vision import QWEN3_5_TOWER, tower_parameters

STEP = dict(prompt_tokens=65536, group=8, response_tokens=1024)


def test_tower_parameters_are_hf_towers():
    """HF's default Qwen3.5 tower (Qwen3.5-27B's, built on meta; the tiny VLM's tower is
    counted in the next test)."""
    import transformers

    with torch.device("meta"):
        tower = transformers.Qwen3_5VisionModel._from_config(transformers.Qwen3_5VisionConfig(out_hidden_size=5120))
    assert tower_parameters(QWEN3_5_TOWER, 5120) == sum(p.numel() for p in tower.parameters())


def test_one_images_graph_estimate_is_within_ten_percent_of_hfs():
    """The planner's one-image graph (its "vision" phase in exact mode, less the block
    moment its backward adds) on the tiny VLM's own config, against the bytes HF's tower saves for
    backward over one 256-token image (float32, CPU; measured 0.92x)."""
    from longstraw.measure import saved_activation_bytes
    from longstraw.plan.config import resolve
    from longstraw.plan.vision import plan_vision
    from longstraw.tiny import tiny_vlm

    model = tiny_vlm()
    v = plan_vision(resolve(model.config.to_dict(), PlanConfig(prompt_tokens=2048, group=2, response_tokens=16,
                                                               mode="exact", dtype="fp32", images=2,
                                                               image_tokens=256)))
    grid = torch.tensor([[1, 32, 32]])  # 1024 patches, 256 merged tokens
    saved = saved_activation_bytes(lambda: torch.cat(model.model.get_image_features(
        torch.randn(1024, 1536), grid, return_dict=True).pooler_output).sum())
    estimated = v.graph
    assert v.params == sum(p.numel() for p in model.model.visual.parameters())
    assert abs(estimated - saved) <= 0.1 * saved, (estimated, saved)


@pytest.mark.parametrize("mode,lora", [("detached", 16), ("exact", None)])
def test_images_add_the_tower_the_rows_and_a_vision_phase(mode, lora):
    text = estimate("qwen3.6-27b", PlanConfig(**STEP, mode=mode, lora_rank=lora))
    r = estimate("qwen3.6-27b", PlanConfig(**STEP, mode=mode, lora_rank=lora, images=32, image_tokens=1024))
    assert r["vision_parameters"] == tower_parameters(QWEN3_5_TOWER, 5120)
    assert r["static_bytes_per_rank"] == pytest.approx(text["static_bytes_per_rank"] + r["vision_static_bytes"])
    rows = 32 * 1024 * 5120 * 2 + 65536 * 32 + (32 * 1024 * 5120 * 4 if mode == "exact" and lora is None else 0)
    assert r["vision_rows_bytes"] == rows
    phases = r["breakdown"]["phase_peak_bytes"]
    assert "vision" in phases and "vision" not in text["breakdown"]["phase_peak_bytes"]
    trained = lora is None
    assert (r["vision_static_bytes"] - r["vision_rows_bytes"] > 2 * r["vision_param_bytes"]) == trained  # + grads, Adam
    one = estimate("qwen3.6-27b", PlanConfig(**STEP, mode=mode, lora_rank=lora, images=1, image_tokens=1024))
    assert one["vision_working_bytes"] == r["vision_working_bytes"]  # the largest image's, not all of them


def test_images_where_the_engine_refuses_them():
    for kw, match in [(dict(images=1, image_tokens=0), "image_tokens"), (dict(images=64, image_tokens=1024), "fit"),
                      (dict(images=-1), ">= 0")]:
        with pytest.raises(ConfigError, match=match):
            estimate("qwen3.6-27b", PlanConfig(**STEP, **kw))
    with pytest.raises(ConfigError, match="text prompts only"):
        estimate("qwen3-8b", PlanConfig(**STEP, images=2, image_tokens=64))


def test_images_under_context_parallelism_and_offload_are_held_whole_on_the_device():
    """As the engine runs them: the tower, rows and largest image's working set on every
    rank under context parallelism, and on the device with an offloaded state."""
    one = estimate("qwen3.6-27b", PlanConfig(**STEP, mode="exact", images=8, image_tokens=1024))
    four = estimate("qwen3.6-27b", PlanConfig(**STEP, mode="exact", images=8, image_tokens=1024, gpus=4))
    host = estimate("qwen3.6-27b", PlanConfig(**STEP, mode="exact", images=8, image_tokens=1024, offload_state=True))
    for key in ("vision_static_bytes", "vision_rows_bytes", "vision_working_bytes"):
        assert four[key] == one[key] == host[key] > 0, key
    assert any("context parallelism" in a for a in four["assumptions"])


def test_cli_flags(capsys):
    assert main(["plan", "--model", "qwen3.6-27b", "--prompt-tokens", "65536", "--group", "8", "--response-tokens",
                 "1024", "--images", "16", "--image-tokens", "1024", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["inputs"]["images"] == 16 and r["vision_static_bytes"] > 0
    assert main(["plan", "--model", "qwen3.6-27b", "--prompt-tokens", "65536", "--group", "8", "--response-tokens",
                 "1024", "--images", "16", "--image-tokens", "1024"]) == 0
    assert "16 x 1,024 tokens: tower" in capsys.readouterr().out
