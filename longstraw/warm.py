"""The reference loop's model and its warm start (`longstraw.train`): the preset model of a
`TrainConfig` with random weights, and a short supervised phase at short context whose
weights are cached on disk by the fields they depend on (every arm of one seed starts from
the identical model)."""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from longstraw.checkpoint import write_atomic
from longstraw.tiny import tiny_model
from longstraw.train_config import TrainConfig


def build_model(cfg: TrainConfig):
    """The preset model of cfg with random weights (seed cfg.model_seed)."""
    family, overrides = cfg.presets[cfg.model]
    dtype = getattr(torch, cfg.dtype)
    task = cfg.task()
    max_pos = max(cfg.prompt_tokens, cfg.warm_prompt_tokens) + task.response_tokens - 1 + 64
    return tiny_model(family, dtype=dtype, seed=cfg.model_seed, vocab_size=task.vocab_size,
                      max_position_embeddings=max_pos, **overrides)


_WARM_FIELDS = ("model", "dtype", "model_seed", "warm_steps", "warm_prompt_tokens", "warm_min_prompt_tokens",
                "warm_batch", "warm_lr", "num_facts", "num_queries", "fact_region", "num_values", "num_keys", "num_filler", "records", "task_seed")
_AGENT_WARM_FIELDS = ("task_name", "num_answers")  # in the key only for the agent task (kv_recall's keys stay)


def warm_start(model, cfg: TrainConfig) -> dict:
    """Supervised phase at short context: cross-entropy on the ideal response's own tokens (teacher forcing).

    Returns metrics (final loss, time). Uses train-split items of the task at short
    lengths (disjoint from every held-out prompt by split, and from the RL prompts by
    length)."""
    lengths, p = [], cfg.warm_min_prompt_tokens
    while p < cfg.warm_prompt_tokens:
        lengths.append(p)
        p *= 2
    tasks = [cfg.task(p) for p in lengths + [cfg.warm_prompt_tokens]]
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warm_lr)
    t0, loss = time.perf_counter(), torch.tensor(float("nan"))
    n = tasks[0].response_tokens
    for s in range(cfg.warm_steps):
        first = 2 * cfg.warm_steps // 3
        task = tasks[0] if s < first or len(tasks) == 1 else tasks[1 + (s - first) % (len(tasks) - 1)]
        items = [task.item("train", s * cfg.warm_batch + b) for b in range(cfg.warm_batch)]
        ids = torch.stack([torch.cat([it.prompt, it.target[:-1]]) for it in items])  # (B, P + n - 1)
        targets = torch.stack([it.target for it in items])  # (B, n)
        mask = torch.stack([it.target_mask for it in items]).reshape(-1)  # (B * n,): the policy's tokens
        logits = model(ids, logits_to_keep=n).logits  # (B, n, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1])[mask].float(),
                                                 targets.reshape(-1)[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return {"warm_loss": float(loss.detach()), "warm_time_s": time.perf_counter() - t0}


def _warm_key(cfg: TrainConfig) -> str:
    fields = _WARM_FIELDS + (_AGENT_WARM_FIELDS if cfg.task_name != "kv_recall" else ())
    blob = json.dumps({"preset": cfg.presets[cfg.model], **{k: getattr(cfg, k) for k in fields}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_model(cfg: TrainConfig):
    """The warm-started model for cfg (from the cache when there is one)."""
    model = build_model(cfg)
    path = os.path.join(cfg.warm_cache, f"warm-{cfg.model}-{_warm_key(cfg)}.pt") if cfg.warm_cache else None
    if path and os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
        return model, {"warm_cached": 1.0}
    torch.manual_seed(cfg.model_seed)
    info = warm_start(model, cfg) if cfg.warm_steps > 0 else {}
    if path and not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):  # one writer
        os.makedirs(cfg.warm_cache, exist_ok=True)
        state = model.state_dict()
        write_atomic(path, lambda f: torch.save(state, f))
    return model, info
