"""A small reference GRPO training loop: `longstraw train`, or `train(TrainConfig(...))`.

It is a reference loop, not a framework. One iteration:

    item    = task.item("train", step)                       # the data order is the step index
    rollout = engine.generate(item.prompt, num_samples=G, ...)  # one capture, G branches sampled
    rewards = [task.reward(item, r) for r in rollout.responses]
    engine.step(group, grpo, state=rollout.state)            # no second capture
    optimizer.step()

Three arms share everything but the gradient of that update:

    detached  LongStraw, the prompt state is a constant (the LongStraw paper's gradient)
    exact     LongStraw exact mode: gradients also flow back through the prompt
    full      the naive baseline: one Hugging Face forward + backward per branch over
              prompt + response, with the same GRPO loss (same gradient as exact)

All three sample their rollouts the same way (engine.generate from the captured state),
from the same per-step torch.Generator, so with the same seed they see the same
prompts in the same order; exact and full then follow the same curve up to float
rounding.

Warm start. A tiny random model cannot answer at all, so RL starts from a short
supervised phase at *short* context (prompts of 64 up to `warm_prompt_tokens` tokens):
cross-entropy on the ideal response (answer tokens + EOS) of the task's train split. The
model learns the answer format and the lookup at short range, and is poor at the long P
that RL then trains at (its attention over 16K filler tokens is too diluted). The warm-start weights are cached on disk by their
config, so every arm of one seed starts from the identical model.

Each step appends one JSON line to `<out_dir>/log.jsonl` (reward mean/std, loss, clip
fraction, KL to the warm-start policy, tokens/s, peak RSS, time per phase; held-out
accuracy every `eval_every` steps). `<out_dir>/checkpoint.pt` holds the model, the
optimizer, the RNG states and the step; a resumed run continues the same curve (every
random draw of a step comes from a generator seeded by (seed, step)).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch

from longstraw.engine import grpo as G
from .config import ExecConfig, GRPOConfig
from longstraw.parallel.context import check_replicas
from longstraw.engine.engine import Engine
from .errors import CheckpointError, NonFiniteError
from .group import BatchTotals, Group
from longstraw.engine.logprobs import scaled_log_softmax
from .measure import peak_rss_bytes
from .tasks import KVRecall, Vocab, exact_match

ARMS = ("detached", "exact", "full")

# A large RoPE base (long-context models use 1e6 to 1e7; head_dim is only 16 here): the
# lookup is by content, so at long P the model fails by dilution, not by rotary angles
# it never saw.
ROPE_THETA = 1e9

# Tiny models for the learning experiments, shrunk from longstraw.tiny's presets so an
# RL step at P = 16K takes seconds on one CPU thread. `vocab_size` is set from the task.
MODEL_PRESETS = {
    # Qwen3-shaped dense: 2 layers (the least that can do key -> value lookup:
    # a previous-token layer, then a matching layer), 2 query heads over 1 KV head.
    "dense": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16,
                            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})),
    # Qwen3.6-shaped hybrid: 3 Gated DeltaNet layers : 1 gated full-attention layer.
    "hybrid": ("qwen3_5", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                                                "partial_rotary_factor": 0.25})),
}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run depends on. `longstraw train` exposes each field as a flag."""

    # -- the task ---------------------------------------------------------------
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
    task_seed: int = 0
    """Selects the task's data streams (train and held-out are disjoint for any seed)."""

    # -- the model ----------------------------------------------------------------
    model: str = "dense"
    """A preset of MODEL_PRESETS: "dense" (Qwen3-shaped) or "hybrid" (Qwen3.6-shaped)."""
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
    """"detached", "exact" (LongStraw modes) or "full" (HF full-sequence baseline)."""
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
    chunk_size: int = 1024
    """Capture chunk (and exact mode's reverse-walk chunk)."""
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
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {self.arm!r}")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model must be one of {sorted(MODEL_PRESETS)}, got {self.model!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.replica_check_every < 0:
            raise ValueError(f"replica_check_every must be >= 0 (0: off), got {self.replica_check_every}")
        if self.kl_prompts < 0:
            raise ValueError(f"kl_prompts must be >= 0, got {self.kl_prompts}")
        for name in ("prompt_tokens", "steps", "group_size", "prompts_per_step", "eval_prompts", "eval_every",
                     "checkpoint_every", "chunk_size", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def task(self, prompt_tokens: int | None = None) -> KVRecall:
        vocab = Vocab(num_values=self.num_values, num_keys=self.num_keys, num_filler=self.num_filler,
                      records=self.records)
        return KVRecall(prompt_tokens or self.prompt_tokens, num_facts=self.num_facts, num_queries=self.num_queries,
                        fact_region=self.fact_region, vocab=vocab, seed=self.task_seed)


# ----------------------------------------------------------------------------
# model, warm start


def build_model(cfg: TrainConfig):
    from .tiny import tiny_model

    family, overrides = MODEL_PRESETS[cfg.model]
    dtype = getattr(torch, cfg.dtype)
    max_pos = max(cfg.prompt_tokens, cfg.warm_prompt_tokens) + cfg.num_queries + 64
    return tiny_model(family, dtype=dtype, seed=cfg.model_seed, vocab_size=cfg.task().vocab.size,
                      max_position_embeddings=max_pos, **overrides)


_WARM_FIELDS = ("model", "dtype", "model_seed", "warm_steps", "warm_prompt_tokens", "warm_min_prompt_tokens",
                "warm_batch", "warm_lr",
                "num_facts", "num_queries", "fact_region", "num_values", "num_keys", "num_filler", "records", "task_seed")


def warm_start(model, cfg: TrainConfig) -> dict:
    """Supervised phase at short context: cross-entropy on answer + EOS (teacher forcing).

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
    n = cfg.num_queries + 1
    for s in range(cfg.warm_steps):
        first = 2 * cfg.warm_steps // 3
        task = tasks[0] if s < first or len(tasks) == 1 else tasks[1 + (s - first) % (len(tasks) - 1)]
        items = [task.item("train", s * cfg.warm_batch + b) for b in range(cfg.warm_batch)]
        ids = torch.stack([torch.cat([it.prompt, it.target[:-1]]) for it in items])  # (B, P + n - 1)
        targets = torch.stack([it.target for it in items])  # (B, n)
        logits = model(ids, logits_to_keep=n).logits  # (B, n, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return {"warm_loss": float(loss.detach()), "warm_time_s": time.perf_counter() - t0}


def _warm_key(cfg: TrainConfig) -> str:
    blob = json.dumps({"preset": MODEL_PRESETS[cfg.model], **{k: getattr(cfg, k) for k in _WARM_FIELDS}},
                      sort_keys=True)
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
    if path:
        os.makedirs(cfg.warm_cache, exist_ok=True)
        state = model.state_dict()
        write_atomic(path, lambda f: torch.save(state, f))
    return model, info


# ----------------------------------------------------------------------------
# rollouts


def rollout(engine: Engine, prompt: torch.Tensor, cfg: TrainConfig, generator: torch.Generator):
    """G samples for one prompt from one capture (`rollout.state` serves the update)."""
    return engine.generate(prompt, num_samples=cfg.group_size, max_new_tokens=cfg.num_queries + 1,
                           temperature=cfg.temperature, top_p=1.0, top_k=0, eos_token_id=Vocab.EOS,
                           generator=generator)


# ----------------------------------------------------------------------------
# the full-sequence baseline update


def full_sequence_logprobs(model, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0):
    """One HF forward over prompt + response: [R] log-probs of the response tokens."""
    ids = torch.cat([prompt, response])  # (P + R,)
    logits = model(ids[None], logits_to_keep=response.numel() + 1).logits[0, :-1]  # (R, V)
    return scaled_log_softmax(logits, temperature).gather(-1, response[:, None])[:, 0]


def full_sequence_step(model, group: Group, grpo: GRPOConfig, totals: BatchTotals | None = None) -> dict:
    """The naive update: one full-sequence forward + backward per branch, with the same
    GRPO loss as `Engine.step` (so the same gradient as exact mode). Accumulates .grad."""
    totals = BatchTotals.of([group]) if totals is None else totals
    rewards = torch.as_tensor(group.rewards, dtype=torch.float64)
    equal = bool(rewards.max() == rewards.min())
    if equal and grpo.beta == 0:
        return {"loss": 0.0, "skipped_zero_advantage": 1.0, "clip_fraction": 0.0}
    adv = torch.zeros_like(rewards) if equal else G.advantages(rewards, grpo)
    total, clipped, tokens = 0.0, 0.0, 0
    for i, response in enumerate(group.responses):
        logp = full_sequence_logprobs(model, group.prompt, response, grpo.temperature)
        old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i].to(logp)
        ref = group.ref_logprobs[i].to(logp) if grpo.beta > 0 else None
        per_tok, stats = G.per_token_loss(logp, old, float(adv[i]), grpo, ref)
        loss = per_tok.sum() * G.branch_weight(grpo, totals, response.numel())
        loss.backward()
        total += float(loss.detach())
        clipped += float(stats["clipped"].sum())
        tokens += response.numel()
    return {"loss": total, "skipped_zero_advantage": 0.0, "clip_fraction": clipped / tokens}


# ----------------------------------------------------------------------------
# evaluation


def evaluate(engine: Engine, task: KVRecall, n: int, *, split: str = "heldout") -> dict:
    """Greedy decoding on n items of `split`: accuracy (exact match) and mean reward.
    Held-out: its first n items. Train (pilots only): items from 10**6 on, which no run
    of under a million prompts trains on."""
    hits, total = 0, 0.0
    first = 0 if split == "heldout" else 10**6
    for i in range(first, first + n):
        item = task.item(split, i)
        r = engine.generate(item.prompt, num_samples=1, max_new_tokens=task.num_queries + 1, temperature=0.0,
                            eos_token_id=Vocab.EOS).responses[0]
        hits += exact_match(item.answer, r)
        total += task.reward(item, r)
    pre = "heldout" if split == "heldout" else f"eval_{split}"
    return {f"{pre}_accuracy": hits / n, f"{pre}_reward": total / n, f"{pre}_n": n}


# ----------------------------------------------------------------------------
# checkpoints


def write_atomic(path: str, write) -> None:
    """Write `path` by write-then-rename: `write(f)` fills `path + ".tmp"` (same directory,
    binary), which is fsynced and renamed over `path` (`os.replace` is atomic), then the
    directory is fsynced. A run killed at any moment leaves the old file or the new one,
    never a part of one (a stale .tmp at most, overwritten by the next write)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(path: str, model, optimizer, step: int, cfg: TrainConfig, nonfinite: dict) -> None:
    """Write the checkpoint (atomically); refuse to replace the last good one by weights
    that are not finite."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteError(f"after step {step} the weights are not finite ({len(bad)} tensors, e.g. {bad[0]!r}); "
                             f"{path} keeps the last good checkpoint: lower lr or grad_clip and resume from it")
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg), "nonfinite": dict(nonfinite)}
    write_atomic(path, lambda f: torch.save(ckpt, f))


def load_checkpoint(path: str) -> dict:
    """A checkpoint written by the loop, loaded with `torch.load(weights_only=True)`:
    tensors and plain containers only, never arbitrary pickled objects."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # UnpicklingError for a forbidden object; others for a broken file
        raise CheckpointError(f"cannot load the checkpoint {path} with weights_only=True ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); the loop only loads its own "
                              "checkpoints: tensors and plain containers. Delete it or pass --no-resume") from exc


def _read_log(path: str) -> bytes:
    if not os.path.exists(path):
        return b""
    with open(path, "rb") as f:
        return f.read()


def _truncate_log(path: str, step: int) -> None:
    """Keep the log lines of the `step` steps done (a resumed run writes the rest)."""
    if not os.path.exists(path):
        return
    keep = [line for line in _read_log(path).splitlines(keepends=True) if json.loads(line).get("step", -1) <= step]
    write_atomic(path, lambda f: f.writelines(keep))


def _append_log(path: str, record: dict) -> None:
    """Append one JSON line to the log, by rewriting it whole (atomically: `write_atomic`)."""
    data = _read_log(path) + (json.dumps(record) + "\n").encode()
    write_atomic(path, lambda f: f.write(data))


def _step_generator(cfg: TrainConfig, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 17)


# ----------------------------------------------------------------------------
# the loop


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one GRPO training run. Returns the final summary dict (also the
    last line of the log)."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig) -> dict:
    os.makedirs(cfg.out_dir, exist_ok=True)
    log_path, ckpt_path = os.path.join(cfg.out_dir, "log.jsonl"), os.path.join(cfg.out_dir, "checkpoint.pt")
    config_json = json.dumps(dataclasses.asdict(cfg), indent=1).encode()
    write_atomic(os.path.join(cfg.out_dir, "config.json"), lambda f: f.write(config_json))

    task = cfg.task()
    model, warm_info = warm_model(cfg)
    reference = copy.deepcopy(model).requires_grad_(False) if (cfg.log_kl or cfg.beta > 0) else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, nonfinite = 0, {"in_row": 0, "total": 0}  # steps whose gradient norm was NaN/inf
    if cfg.resume and os.path.exists(ckpt_path):
        ckpt = load_checkpoint(ckpt_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"])
        start = ckpt["step"]
        nonfinite.update(ckpt.get("nonfinite", {}))
        del ckpt
    _truncate_log(log_path, start if start > 0 else -1)  # from scratch: the warm-start line is written again

    mode = "exact" if cfg.arm == "exact" else "detached"
    engine = Engine(model, ExecConfig(chunk_size=cfg.chunk_size, mode=mode))
    ref_engine = Engine(reference, ExecConfig(chunk_size=cfg.chunk_size)) if reference is not None else None
    grpo = GRPOConfig(loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon, beta=cfg.beta,
                      temperature=cfg.temperature)
    params = [p for p in model.parameters() if p.requires_grad]

    def log(record: dict) -> None:
        _append_log(log_path, record)

    if start == 0:
        t0 = time.perf_counter()
        ev = evaluate(engine, task, cfg.eval_prompts, split=cfg.eval_split)
        log({"step": 0, "phase": "warm_start", **warm_info, **ev, "time_eval_s": time.perf_counter() - t0})

    bar = range(start, cfg.steps)
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=f"train {cfg.arm}", initial=start, total=cfg.steps)
    record: dict = {}
    for step in bar:
        t_start = time.perf_counter()
        gen = _step_generator(cfg, step)
        # 1. rollouts: G samples per prompt from the captured state
        items = [task.item("train", step * cfg.prompts_per_step + b) for b in range(cfg.prompts_per_step)]
        rollouts, groups = [], []
        for item in items:
            ro = rollout(engine, item.prompt, cfg, gen)
            rewards = torch.tensor([task.reward(item, r) for r in ro.responses], dtype=torch.float64)
            rollouts.append(ro)
            groups.append(Group(prompt=item.prompt, responses=ro.responses, rewards=rewards,
                                old_logprobs=ro.logprobs))
        t_gen = time.perf_counter()
        # 2. the reference policy's log-probs (KL to the warm start; the loss's KL term when beta > 0)
        kl = None
        if ref_engine is not None:
            kls = []
            scored = len(groups) if cfg.beta > 0 or cfg.kl_prompts == 0 else min(cfg.kl_prompts, len(groups))
            for grp, ro in zip(groups[:scored], rollouts[:scored]):
                ref = ref_engine.score(grp, temperature=cfg.temperature)  # its own capture (other weights)
                if cfg.beta > 0:
                    grp.ref_logprobs = ref
                for lp, rlp in zip(ro.logprobs, ref):
                    d = rlp.double() - lp.double()
                    kls.append(torch.exp(d) - d - 1)  # k3 estimator of KL(policy || ref), per token
            kl = float(torch.cat(kls).mean())
        t_ref = time.perf_counter()
        # 3. the update
        optimizer.zero_grad(set_to_none=True)
        totals = BatchTotals.of(groups)
        metrics = []
        for grp, ro in zip(groups, rollouts):
            if cfg.arm == "full":
                metrics.append(full_sequence_step(model, grp, grpo, totals))
            else:
                res = engine.step(grp, grpo, totals=totals, state=ro.state)  # no second capture
                metrics.append({"loss": res.loss, **res.metrics})
        del rollouts, ro  # their prompt states: nothing after the update reads them (not the next capture)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            nonfinite["in_row"] = 0
        else:  # skip the update: NaN/inf would reach the weights (and the next checkpoint)
            optimizer.zero_grad(set_to_none=True)
            nonfinite["in_row"] += 1
            nonfinite["total"] += 1
        if cfg.replica_check_every and (step + 1) % cfg.replica_check_every == 0:
            check_replicas(model, engine.cp)  # DistributedError if the ranks' weights drifted apart
        t_upd = time.perf_counter()
        # 4. held-out evaluation
        ev = {}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            ev = evaluate(engine, task, cfg.eval_prompts, split=cfg.eval_split)
        t_eval = time.perf_counter()

        r = torch.cat([g.rewards for g in groups])
        resp_tokens = sum(g.response_tokens for g in groups)
        work = t_upd - t_start
        record = {
            "step": step + 1, "arm": cfg.arm, "model": cfg.model, "prompt_tokens": cfg.prompt_tokens,
            "reward_mean": float(r.mean()), "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
            "loss": sum(m["loss"] for m in metrics),
            "clip_fraction": sum(m.get("clip_fraction", 0.0) for m in metrics) / len(metrics),
            "skipped_zero_advantage": sum(m.get("skipped_zero_advantage", 0.0) for m in metrics),
            "kl_ref": kl, "grad_norm": float(grad_norm), "response_tokens": resp_tokens,
            "nonfinite_grad": float(not finite), "nonfinite_in_row": nonfinite["in_row"],
            "nonfinite_steps": nonfinite["total"],
            "tokens_per_s": (cfg.prompts_per_step * cfg.prompt_tokens + resp_tokens) / work,
            "peak_rss_bytes": peak_rss_bytes(),
            "time_generate_s": t_gen - t_start, "time_ref_s": t_ref - t_gen, "time_update_s": t_upd - t_ref,
            "time_eval_s": t_eval - t_upd, "time_step_s": t_eval - t_start,
            **{k: sum(m.get(k, 0.0) for m in metrics) for k in ("time_capture_s", "time_replay_s", "time_reverse_s")},
            **ev,
        }
        log(record)
        if cfg.progress:
            bar.set_postfix(reward=f"{record['reward_mean']:.2f}", **({"acc": f"{next(iter(ev.values())):.2f}"} if ev else {}))
        if nonfinite["in_row"] >= cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"the gradient norm was not finite ({float(grad_norm)}) for {nonfinite['in_row']} steps in a row "
                f"(steps {step + 2 - nonfinite['in_row']}..{step + 1}); their updates were skipped and {ckpt_path} "
                "holds the last good weights. Lower lr, check the rewards and the model dtype, or raise "
                "max_nonfinite_steps"
            )
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            _save(ckpt_path, model, optimizer, step + 1, cfg, nonfinite)
    return record


def config_from_args(values: dict, config_file: str | None = None) -> TrainConfig:
    """A TrainConfig from an optional JSON file, overridden by explicit values."""
    base = {}
    if config_file:
        with open(config_file) as f:
            base = json.load(f)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(base) - known
    if unknown:
        raise ValueError(f"unknown TrainConfig fields in {config_file}: {sorted(unknown)}")
    base.update({k: v for k, v in values.items() if v is not None})
    return TrainConfig(**base)


__all__ = ["TrainConfig", "train", "warm_model", "load_checkpoint", "write_atomic", "warm_start", "build_model",
           "evaluate", "full_sequence_step",
           "full_sequence_logprobs", "config_from_args", "MODEL_PRESETS", "ARMS"]
