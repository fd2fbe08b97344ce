"""GRPO on many processes with a plain torch loop: the template for users who bring their own.

    torchrun --nproc-per-node 4 examples/torchrun_grpo.py --context-parallel 2 --steps 50
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/torchrun_grpo.py --context-parallel 8

W processes form W / C data-parallel groups of C context-parallel ranks (`parallel.mesh`):
the C ranks of a group run each prompt together (`ExecConfig(context_parallel=True)` on
their process group), the groups take different prompts. The decoder layers are FSDP2
(`parallel.sharding.shard_model`: each layer resharded after its forward) over the C ranks of a group (the ranks that run the same sequences, so
their FSDP2 collectives pair up; in exact mode the divided reverse walk sums their
partial gradients through FSDP2's own reduce-scatter, `parallel/fsdp.py`). Every group
steps with the divisors of the whole global batch (`parallel.data.global_totals`), and
one bucketed all-reduce across the groups (`reduce_gradients`: FSDP2 shards and the
replicated embeddings, norm and lm_head alike) gives every rank the gradient one process
would compute over that batch. Then AdamW. Checkpoints are torch.distributed.checkpoint
(DCP), sharded, and load at any W.

The model: `--model tiny:<family>` (longstraw.tiny, random weights) or a path to an HF
config (config.json or its folder; random weights). The task: longstraw.tasks.KVRecall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm import tqdm

import longstraw as ls
from longstraw.checkpoint import commit_step_dir, prune_step_dirs, read_marker, step_dir
from longstraw.parallel.collectives import all_reduce_sum
from longstraw.parallel.data import global_totals, process_group_view, reduce_gradients
from longstraw.parallel.launch import (collective_timeout, device_mesh, init_distributed, inject_delay, inject_signal, phase,
                                      restart_count)
from longstraw.parallel.nonfinite import DEFAULT_MAX_NONFINITE_STEPS, NonFiniteGuard, inject
from longstraw.parallel.mesh import Mesh, mesh_groups
from longstraw.parallel.sharding import shard_model
from longstraw.tasks import KVRecall, Vocab
from longstraw.tiny import tiny_model


def build_model(name: str, vocab_size: int, positions: int, dtype: torch.dtype):
    """`tiny:<family>` or an HF config path, random weights (seed 0), the task's vocabulary."""
    torch.manual_seed(0)
    if name.startswith("tiny:"):
        return tiny_model(name[5:], dtype=dtype, vocab_size=vocab_size, max_position_embeddings=positions)
    config = transformers.AutoConfig.from_pretrained(name, vocab_size=vocab_size)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def sample_seed(seed: int, step: int, index: int) -> torch.Generator:
    """Sampling as a function of (seed, step, prompt): the same completions at any W and C."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + index)


def save(path: str, model, optimizer, step: int, guard: NonFiniteGuard, keep: int = 0) -> None:
    """A sharded DCP checkpoint at path/step-N, complete or absent: written as
    step-N.partial, renamed once every rank's shard is on disk, then path/latest names it
    (atomically). The checkpoint marked before stays until then; `keep` > 0 prunes all
    but the newest `keep` after."""
    model_state, optim_state = get_state_dict(model, optimizer)
    target = step_dir(path, step)
    partial = target + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
    dist.barrier()
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step),
             "nonfinite": torch.tensor([guard.in_row, guard.total])}
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every shard and the metadata are written (and fsynced: FileSystemWriter's sync_files)
    if dist.get_rank() == 0:
        inject_signal(step, 0, "save")  # test hooks: a kill between the shards and the marker, and inside it
        commit_step_dir(partial, target, between=lambda: inject_signal(step, 0, "marker"))
        prune_step_dirs(path, keep)
    dist.barrier()


def load(target: str, model, optimizer, guard: NonFiniteGuard) -> int:
    """Load a DCP checkpoint written at any W into this run's shards; returns its step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0), "nonfinite": torch.tensor([0, 0])}
    dcp.load(state, checkpoint_id=target)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    guard.load_state({"in_row": int(state["nonfinite"][0]), "total": int(state["nonfinite"][1])})
    return int(state["step"])


def resume_target(resume: str, checkpoint_dir: str) -> str | None:
    """--resume: a step-N folder, or "latest": the one checkpoint_dir/latest names, None
    (start from step 0) when there is no marker yet: the same flags start a run and
    restart it (torchrun --max-restarts)."""
    if resume != "latest":
        return resume or None
    if not checkpoint_dir:
        raise SystemExit("--resume latest needs --checkpoint-dir")
    return read_marker(checkpoint_dir)


def grpo_step(engine, task, grpo, args, step: int, dp: int, num_data: int, data):
    """This group's prompts of the global batch: rollouts, rewards and `engine.step` with
    the global batch's divisors (gradients accumulate in .grad). Returns (loss, groups)."""
    first = (step * num_data + dp) * args.prompts
    items = [task.item("train", first + b) for b in range(args.prompts)]
    rollouts, batch = [], []
    for b, item in enumerate(items):
        ro = engine.generate(item.prompt, num_samples=args.group_size, max_new_tokens=task.num_queries + 1,
                             temperature=1.0, eos_token_id=Vocab.EOS, generator=sample_seed(args.seed, step, first + b))
        rewards = torch.tensor([task.reward(item, r) for r in ro.responses], dtype=torch.float64)
        rollouts.append(ro)
        batch.append(ls.Group(prompt=item.prompt, responses=ro.responses, rewards=rewards))
    totals = global_totals(batch, data)  # the global batch's divisors: the groups' gradients add up
    loss = sum(engine.step(g, grpo, totals=totals, state=ro.state).loss for g, ro in zip(batch, rollouts))
    return loss, batch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:qwen3")
    ap.add_argument("--context-parallel", type=int, default=0, help="C, ranks per prompt (0: all W)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per data-parallel group per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--facts", type=int, default=4, help="key-value facts per prompt (KVRecall)")
    ap.add_argument("--values", type=int, default=8, help="distinct answer values (fewer: easier)")
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--filler", type=int, default=80, help="distinct filler tokens")
    ap.add_argument("--mode", default="detached", choices=("detached", "exact"))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--save-every", type=int, default=0, help="0: only at the end")
    ap.add_argument("--resume", default="", help="a step-N folder, or 'latest' (from --checkpoint-dir)")
    ap.add_argument("--keep-checkpoints", type=int, default=0, help="keep the newest N step-N folders (0: all)")
    ap.add_argument("--max-nonfinite-steps", type=int, default=DEFAULT_MAX_NONFINITE_STEPS,
                    help="skipped non-finite steps in a row before NonFiniteError")
    ap.add_argument("--dump", default="", help="write the full final weights here (rank 0, torch.save)")
    args = ap.parse_args(argv)

    _, device = init_distributed()  # restartable under torchrun, with LONGSTRAW_COLLECTIVE_TIMEOUT
    if not dist.is_initialized():  # one process without torchrun: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=collective_timeout())
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(world=world, context=args.context_parallel or world)
    groups = mesh_groups(mesh, timeout=collective_timeout())  # this rank's (dp, cp) and its process groups
    data = process_group_view(groups.data_group)  # across data-parallel groups (None: one group)

    task = KVRecall(args.prompt_tokens, num_facts=args.facts, vocab=Vocab(num_values=args.values, num_keys=args.keys,
                                                                      num_filler=args.filler))
    model = build_model(args.model, task.vocab.size, args.prompt_tokens + 64, getattr(torch, args.dtype)).to(device)
    fsdp_mesh = device_mesh(device.type, (mesh.data, mesh.context), ("dp", "cp"))["cp"]  # the stated timeout
    shard_model(model, fsdp_mesh)  # FSDP2 per decoder layer over the group's C ranks, resharded; the rest replicated
    engine = ls.Engine(model, ls.ExecConfig(mode=args.mode, chunk_size=args.chunk_size,
                                            context_parallel=mesh.context > 1),
                       process_group=groups.context_group)
    grpo = ls.GRPOConfig(loss_type="dapo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    guard = NonFiniteGuard(max_in_row=args.max_nonfinite_steps)
    target = resume_target(args.resume, args.checkpoint_dir)
    start = load(target, model, optimizer, guard) if target else 0

    step_seconds = []  # each step's rollouts and update, wall time (in the final JSON line)
    bar = tqdm(range(start, args.steps), disable=rank != 0, desc=f"GRPO W={world} C={mesh.context}")
    for step in bar:
        inject_signal(step, rank)  # test hook (LONGSTRAW_FAULT kill@R:S / stop@R:S)
        began = time.monotonic()
        with phase(f"step {step}: rollouts and update"), inject_delay(model.model.layers, step, rank):  # slow@R:S
            loss, batch = grpo_step(engine, task, grpo, args, step, groups.dp, mesh.data, data)
        step_seconds.append(round(time.monotonic() - began, 3))
        with phase(f"step {step}: gradient all-reduce and non-finite check"):
            reduce_gradients(model.parameters(), data)  # every group's share, summed: one process's gradient
            inject(model.parameters(), step, rank)  # test hook (LONGSTRAW_FAULT nan@R:S)
            finite = guard.agree(model.parameters(), device=device)  # one 8-byte all-reduce over every rank
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        guard.record(finite, step)  # NonFiniteError at max_nonfinite_steps in a row
        with phase(f"step {step}: metrics"):
            stats = torch.tensor([loss, float(sum(g.rewards.mean() for g in batch)), float(len(batch))],
                                 dtype=torch.float64)
            if data is not None:
                all_reduce_sum(stats, data)
        bar.set_postfix(loss=f"{stats[0]:.4f}", reward=f"{stats[1] / stats[2]:.3f}", skipped=guard.total)
        if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
            with phase(f"step {step}: checkpoint"):
                save(args.checkpoint_dir, model, optimizer, step + 1, guard, args.keep_checkpoints)
    if args.checkpoint_dir and not args.save_every:
        save(args.checkpoint_dir, model, optimizer, args.steps, guard, args.keep_checkpoints)
    if rank == 0:
        print(json.dumps({"steps": args.steps, "start": start, "restart_count": restart_count(),
                          "skipped_nonfinite_steps": guard.total, "nonfinite_in_row": guard.in_row,
                          "step_seconds": step_seconds}), flush=True)
    if args.dump:
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, args.dump)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
