"""What the rank fork server of `tests/ranks.py` imports once: torch, transformers, the
model module of every supported `model_type`, longstraw and the test workers; and, where
installed, TRL's GRPOTrainer and LongStraw's trainer (~2 CPU-seconds a rank otherwise,
paid by every rank of the trainer tests in tests/integrations). That import starts one
thread, pyarrow's jemalloc background thread (through datasets), which a forked rank does
not have; the trainer tests' ranks (tests/integrations/test_trl_distributed.py,
test_trl_checkpoint.py) run green forked past it."""

import importlib

import torch  # noqa: F401
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import longstraw  # noqa: F401
from longstraw.models import supported_model_types
from tests import distributed_worker  # noqa: F401


def _import_model_modules() -> None:
    for model_type in supported_model_types():
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if name is not None:
            getattr(transformers, name)  # transformers imports the modeling module lazily
    for module in ("longstraw.tiny", "longstraw.train", "longstraw.parallel.launch"):
        importlib.import_module(module)


_import_model_modules()


def _import_trainer() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        return
    importlib.import_module("longstraw.integrations.trl")


_import_trainer()
