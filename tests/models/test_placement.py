"""`models/placement.py`: hook-managed and multi-device models are refused with
`UnsupportedModelError` when the `Engine` is built (before any work, `.grad`
untouched), with the fix in the message; a model on one device, or mapped onto one
device, runs."""

import pytest
import torch
from torch import nn

import longstraw as ls
from longstraw.models.placement import placement_problem
from tests.reference import random_group, tiny_model


def _refused(model, match: str):
    with pytest.raises(ls.UnsupportedModelError, match=match) as info:
        ls.Engine(model, ls.ExecConfig(chunk_size=4))
    assert "Fix: load the model onto one device" in str(info.value)
    return info


def test_accelerate_cpu_offload_is_refused_at_construction():
    """accelerate's cpu_offload installs hooks on every module (here with the CPU as the
    execution device, so it runs without CUDA); without the check the step fails later
    with "unknown device type for autocast"."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("qwen3", num_hidden_layers=2)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert any(hasattr(m, "_hf_hook") for m in model.modules())
    _refused(model, "accelerate hooks")


def test_a_device_map_over_several_devices_is_refused():
    model = tiny_model("qwen3", num_hidden_layers=2)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    _refused(model, r"several devices by its device_map \(0, 1\)")
    model.hf_device_map = {"model": 0, "lm_head": "cpu"}
    _refused(model, r"device_map \(0, cpu\)")
    model.hf_device_map = {"model": 0, "lm_head": "disk"}
    _refused(model, r"device_map \(0, disk\)")


def test_a_device_map_onto_one_device_runs():
    model = tiny_model("qwen3", num_hidden_layers=2)
    model.hf_device_map = {"": "cpu"}
    group = random_group(97, 9, [3, 2])
    want = ls.Engine(tiny_model("qwen3", num_hidden_layers=2), ls.ExecConfig(chunk_size=4)).step(group).loss
    assert ls.Engine(model, ls.ExecConfig(chunk_size=4)).step(group).loss == want


def test_meta_parameters_are_refused_and_grad_is_untouched():
    model = tiny_model("qwen3", num_hidden_layers=2)
    layer = model.model.layers[1].mlp.down_proj
    layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device="meta"))
    model.model.layers[0].mlp.up_proj.weight.grad = torch.ones_like(model.model.layers[0].mlp.up_proj.weight)
    _refused(model, "meta device")
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight.grad,
                       torch.ones_like(model.model.layers[0].mlp.up_proj.weight))


def test_peft_wrapped_hooked_model_is_refused():
    accelerate = pytest.importorskip("accelerate")
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen3", num_hidden_layers=2)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    accelerate.cpu_offload(model.get_base_model(), execution_device=torch.device("cpu"))
    _refused(model, "accelerate hooks")


@pytest.mark.parametrize("devices,device_map,hooked,want", [
    ({"cuda:0"}, None, [], None),
    ({"cpu"}, {"": "cpu"}, [], None),
    ({"cuda:0"}, {"model": 0, "lm_head": 0}, [], None),
    ({"cuda:0", "cuda:1"}, None, [], "several devices (cuda:0, cuda:1)"),
    ({"cuda:0", "cpu"}, None, [], "several devices (cpu, cuda:0)"),
    ({"cuda:0"}, {"model.layers.0": 0, "model.layers.1": 1}, [], "device_map (0, 1)"),
    ({"cuda:0", "meta"}, None, [], "meta device"),
    ({"cuda:0"}, None, ["model.layers.0", "model.layers.1", "lm_head", "model.norm"], "and 1 more"),
])
def test_placement_table(devices, device_map, hooked, want):
    got = placement_problem(devices, device_map, hooked)
    assert got is None if want is None else want in got
