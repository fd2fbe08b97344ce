"""The trainer on many processes, CPU: does W = 2 make a `LongStrawGRPOTrainer` step faster?

Physics. One trainer step is generate (capture + G·R decode steps) + score + step
(replay + backward). With C = W = 2 (one prompt over both ranks) capture and the prompt
attention divide over the ranks, decode and replay (R-sized) do not: the step at large P,
where capture dominates, should approach 1/2 plus communication (target <= 0.65x). With
C = 1 (plain data parallelism) each rank takes its own prompts and only the gradient sum
and a few small gathers cross ranks: prompts per second should approach 2x (target >= 1.7x).

Measurement. Every row runs in fresh processes launched by `torch.distributed.run`
(gloo, one thread per rank, `OMP_NUM_THREADS=1`); W = 1 is one process. Each run trains
`--steps` optimizer steps of the tiny hybrid (`longstraw.tiny`, qwen3_5, float32, random
weights) with G = 4 completions of up to R tokens (eos is id 4095 of 4096: rarely drawn; the
sampling is seeded by (seed, step, prompt), so W = 1 and W = 2 sample alike), detached mode, and
reports the mean of TRL's `step_time` (generation, scoring and update of one optimizer
step) over the steps after the first. The machine's load average is recorded in each row:
this 2-core machine is shared, and a ratio measured under load says little.

Usage:
    .venv/bin/python bench/bench_distributed.py --out bench/results/distributed_cpu.csv
    .venv/bin/python bench/bench_distributed.py --step-prompt-tokens 8192 --rate-prompt-tokens 2048   # quicker
Prints a table and the ratios, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    """One rank: train, and (rank 0) write the mean step time to args.result."""
    import datasets
    import torch
    import trl

    import longstraw as ls
    from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer
    from longstraw.tiny import tiny_model

    torch.set_num_threads(1)
    world, G = int(os.environ.get("WORLD_SIZE", "1")), 4
    data_groups = world // args.context
    per_group = args.prompts // data_groups  # prompts per data-parallel group per step
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, torch.randint(2, 4000, (args.prompt_tokens,), generator=g).tolist()))
               for _ in range(args.prompts * (args.steps + 1))]
    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=G * per_group,
                            gradient_accumulation_steps=1, num_generations=G, max_completion_length=args.response_tokens,
                            max_steps=args.steps, learning_rate=1e-5, use_cpu=True, bf16=False, report_to=[],
                            save_strategy="no", logging_steps=1, seed=0, disable_dropout=True, ddp_timeout=1800)
    model = tiny_model("qwen3_5", max_position_embeddings=args.prompt_tokens + args.response_tokens + 8)
    trainer = LongStrawGRPOTrainer(
        model=model, reward_funcs=lambda completion_ids, **kw: [float(c[0] % 2) for c in completion_ids],
        args=config, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=token_id_tokenizer(4096, eos_token_id=4095),
        longstraw_config=ls.ExecConfig(chunk_size=4096), longstraw_context_parallel_size=args.context)
    trainer.train()
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]  # after the warm-up step
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump({"step_time_s": sum(times) / len(times)}, f)


def run(kind: str, world: int, context: int, prompt_tokens: int, prompts: int, args) -> dict:
    """Fresh processes for one row; returns it."""
    result = os.path.join(tempfile.mkdtemp(), "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
           "--worker", "--context", str(context), "--prompt-tokens", str(prompt_tokens), "--prompts", str(prompts),
           "--response-tokens", str(args.response_tokens), "--steps", str(args.steps), "--result", result]
    load = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    with open(result) as f:
        t = json.load(f)["step_time_s"]
    return dict(kind=kind, world=world, context=context, prompt_tokens=prompt_tokens, prompts_per_step=prompts,
                group=4, response_tokens=args.response_tokens, step_time_s=round(t, 3),
                prompts_per_s=round(prompts / t, 4), load_before=round(load, 2),
                load_after=round(os.getloadavg()[0], 2), cores=os.cpu_count())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--step-prompt-tokens", type=int, default=32768)
    ap.add_argument("--rate-prompt-tokens", type=int, default=8192)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = [run("step", 1, 1, args.step_prompt_tokens, 1, args), run("step", 2, 2, args.step_prompt_tokens, 1, args),
            run("rate", 1, 1, args.rate_prompt_tokens, 2, args), run("rate", 2, 1, args.rate_prompt_tokens, 2, args)]
    print(f"{'kind':5} {'W':>2} {'C':>2} {'P':>6} {'prompts':>7} {'step s':>8} {'prompts/s':>9} {'load':>10}")
    for r in rows:
        print(f"{r['kind']:5} {r['world']:>2} {r['context']:>2} {r['prompt_tokens']:>6} {r['prompts_per_step']:>7} "
              f"{r['step_time_s']:>8.2f} {r['prompts_per_s']:>9.3f} {r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
    step_ratio = rows[1]["step_time_s"] / rows[0]["step_time_s"]
    rate_ratio = rows[3]["prompts_per_s"] / rows[2]["prompts_per_s"]
    print(f"step W=2 C=2 / W=1: {step_ratio:.2f}x (target <= 0.65x); prompts/s W=2 C=1 / W=1: {rate_ratio:.2f}x "
          "(target >= 1.7x)")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(json.dumps({"step_ratio_w2c2": round(step_ratio, 3), "rate_ratio_w2c1": round(rate_ratio, 3),
                      "rows": rows}))


if __name__ == "__main__":
    main()
