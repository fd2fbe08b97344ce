"""`longstraw demo`: one whole GRPO iteration on a tiny built-in model (no download).

    generate G responses from one capture of the prompt -> toy rewards -> engine.step on the
    same state (no second capture) -> an AdamW step

It prints a table (memory, phase times, the loss beside the gradient norm) and one JSON
line. The screen says what a reader could misread:

* the loss row: on-policy GRPO's loss is about 0 while its gradient is not (`skips.loss_note`);
* `time_capture_s` in the JSON is the iteration's one capture, which ran inside `generate`
  (the step reused its state and captured nothing); `generate_time_capture_s` is the same
  figure under the rollout's name;
* a step that changed no weight (every reward equal) warns with what to change
  (`skips.NoUpdateWarning`).

Bad flags are refused before the model is built (`check_args`: one `ConfigError` line, exit 2).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import longstraw as ls
from longstraw.errors import ConfigError
from longstraw.measure import naive_bytes_per_token, peak_rss_bytes, rss_bytes
from longstraw.parallel.launch import init_distributed
from longstraw.skips import DEMO_ADVICE, SkipWatch, loss_note, no_update_reason
from longstraw.tiny import tiny_model

__all__ = ["demo", "toy_reward", "check_args"]


def toy_reward(response, vocab_size: int) -> float:
    """The demo's verifiable toy reward: the fraction of response tokens in the lower half
    of the vocabulary (any policy can be pushed towards it; it only shows the loop)."""
    return float((response < vocab_size // 2).double().mean()) if response.numel() else 0.0


def check_args(args) -> None:
    """A `ConfigError` naming the flag, before any model is built."""
    for flag, value, least in (("--prompt-tokens", args.prompt_tokens, 2), ("--group", args.group, 1),
                               ("--response-tokens", args.response_tokens, 1), ("--chunk-size", args.chunk_size, 1),
                               ("--branch-chunk-size", args.branch_chunk_size, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _table(args, world, rewards, result, rollout, grad_norm, peaks, time_optimizer, per_token) -> list:
    """The printed rows: (what, value)."""
    m, g = result.metrics, rollout.metrics
    longest = max(int(r.numel()) for r in rollout.responses)
    naive_branch = per_token * (args.prompt_tokens + longest)
    rows = [
        ("reward mean (toy: share of low token ids)", f"{float(rewards.mean()):.4f}"),
        ("loss (on-policy: about 0, see below)", f"{result.loss:.6f}"),
        ("gradient norm (what trains)", f"{float(grad_norm):.4e}"),
        ("prompt state" + (" (this rank)" if world > 1 else ""), _mib(g["state_bytes"])),
        ("branch state (G branches' own tokens)", _mib(g["branch_state_bytes"])),
        ("peak RSS above model: generate", _mib(peaks[0])),
        ("peak RSS above model: whole iteration", _mib(peaks[1])),
        ("time: capture (once, inside generate)", f"{g['time_capture_s']:.2f} s"),
        ("time: generate (decode)", f"{g['time_generate_s']:.2f} s, {g['tokens_per_s']:,.0f} tokens/s"),
        ("time: replay (all branches)", f"{m['time_replay_s']:.2f} s"),
    ]
    if args.mode == "exact":
        rows += [("state gradient buffers", _mib(m["state_grad_bytes"])),
                 ("time: reverse walk", f"{m['time_reverse_s']:.2f} s")]
    return rows + [
        ("time: optimizer step", f"{time_optimizer:.2f} s"),
        ("naive graph, one full sequence*", _mib(naive_branch)),
        ("naive graph, G sequences batched*", _mib(naive_branch * args.group)),
    ]


def demo(args) -> int:
    """Run the iteration for the parsed `longstraw demo` flags; print the table and the JSON line."""
    check_args(args)
    rank, device = init_distributed()
    lead = rank in (None, 0)  # only one rank prints
    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    model = tiny_model(args.family, dtype=dtype, seed=args.seed).to(device)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(args.seed))
    world = 1 if rank is None else torch.distributed.get_world_size()
    if lead:
        print(f"LongStraw demo: tiny {args.family} ({n_params / 1e6:.1f}M params, {args.dtype}), "
              f"P={args.prompt_tokens:,}, G={args.group}, R<={args.response_tokens}, chunk={args.chunk_size}, "
              f"mode={args.mode}" + (f", context-parallel over {world} ranks" if world > 1 else ""), file=sys.stderr)
    config = ls.ExecConfig(chunk_size=args.chunk_size, mode=args.mode, branch_chunk_size=args.branch_chunk_size,
                           progress=lead, context_parallel=world > 1)
    engine = ls.Engine(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rss_model = rss_bytes()
    rollout = engine.generate(prompt, num_samples=args.group, max_new_tokens=args.response_tokens,
                              temperature=1.0, generator=torch.Generator().manual_seed(args.seed))
    peak_generate = peak_rss_bytes() - rss_model
    rewards = torch.tensor([toy_reward(r, vocab) for r in rollout.responses])
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=rewards, old_logprobs=rollout.logprobs)
    result = engine.step(group, ls.GRPOConfig(), state=rollout.state)  # no second capture
    peak_above = peak_rss_bytes() - rss_model
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]  # none when the step skipped
    grad_norm = torch.sqrt(sum(((g ** 2).sum() for g in grads), torch.zeros((), dtype=torch.float64)))
    t0 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    time_optimizer = time.perf_counter() - t0
    if not lead:
        return 0
    m, g = result.metrics, rollout.metrics
    reason = no_update_reason({"nonfinite_grad": not bool(torch.isfinite(grad_norm)),
                               "skipped_zero_advantage": m.get("skipped_zero_advantage", 0.0),
                               "skipped_no_loss_tokens": m.get("skipped_no_loss_tokens", 0.0)}, groups=1)
    watch = SkipWatch("longstraw demo", DEMO_ADVICE, total=1)
    watch.step(reason, reward_mean=float(rewards.mean()))  # the one step changed nothing: say why
    per_token = naive_bytes_per_token(model, vocab)
    rows = _table(args, world, rewards, result, rollout, grad_norm, (peak_generate, peak_above), time_optimizer,
                  per_token)
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\n  {loss_note(result.loss, float(grad_norm))}."
          f"\n  * naive = HF forward+backward over P+R tokens; activation bytes saved for backward, measured\n"
          f"    at 256 and 512 tokens ({per_token / 1024:.1f} KiB/token) and extrapolated linearly.")
    print(json.dumps({"loss": result.loss, "grad_norm": float(grad_norm), "reward_mean": float(rewards.mean()),
                      "peak_rss_above_model": peak_above, "peak_rss_generate": peak_generate,
                      "naive_bytes_per_token": per_token, "no_update": reason,
                      **{f"generate_{k}": v for k, v in g.items()}, **m,
                      "time_capture_s": g["time_capture_s"]}))  # the one capture ran inside generate (the step reused it)
    return 0
