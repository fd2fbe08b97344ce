"""The reference loop's configuration (`longstraw train`'s flags): `TrainConfig`, its
model presets and arms, and `config_from_args`. A module of its own so that the loop
(`train.py`), its engine fit (`train_budget.py`) and its warm start (`warm.py`) all import
the type from here, and none of them imports another for it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from longstraw.budget import parse_budget
from longstraw.config import LOSS_TYPES
from longstraw.errors import ConfigError
from longstraw.tasks import KVRecall, ToolLookup, Vocab
from longstraw.tasks.episodes import TASKS

__all__ = ["ARMS", "MODEL_PRESETS", "TrainConfig", "check_memory_budget", "config_from_args"]

ARMS = ("detached", "exact")

# The CLI default's model, as data: a Qwen3-shaped dense model shrunk from
# longstraw.tiny's preset so an RL step at P = 16K takes seconds on one CPU thread;
# `vocab_size` is set from the task. 2 layers (the least that can do key -> value lookup:
# a previous-token layer, then a matching layer), 2 query heads over 1 KV head. Its large
# RoPE base (long-context models use 1e6 to 1e7; head_dim is only 16 here): the lookup is
# by content, so at long P the model fails by dilution, not by rotary angles it never saw.
MODEL_PRESETS = {
    "dense": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e9})),
}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run depends on. `longstraw train` exposes each field as a flag.
    A subclass may widen `arms` and `presets` (bench/learning/arms.py does)."""

    arms: ClassVar[tuple] = ARMS
    presets: ClassVar[dict] = MODEL_PRESETS

    # -- the task ---------------------------------------------------------------
    task_name: str = "kv_recall"
    """"kv_recall", or "tool_lookup" (an agent episode: read the record's id in the prompt,
    call the lookup tool, answer; rollouts go through `environment=`). The flag is --task."""
    prompt_tokens: int = 16384
    """P of the RL prompts and of the held-out evaluation."""
    num_facts: int = 4
    """Key-value facts in the haystack."""
    num_queries: int = 1
    """Facts asked about; the answer is that many value tokens, then EOS."""
    fact_region: float = 0.5
    """Facts sit in the first fact_region of the haystack (every answer is >= (1-fr)*P back)."""
    num_values: int = 8
    """Size of the value set (chance accuracy for a well-formed guess: 1/num_values)."""
    num_keys: int = 32
    num_filler: int = 80
    records: bool = True
    """One record token per fact (a one-match lookup) instead of `FACT key value` (see tasks.Vocab)."""
    num_answers: int = 8
    """tool_lookup: the tool's answer tokens (>= num_values; chance for a blind answer: 1/num_answers)."""
    task_seed: int = 0
    """Selects the task's data streams (train and held-out are disjoint for any seed)."""

    # -- the model ----------------------------------------------------------------
    model: str = "dense"
    """A preset of `presets`: "dense" (Qwen3-shaped; bench/learning adds "hybrid", Qwen3.6-shaped)."""
    dtype: str = "float32"
    model_seed: int = 0

    # -- warm start (supervised, short context) -----------------------------------
    warm_steps: int = 150
    """Supervised steps before RL (0: RL from random weights)."""
    warm_prompt_tokens: int = 512
    """Longest warm-start prompt. The first 2/3 of the steps use warm_min_prompt_tokens
    (where the lookup is learned fast); the rest cycle through 2x, 4x, .. up to this."""
    warm_min_prompt_tokens: int = 64
    warm_batch: int = 32
    warm_lr: float = 3e-3
    warm_cache: str | None = None
    """Directory to cache warm-start weights in (keyed by the fields they depend on)."""

    # -- RL -----------------------------------------------------------------------
    arm: str = "exact"
    """"detached" or "exact" (LongStraw modes; bench/learning adds "full", the HF full-sequence baseline)."""
    steps: int = 40
    group_size: int = 8
    prompts_per_step: int = 1
    """Groups per optimizer step (their losses are averaged with one BatchTotals)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global grad norm to this (0: off)."""
    max_nonfinite_steps: int = 3
    """A step whose gradient norm is NaN/inf skips its optimizer update (logged as
    nonfinite_grad); this many such steps in a row stop the run with NonFiniteError."""
    temperature: float = 1.0
    """Sampling temperature (also the loss's temperature)."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    beta: float = 0.0
    """k3 KL weight to the warm-start policy (0: off; the KL is logged either way)."""
    log_kl: bool = True
    """Score the sampled responses under the warm-start model to log the KL (one more capture)."""
    kl_prompts: int = 0
    """Prompts per step whose samples the logged KL is estimated on (0: all of them). Each costs
    one capture by the warm-start model; with beta > 0 every prompt is scored regardless."""
    chunk_size: int | None = None
    """Capture chunk (and exact mode's reverse-walk chunk); None: 1024, or with memory_budget the fit's."""
    memory_budget: str | None = None
    """Bytes one update step may add above the model and its gradients ("80GiB", "512MiB" or a
    number): ls.fit_config picks the engine's ExecConfig for P, G and the task's response
    length (a given chunk_size is kept), and the run stops before any work when nothing fits
    (train_budget.py). None: no fit."""
    seed: int = 0
    """Seeds the sampling and the order of everything random in the loop."""

    # -- evaluation, logging, checkpoints -------------------------------------------
    eval_every: int = 10
    eval_prompts: int = 32
    """Held-out prompts (greedy decoding) per evaluation, at prompt_tokens."""
    eval_split: str = "heldout"
    """The split evaluated; "train" is for tuning pilots (never tune on held-out)."""
    out_dir: str = "runs/train"
    checkpoint_every: int = 10
    resume: bool = True
    """Continue from <out_dir>/checkpoint.pt when it exists."""
    replica_check_every: int = 0
    """Under torch.distributed, check every N optimizer steps that every rank holds bitwise
    the same weights (`parallel.context.check_replicas`; 0: off; one process: nothing to compare)."""
    threads: int = 0
    """torch.set_num_threads (0: leave as is)."""
    progress: bool = True

    def __post_init__(self):
        if self.task_name not in TASKS:
            raise ConfigError(f"task must be one of {TASKS}, got {self.task_name!r}")
        if self.arm not in self.arms:
            raise ConfigError(f"arm must be one of {self.arms}, got {self.arm!r}")
        if self.model not in self.presets:
            raise ConfigError(f"model must be one of {sorted(self.presets)}, got {self.model!r}")
        if self.loss_type not in LOSS_TYPES:  # here, not in GRPOConfig after the warm start
            raise ConfigError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.replica_check_every < 0:
            raise ConfigError(f"replica_check_every must be >= 0 (0: off), got {self.replica_check_every}")
        if self.kl_prompts < 0:
            raise ConfigError(f"kl_prompts must be >= 0, got {self.kl_prompts}")
        for name in ("prompt_tokens", "steps", "group_size", "prompts_per_step", "eval_prompts", "eval_every",
                     "checkpoint_every", "chunk_size", "max_nonfinite_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_memory_budget(self.memory_budget)

    def task(self, prompt_tokens: int | None = None) -> KVRecall | ToolLookup:
        vocab = Vocab(num_values=self.num_values, num_keys=self.num_keys, num_filler=self.num_filler,
                      records=self.records)
        if self.task_name == "tool_lookup":
            return ToolLookup(prompt_tokens or self.prompt_tokens, num_facts=self.num_facts,
                              fact_region=self.fact_region, vocab=vocab, num_answers=self.num_answers,
                              seed=self.task_seed)
        return KVRecall(prompt_tokens or self.prompt_tokens, num_facts=self.num_facts, num_queries=self.num_queries,
                        fact_region=self.fact_region, vocab=vocab, seed=self.task_seed)



def check_memory_budget(memory_budget) -> None:
    """A `ConfigError` (a ValueError) naming the bad value, at TrainConfig construction:
    the loop runs on CPU, so "auto" (free CUDA memory) is refused too."""
    if memory_budget is not None:
        parse_budget(memory_budget, torch.device("cpu"))


def config_from_args(values: dict, config_file: str | None = None, cls: type = TrainConfig) -> TrainConfig:
    """A TrainConfig (or subclass `cls`) from an optional JSON file, overridden by
    explicit values."""
    base = {}
    if config_file:
        with open(config_file) as f:
            base = json.load(f)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(base) - known
    if unknown:
        raise ConfigError(f"unknown TrainConfig fields in {config_file}: {sorted(unknown)}")
    base.update({k: v for k, v in values.items() if v is not None})
    return cls(**base)
