"""The trainer on many GPUs (NCCL): one optimizer step of `LongStrawGRPOTrainer` at W = 1
against W = 2 (C = 2, one prompt over both ranks; C = 1, plain data parallelism) and,
where there are more GPUs, W = 4 and 8 (C = W), on the tiny hybrid (`longstraw.tiny`,
qwen3_5: Gated DeltaNet + attention).

What it shows: the CPU tests (gloo, float64, tests/integrations/test_trl_distributed.py)
prove that W processes give one process's update over the same global batch; this runs
the same step over NCCL on CUDA, where the collectives, the device placement of
accelerate's process groups and the CUDA kernels differ. Every run takes the same global
batch (4 prompts x G; a data-parallel group takes 4 / D of them), and sampling is a
function of (seed, step, prompt), so every W samples the same completions; the loss and
every gradient must then agree with W = 1 within float32 rounding (`--tol`).

Each W runs in fresh processes under `torchrun --nproc-per-node W` (one rank per GPU,
`cuda:LOCAL_RANK`, NCCL through accelerate). A W with more ranks than GPUs is skipped,
with the reason in the JSON (NCCL needs one GPU per rank): on one GPU only W = 1 runs
and the check says that nothing was compared. Without CUDA (`--cpu`, the smoke run of
`bench/gpu_suite.py --cpu`) the same script runs on CPU (gloo, one thread per rank), a
test of its own logic, not a GPU measurement.

    python bench/gpu/trainer.py            # every W the GPUs allow
    python bench/gpu/trainer.py --cpu      # CPU smoke run: W = 1 against W = 2, C = 2

Ends with one JSON line: {"bench": "gpu_trainer", "device", "runs": [{"world", "context",
"loss", "loss_rel_diff", "grad_rel_diff", "reward", "completions_equal", "wall_s"}],
"skipped": [reasons], "compared", "all_ok"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VOCAB, EOS, G, PROMPTS = 97, 1, 4, 4  # the global batch: PROMPTS prompts x G completions


def _reward(completion_ids, **kwargs):
    """Depends on every completion token."""
    return [float(sum((k + 1) * t for k, t in enumerate(c)) % 11) / 11 for c in completion_ids]


def rank_main(args) -> None:
    """One rank under torchrun: one optimizer step (SGD, lr 1); rank 0 writes the logged
    loss and reward, the completions and every gradient the step applied."""
    import datasets
    import torch
    import torch.distributed as dist
    import trl

    import longstraw as ls
    from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer
    from longstraw.tiny import tiny_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    gpu = torch.cuda.is_available() and not args.cpu
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    data = world // args.context
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (args.prompt_tokens,), generator=g))
               for _ in range(16)]
    model = tiny_model("qwen3_5", vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    grads, seen = [], []

    class Record(trl.trainer.grpo_trainer.TrainerCallback):
        def on_pre_optimizer_step(self, a, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()
                          if p.grad is not None})

    def reward(completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return _reward(completion_ids)

    per_group = PROMPTS // data
    targs = trl.GRPOConfig(
        output_dir=os.path.join(args.tmp, f"W{world}C{args.context}"), per_device_train_batch_size=G,
        gradient_accumulation_steps=per_group, num_generations=G, max_completion_length=args.response_tokens,
        max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, use_cpu=not gpu, bf16=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        temperature=0.9, disable_dropout=True, ddp_timeout=300)
    trainer = LongStrawGRPOTrainer(
        model=model, reward_funcs=[reward], args=targs, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS), callbacks=[Record()],
        longstraw_config=ls.ExecConfig(chunk_size=args.chunk_size, attention_block_size=args.chunk_size),
        longstraw_context_parallel_size=args.context)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    if world > 1:  # every data-parallel group's completions (the C ranks of a group saw the same)
        parts = [None] * world
        dist.all_gather_object(parts, seen)
        seen = [c for r, part in enumerate(parts) if r % args.context == 0 for c in part]
    if rank == 0:
        torch.save(dict(loss=log["loss"], reward=log["reward"], grads=grads[0], completions=sorted(seen),
                        device=str(trainer.accelerator.device)), args.result)
    if world > 1:  # leave together: a rank whose peer exited first can abort in the backend's teardown
        dist.barrier()
        dist.destroy_process_group()


def _compare(run: dict, base: dict) -> dict:
    """Loss and gradient agreement of `run` with W = 1 (relative, max over parameters)."""
    loss_rel = abs(run["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
    grad_rel = max(float((run["grads"][n] - g).abs().max() / max(float(g.abs().max()), 1e-12))
                   for n, g in base["grads"].items())
    return dict(loss_rel_diff=loss_rel, grad_rel_diff=grad_rel, completions_equal=run["completions"] == base["completions"],
                same_parameters=run["grads"].keys() == base["grads"].keys())


def plan_meshes(gpu: bool, devices: int) -> tuple[list[tuple[int, int]], list[str]]:
    """The (W, C) runs this machine allows, W = 1 first, and why each other one is skipped:
    on CUDA W = 2 (C = 2, C = 1), 4 and 8 (C = W) where W GPUs exist (NCCL: one per
    rank); on CPU (gloo) W = 1 against W = 2, C = 2."""
    wanted = [(1, 1), (2, 2), (2, 1), (4, 4), (8, 8)] if gpu else [(1, 1), (2, 2)]
    runs = [(w, c) for w, c in wanted if not gpu or w <= devices]
    skipped = [f"W={w} C={c}: {devices} CUDA device(s) here, NCCL needs one GPU per rank"
               for w, c in wanted if (w, c) not in runs]
    if len(runs) == 1:
        skipped.append("nothing compared: W = 1 ran alone (the trainer on one GPU); W = 2 needs 2 GPUs")
    return runs, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU smoke run (gloo): W = 1 against W = 2, C = 2")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--response-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--tol", type=float, default=1e-4, help="relative loss / gradient agreement (float32)")
    ap.add_argument("--rank", action="store_true")
    ap.add_argument("--context", type=int, default=1)
    ap.add_argument("--result")
    ap.add_argument("--tmp")
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    meshes, skipped = plan_meshes(gpu, torch.cuda.device_count() if gpu else 0)
    for reason in skipped:
        print(reason, flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, context in meshes:
            result = os.path.join(tmp, f"W{world}C{context}.pt")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   os.path.abspath(__file__), "--rank", "--context", str(context), "--result", result, "--tmp", tmp,
                   "--prompt-tokens", str(args.prompt_tokens), "--response-tokens", str(args.response_tokens),
                   "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size)] + (["--cpu"] if args.cpu else [])
            env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "OMP_NUM_THREADS": "1"}
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=env, cwd=REPO)
            got = torch.load(result, weights_only=False)
            got.update(world=world, context=context, wall_s=round(time.perf_counter() - t0, 2))
            runs.append(got)
    base = runs[0]
    rows = []
    for run in runs:
        row = dict(world=run["world"], context=run["context"], loss=run["loss"], reward=run["reward"],
                   device=run["device"], wall_s=run["wall_s"])
        if run is not base:
            row.update(_compare(run, base))
            row["ok"] = (row["loss_rel_diff"] <= args.tol and row["grad_rel_diff"] <= args.tol
                         and row["completions_equal"] and row["same_parameters"])
        rows.append(row)
        extra = "" if run is base else (f"  loss rel {row['loss_rel_diff']:.2e}  grad rel {row['grad_rel_diff']:.2e}  "
                                         f"same completions {row['completions_equal']}")
        print(f"W={run['world']} C={run['context']} loss {run['loss']:.6f} reward {run['reward']:.4f} "
              f"{run['wall_s']:.1f} s{extra}", flush=True)
    compared = [r for r in rows if "ok" in r]
    print(json.dumps({"bench": "gpu_trainer", "device": torch.cuda.get_device_name(0) if gpu else "cpu (smoke test)",
                      "tol": args.tol, "runs": rows, "skipped": skipped, "compared": len(compared),
                      "all_ok": all(r["ok"] for r in compared)}))


if __name__ == "__main__":
    main()
