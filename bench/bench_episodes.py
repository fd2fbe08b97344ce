"""Agent episodes (issue 25): one GRPO iteration of multi-turn episodes on the tiny hybrid,
CPU float32, 1 thread per process, every arm in a fresh subprocess.

Arms (`--arms`)
---------------
* `longstraw`: `engine.generate(prompt, G, max_new_tokens=N, eos_token_id=EOS,
  environment=env, max_turns=T)` (one capture; each observation absorbed as one chunk
  into its branch's own state), then `engine.step(Group(..., loss_masks=rollout.loss_masks),
  state=rollout.state)` (no second capture).
* `recapture` (TRL's `_tool_call_loop`): `engine.generate(prompt, G, N, EOS)` for the first
  turn; then, per branch and per tool turn, `engine.generate(prompt + completion +
  observation, num_samples=1, max_new_tokens=N - len(completion))`: a NEW prompt,
  captured again; then `engine.step(group)` without `state=` (captures once more).

Both arms use the same environment, the same rewards and the same sampling seed; their
episodes are sampled independently (so token counts differ a little: both are reported).

Environment (deterministic): when branch i emits eos on turn k < T, it answers O tokens,
ids `(1000 i + 97 k + 13 j) % V`. EOS is a set of V/E ids (`--eos-every E`, default 16:
ids 0, 16, 32, ...), so a random tiny model ends a turn after ~E sampled tokens.

Absorption vs decode (longstraw arm): `episode.absorb` and `episode.decode_step` (the
loop's two model calls, looked up as module globals) are wrapped and timed; absorb rate
= chunk tokens (eos + observation) / absorb seconds, decode rate = branch-tokens decoded
/ decode_step seconds (one decode_step call runs the B live branches together). Neither
includes the lm_head or sampling.

Memory: `peak_above_model` = ru_maxrss at the end - VmRSS after building the model.

Usage:
    .venv/bin/python bench/bench_episodes.py --prompt-tokens 8192 --observation-tokens 256 \\
        --turns 3 --max-new-tokens 832 --out bench/results/episodes_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import machine_row, own_cpu_s, peak_rss, status_bytes, worker_row  # noqa: E402  (torch-free)

FIELDS = ["arm", "family", "prompt_tokens", "group", "turns", "observation_tokens", "max_new_tokens", "eos_every",
          "time_s", "time_generate_s", "time_step_s", "prompt_captures", "decoded_tokens", "absorbed_tokens",
          "recaptured_tokens", "response_tokens", "loss_tokens", "environment_calls", "absorb_calls", "absorb_s",
          "decode_calls", "decode_s", "absorb_tokens_per_s", "decode_tokens_per_s", "rss_after_model",
          "peak_rss", "peak_above_model", "loss", "cpu_time_s", "threads", "load_avg_1m", "cpu", "mem_total",
          "git_rev", "longstraw_dirty", "when"]


def make_env(vocab: int, obs_tokens: int):
    """env(i, response) -> LongTensor [O], deterministic in (branch, turn)."""
    import torch

    calls: dict = {}

    def env(branch, response):
        k = calls.get(branch, 0)
        calls[branch] = k + 1
        return torch.tensor([(1000 * branch + 97 * k + 13 * j) % vocab for j in range(obs_tokens)], dtype=torch.long)
    return env


class Timed:
    """Wrap a module-level function, counting calls, tokens (`count(args)`) and seconds."""

    def __init__(self, module, name, count):
        self.module, self.name, self.count = module, name, count
        self.inner = getattr(module, name)
        self.calls = self.tokens = 0
        self.seconds = 0.0
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.tokens += self.count(args)
        return out


def longstraw_arm(engine, prompt, args, eos, rewards, gen):
    import longstraw as ls
    from longstraw.engine import episode

    absorb = Timed(episode, "absorb", lambda a: int(a[4].numel()))  # absorb(engine, state, branches, i, tokens, pos)
    decode = Timed(episode, "decode_step", lambda a: int(a[3].numel()))  # decode_step(engine, state, br, tokens, ...)
    env = make_env(engine.adapter.vocab_size, args.observation_tokens)
    t0 = time.perf_counter()
    rollout = engine.generate(prompt, num_samples=args.group, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                              generator=gen, environment=env, max_turns=args.turns)
    t1 = time.perf_counter()
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=rewards, loss_masks=rollout.loss_masks)
    result = engine.step(group, state=rollout.state)
    t2 = time.perf_counter()
    masks = rollout.loss_masks
    return dict(time_generate_s=t1 - t0, time_step_s=t2 - t1, prompt_captures=1,
                decoded_tokens=int(rollout.metrics["generated_tokens"]), absorbed_tokens=absorb.tokens,
                recaptured_tokens=0, environment_calls=int(sum(rollout.turns)), absorb_calls=absorb.calls,
                absorb_s=absorb.seconds, decode_calls=decode.calls, decode_s=decode.seconds,
                absorb_tokens_per_s=absorb.tokens / absorb.seconds if absorb.seconds else None,
                decode_tokens_per_s=decode.tokens / decode.seconds if decode.seconds else None,
                response_tokens=sum(int(r.numel()) for r in rollout.responses),
                loss_tokens=sum(int(m.sum()) for m in masks), loss=float(result.loss))


def recapture_arm(engine, prompt, args, eos, rewards, gen):
    import torch

    import longstraw as ls

    eos_set, n = set(eos), args.max_new_tokens
    env = make_env(engine.adapter.vocab_size, args.observation_tokens)
    t0 = time.perf_counter()
    first = engine.generate(prompt, num_samples=args.group, max_new_tokens=n, eos_token_id=eos, generator=gen)
    captures, decoded, recaptured, calls = 1, int(first.metrics["generated_tokens"]), 0, 0
    responses, masks = [], []
    for i, r in enumerate(first.responses):
        tokens, mask, turns = r.tolist(), [True] * r.numel(), 0
        while tokens and tokens[-1] in eos_set and turns < args.turns and len(tokens) < n:
            obs = env(i, torch.tensor(tokens))
            turns, calls = turns + 1, calls + 1
            if obs.numel() > n - len(tokens):
                break  # TRL: an observation that would pass max_new_tokens is not appended
            tokens, mask = tokens + obs.tolist(), mask + [False] * obs.numel()
            if len(tokens) >= n:
                break
            new_prompt = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])  # prompt + completion + tool
            more = engine.generate(new_prompt, num_samples=1, max_new_tokens=n - len(tokens), eos_token_id=eos,
                                   generator=gen)
            captures, recaptured = captures + 1, recaptured + new_prompt.numel() - 1
            decoded += int(more.metrics["generated_tokens"])
            tokens, mask = tokens + more.responses[0].tolist(), mask + [True] * more.responses[0].numel()
        responses.append(torch.tensor(tokens, dtype=torch.long))
        masks.append(torch.tensor(mask, dtype=torch.bool))
    t1 = time.perf_counter()
    group = ls.Group(prompt=prompt, responses=responses, rewards=rewards, loss_masks=masks)
    result = engine.step(group)  # no state: the step captures the prompt again
    t2 = time.perf_counter()
    return dict(time_generate_s=t1 - t0, time_step_s=t2 - t1, prompt_captures=captures + 1, decoded_tokens=decoded,
                absorbed_tokens=0, recaptured_tokens=recaptured + prompt.numel() - 1, environment_calls=calls,
                response_tokens=sum(int(r.numel()) for r in responses),
                loss_tokens=sum(int(m.sum()) for m in masks), loss=float(result.loss))


def worker(args) -> dict:
    import torch

    import longstraw as ls
    from longstraw.tiny import tiny_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = tiny_model(args.family, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    rewards = torch.rand(args.group, generator=torch.Generator().manual_seed(1))
    eos = list(range(0, vocab, args.eos_every))
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size))
    rss0 = status_bytes("VmRSS")
    gen = torch.Generator().manual_seed(2)
    arm = longstraw_arm if args.arm == "longstraw" else recapture_arm
    t0 = time.perf_counter()
    row = arm(engine, prompt, args, eos, rewards, gen)
    row.update(time_s=time.perf_counter() - t0, rss_after_model=rss0, peak_rss=peak_rss(),
               peak_above_model=peak_rss() - rss0, cpu_time_s=own_cpu_s())
    return row


def run_one(args, arm: str, group: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--group", str(group),
           "--family", args.family, "--prompt-tokens", str(args.prompt_tokens), "--turns", str(args.turns),
           "--observation-tokens", str(args.observation_tokens), "--max-new-tokens", str(args.max_new_tokens),
           "--eos-every", str(args.eos_every), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads)]
    row = worker_row(cmd)
    row.update(arm=arm, family=args.family, prompt_tokens=args.prompt_tokens, group=group, turns=args.turns,
               observation_tokens=args.observation_tokens, max_new_tokens=args.max_new_tokens,
               eos_every=args.eos_every, threads=args.threads, **machine_row(REPO))
    return row


def ratios_of(rows) -> dict:
    """Same-run ratios: longstraw / recapture time per G, absorb / decode rate, peak G_hi / G_lo."""
    out = {}
    ls_rows = {r["group"]: r for r in rows if r["arm"] == "longstraw"}
    for r in rows:
        base = ls_rows.get(r["group"])
        if r["arm"] == "recapture" and base is not None:
            out[f"time_longstraw_over_recapture_G{r['group']}"] = base["time_s"] / r["time_s"]
            out[f"decoded_tokens_longstraw_vs_recapture_G{r['group']}"] = [base["decoded_tokens"], r["decoded_tokens"]]
    for g, r in ls_rows.items():
        if r.get("absorb_tokens_per_s") and r.get("decode_tokens_per_s"):
            out[f"absorb_over_decode_tokens_per_s_G{g}"] = r["absorb_tokens_per_s"] / r["decode_tokens_per_s"]
    if len(ls_rows) >= 2:
        lo, hi = min(ls_rows), max(ls_rows)
        out[f"peak_above_model_G{hi}_over_G{lo}"] = ls_rows[hi]["peak_above_model"] / ls_rows[lo]["peak_above_model"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, help=argparse.SUPPRESS)
    p.add_argument("--arms", nargs="+", default=["longstraw", "recapture"])
    p.add_argument("--groups", type=int, nargs="+", default=[8], help="G for both arms")
    p.add_argument("--peak-groups", type=int, nargs="*", default=[2], help="extra G for the longstraw arm only")
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--observation-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=4 * 16 + 3 * 512)
    p.add_argument("--eos-every", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/out/episodes.csv")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    plan = [("longstraw", g) for g in args.peak_groups] + [(a, g) for g in args.groups for a in args.arms]
    rows = []
    for arm, group in plan:
        row = run_one(args, arm, group)
        rows.append(row)
        print(f"{arm:>10} G={group:<2} {row['time_s']:8.2f} s (generate {row['time_generate_s']:7.2f}, step "
              f"{row['time_step_s']:6.2f})  captures {row['prompt_captures']}  peak {row['peak_above_model'] / 2**20:7.1f}"
              f" MiB  load {row['load_avg_1m']:.2f}", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in FIELDS})

    def rate(x):
        return f"{x:10.0f}" if x else f"{'-':>10}"
    print(f"\n{'arm':>10} {'G':>3} {'time s':>8} {'gen s':>8} {'step s':>7} {'capt':>5} {'decoded':>8} {'absorbed':>9} "
          f"{'recapt':>8} {'absorb t/s':>10} {'decode t/s':>10} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['arm']:>10} {r['group']:>3} {r['time_s']:8.2f} {r['time_generate_s']:8.2f} {r['time_step_s']:7.2f} "
              f"{r['prompt_captures']:>5} {r['decoded_tokens']:>8} {r['absorbed_tokens']:>9} {r['recaptured_tokens']:>8} "
              f"{rate(r.get('absorb_tokens_per_s'))} {rate(r.get('decode_tokens_per_s'))} "
              f"{r['peak_above_model'] / 2**20:9.1f}")
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "observation_tokens": args.observation_tokens,
                      "turns": args.turns, "max_new_tokens": args.max_new_tokens, "rows": len(rows),
                      "ratios": ratios_of(rows)}))


if __name__ == "__main__":
    main()
