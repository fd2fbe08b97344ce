"""GRPO on many processes with a plain torch loop: the template for users who bring their own.

    torchrun --nproc-per-node 4 examples/torchrun_grpo.py --context-parallel 2 --steps 50
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/torchrun_grpo.py --context-parallel 8

W processes form W / C data-parallel groups of C context-parallel ranks (`parallel.mesh`):
the C ranks of a group run each prompt together (`ExecConfig(context_parallel=True)` on
their process group), the groups take different prompts. The decoder layers are FSDP2
(`fully_shard`) over the C ranks of a group (the ranks that run the same sequences, so
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
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import longstraw as ls
from longstraw.parallel.collectives import all_reduce_sum
from longstraw.parallel.data import global_totals, process_group_view, reduce_gradients
from longstraw.parallel.mesh import Mesh, mesh_groups
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


def save(path: str, model, optimizer, step: int) -> None:
    """A sharded DCP checkpoint at path/step-N, then path/latest names it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    target = os.path.join(path, f"step-{step}")
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=target)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(target)


def load(target: str, model, optimizer) -> int:
    """Load a DCP checkpoint written at any W into this run's shards; returns its step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=target)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


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
    ap.add_argument("--dump", default="", help="write the full final weights here (rank 0, torch.save)")
    args = ap.parse_args(argv)

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(world=world, context=args.context_parallel or world)
    groups = mesh_groups(mesh)  # this rank's (dp, cp) and its process groups
    data = process_group_view(groups.data_group)  # across data-parallel groups (None: one group)

    task = KVRecall(args.prompt_tokens, num_facts=args.facts, vocab=Vocab(num_values=args.values, num_keys=args.keys,
                                                                      num_filler=args.filler))
    model = build_model(args.model, task.vocab.size, args.prompt_tokens + 64, getattr(torch, args.dtype)).to(device)
    fsdp_mesh = init_device_mesh(device.type, (mesh.data, mesh.context), mesh_dim_names=("dp", "cp"))["cp"]
    for layer in model.model.layers:  # FSDP2 per decoder layer over the group's C ranks; the rest replicated
        fully_shard(layer, mesh=fsdp_mesh)
    engine = ls.Engine(model, ls.ExecConfig(mode=args.mode, chunk_size=args.chunk_size,
                                            context_parallel=mesh.context > 1),
                       process_group=groups.context_group)
    grpo = ls.GRPOConfig(loss_type="dapo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        target = args.resume
        if target == "latest":
            with open(os.path.join(args.checkpoint_dir, "latest")) as f:
                target = f.read().strip()
        start = load(target, model, optimizer)

    bar = tqdm(range(start, args.steps), disable=rank != 0, desc=f"GRPO W={world} C={mesh.context}")
    for step in bar:
        first = (step * mesh.data + groups.dp) * args.prompts  # this group's prompts of the global batch
        items = [task.item("train", first + b) for b in range(args.prompts)]
        rollouts, batch = [], []
        for b, item in enumerate(items):
            ro = engine.generate(item.prompt, num_samples=args.group_size, max_new_tokens=task.num_queries + 1,
                                 temperature=1.0, eos_token_id=Vocab.EOS,
                                 generator=sample_seed(args.seed, step, first + b))
            rewards = torch.tensor([task.reward(item, r) for r in ro.responses], dtype=torch.float64)
            rollouts.append(ro)
            batch.append(ls.Group(prompt=item.prompt, responses=ro.responses, rewards=rewards))
        totals = global_totals(batch, data)  # the global batch's divisors: the groups' gradients add up
        loss = sum(engine.step(g, grpo, totals=totals, state=ro.state).loss for g, ro in zip(batch, rollouts))
        reduce_gradients(model.parameters(), data)  # every group's share, summed: one process's gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats = torch.tensor([loss, float(sum(g.rewards.mean() for g in batch)), float(len(batch))],
                             dtype=torch.float64)
        if data is not None:
            all_reduce_sum(stats, data)
        bar.set_postfix(loss=f"{stats[0]:.4f}", reward=f"{stats[1] / stats[2]:.3f}")
        if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
            save(args.checkpoint_dir, model, optimizer, step + 1)
    if args.checkpoint_dir and not args.save_every:
        save(args.checkpoint_dir, model, optimizer, args.steps)
    if args.dump:
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, args.dump)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
