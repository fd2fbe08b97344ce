"""Where the model's weights live: LongStraw runs a model whose every parameter sits on
one device, outside any accelerate hook. Anything else is refused when the `Engine` is
built, with the fix, instead of a cryptic error mid-capture:

    accelerate hooks (`cpu_offload`, `disk_offload`, `dispatch_model`, a `device_map`
    that offloads)   the hooks move weights and inputs around each module's forward,
                     which LongStraw bypasses (it calls the decoder layers' parts itself:
                     "unknown device type for autocast" and the like)
    `hf_device_map` over more than one device (several GPUs, or "cpu"/"disk" entries
    beside a GPU)    all state would live on the embedding's device
    parameters on the meta device   weights never loaded
    parameters on several devices   as a multi-device map

A map onto one device (`device_map="cuda:0"`, `{"": 0}`) installs no hooks and is fine.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError

_FIX = ("load the model onto one device (device_map=None, or device_map={'': 'cuda:0'}, then model.to(...)); "
        "to fit a larger model, shard it with FSDP2 per decoder layer or offload the prompt state "
        "(ExecConfig(state_device='cpu'))")


def placement_problem(devices: set[str], device_map: dict | None, hooked: list[str]) -> str | None:
    """Why a model with parameters on `devices`, this `hf_device_map` and accelerate hooks
    on the modules named `hooked` cannot run, or None when it can (pure, for tests)."""
    if hooked:
        names = ", ".join(repr(n) for n in hooked[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
        return (f"the model is managed by accelerate hooks (on {names}: cpu_offload, disk_offload, dispatch_model "
                f"or an offloading device_map); LongStraw calls the layers' parts itself and cannot run through them")
    if device_map:
        targets = sorted({str(v) for v in device_map.values()})
        if len(targets) > 1:
            return (f"the model is spread over several devices by its device_map ({', '.join(targets)}); "
                    f"LongStraw keeps all state on one device")
    if "meta" in devices:
        return "some parameters are on the meta device (weights never loaded, e.g. init_empty_weights)"
    if len(devices) > 1:
        return f"the parameters are on several devices ({', '.join(sorted(devices))}); LongStraw runs on one"
    return None


def check_placement(model: nn.Module) -> None:
    """Raise `UnsupportedModelError` (with the fix) unless every parameter of `model` (a
    ...ForCausalLM, PEFT-wrapped or not) is on one device, outside accelerate hooks."""
    hooked = [name or type(model).__name__ for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    device_map = None
    for m in (model, getattr(model, "get_base_model", lambda: model)()):
        device_map = device_map or getattr(m, "hf_device_map", None)
    devices = {str(p.device) for p in model.parameters()}
    problem = placement_problem(devices, device_map if isinstance(device_map, dict) else None, hooked)
    if problem is not None:
        raise UnsupportedModelError(f"{problem}. Fix: {_FIX}.")
