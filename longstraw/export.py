"""`longstraw export CHECKPOINT OUT`: a training checkpoint to a Hugging Face folder
(`config.json`, `model.safetensors`, the tokenizer where one is known) that
`AutoModelForCausalLM.from_pretrained(OUT)` loads.

Checkpoints read:

* a DCP folder (`.metadata` inside) as `examples/torchrun_grpo.py` writes it (its
  `step-N`, any world size: `dcp_to_torch_save` joins the shards), whose "model" entry is
  the model's state dict. DCP holds no architecture: `--model` names it, as the template's
  `--model` did (`tiny:<family>`, or an HF folder / config.json), with the vocabulary
  taken from the embedding's rows and `--max-position-embeddings` the run's positions;
* a `longstraw train` checkpoint (`checkpoint.pt`, or the folder holding it): its own
  `TrainConfig` rebuilds the preset model (`warm.build_model`), no `--model` needed;
* a PEFT adapter folder (`adapter_config.json`: a `longstraw grpo --use_peft` checkpoint-N
  or output_dir): written again as an adapter folder, or with `--merge` merged into its
  base model (`base_model_name_or_path`) as a plain HF folder.

The state dict must match the architecture exactly (strict load: a missing or extra key,
or a shape, is a `CheckpointError` before anything is written).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
import transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from longstraw.checkpoint import load_checkpoint
from longstraw.errors import CheckpointError, ConfigError
from longstraw.tiny import tiny_model
from longstraw.train import TrainConfig
from longstraw.warm import build_model

LOOP_FILE = "checkpoint.pt"


def _embed_rows(state: dict) -> int | None:
    rows = [t.shape[0] for k, t in state.items() if k.endswith("embed_tokens.weight") and t.dim() == 2]
    return rows[0] if rows else None


def read_dcp_model_state(folder: str) -> dict:
    """The "model" state dict of a DCP checkpoint folder, shards joined (no process group)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(folder, path)
        state = torch.load(path, weights_only=True)
    if "model" not in state or not isinstance(state["model"], dict):
        raise CheckpointError(f"{folder}: a DCP checkpoint without a 'model' entry (it has {sorted(state)})")
    return state["model"]


def model_for_dcp(spec: str | None, state: dict, positions: int | None):
    """The architecture for a DCP checkpoint: `tiny:<family>` or an HF folder / config.json."""
    if spec is None:
        raise ConfigError("a DCP checkpoint holds no architecture: pass --model tiny:<family> or the HF folder / "
                          "config.json the run built its model from")
    overrides = {"vocab_size": _embed_rows(state)} if _embed_rows(state) else {}
    if positions is not None:
        overrides["max_position_embeddings"] = positions
    if spec.startswith("tiny:"):
        return tiny_model(spec[5:], dtype=next(iter(state.values())).dtype, **overrides)
    try:
        config = transformers.AutoConfig.from_pretrained(spec, **overrides)
    except Exception as exc:
        raise ConfigError(f"--model {spec}: cannot read a config ({type(exc).__name__}: {exc})") from None
    return transformers.AutoModelForCausalLM.from_config(config).to(next(iter(state.values())).dtype)


def load_source(checkpoint: str, model_spec: str | None, positions: int | None):
    """(model with the checkpoint's weights, tokenizer source or None) for any checkpoint kind."""
    if os.path.isdir(checkpoint) and os.path.isfile(os.path.join(checkpoint, LOOP_FILE)):
        checkpoint = os.path.join(checkpoint, LOOP_FILE)
    if os.path.isfile(checkpoint):
        ckpt = load_checkpoint(checkpoint)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
            raise CheckpointError(f"{checkpoint}: not a `longstraw train` checkpoint (no 'model' and 'config')")
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        model = build_model(TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in names}))
        state = ckpt["model"]
    elif os.path.isdir(checkpoint) and os.path.isfile(os.path.join(checkpoint, ".metadata")):
        state = read_dcp_model_state(checkpoint)
        model = model_for_dcp(model_spec, state, positions)
    else:
        raise CheckpointError(f"{checkpoint}: neither a DCP checkpoint folder (.metadata) nor a `longstraw train` "
                              f"checkpoint ({LOOP_FILE})")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape
        raise CheckpointError(f"{checkpoint}: its weights do not fit the architecture ({exc}); check --model and "
                              "--max-position-embeddings") from None
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{checkpoint}: its weights do not match the architecture (missing "
                              f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}); check --model "
                              "and --max-position-embeddings")
    tokenizer = model_spec if model_spec and os.path.isdir(model_spec) else None
    return model.eval(), tokenizer


def load_adapter(folder: str, merge: bool):
    """A PEFT adapter folder with its base model (float dtype as saved); merged with `merge`."""
    from peft import AutoPeftModelForCausalLM

    try:
        loaded = AutoPeftModelForCausalLM.from_pretrained(folder, dtype="auto")
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load the adapter with its base model ({type(exc).__name__}: "
                              f"{exc})") from None
    return (loaded.merge_and_unload() if merge else loaded).eval()


def _tokenizer_source(*folders):
    return next((f for f in folders if f and os.path.isfile(os.path.join(f, "tokenizer_config.json"))), None)


def export(checkpoint: str, out: str, *, model: str | None = None, tokenizer: str | None = None,
           max_position_embeddings: int | None = None, merge: bool = False) -> str:
    """Write `out` as an HF folder (safetensors, config, tokenizer if known; an adapter
    folder for a PEFT adapter unless `merge`); returns `out`."""
    if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        loaded = load_adapter(checkpoint, merge)
        base = getattr(loaded, "peft_config", {}).get("default")
        known_tokenizer = _tokenizer_source(checkpoint, getattr(base, "base_model_name_or_path", None),
                                            getattr(loaded.config, "_name_or_path", None))
    elif merge:
        raise ConfigError(f"--merge: {checkpoint} holds no PEFT adapter (no adapter_config.json)")
    else:
        loaded, known_tokenizer = load_source(checkpoint, model, max_position_embeddings)
    loaded.save_pretrained(out)
    source = tokenizer or known_tokenizer
    if source is not None:
        try:
            transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
        except Exception as exc:
            if tokenizer is not None:  # asked for: say so; a model folder without one is fine
                raise ConfigError(f"--tokenizer {tokenizer}: cannot load it ({type(exc).__name__}: {exc})") from None
    return out
