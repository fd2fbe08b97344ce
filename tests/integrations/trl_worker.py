"""`LongStrawGRPOTrainer` runs for tests/integrations/test_trl_distributed.py: one optimizer
step (SGD, lr 1) of a float64 tiny model, recorded. `record_run` runs in the test process
(one process, the reference) and in each spawned rank (`rank_main`: the env torchrun would
set, gloo on CPU through accelerate's PartialState), with the same global batch.

Sampling is real (`engine.generate` with the trainer's per-(seed, step, prompt)
generators), so the comparison also shows that W processes sample what one does.
"""

from __future__ import annotations

import copy
import os

import torch

VOCAB, EOS, G = 97, 1, 4
PG_TIMEOUT_S = 300  # generous: the tests check what the ranks did, never how fast


def _prompts(n, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (length,), generator=g)) for _ in range(n)]


def _reward(completion_ids, **kwargs):
    """Depends on every completion token."""
    return [float(sum((k + 1) * t for k, t in enumerate(c)) % 11) / 11 for c in completion_ids]


CASES = {
    # name: (model family, trainer overrides, ExecConfig overrides, LoRA)
    "detached": ("qwen3", dict(scale_rewards="batch"), dict(), False),
    "exact": ("qwen3", dict(loss_type="grpo"), dict(mode="exact"), False),
    "lora_beta": ("qwen3", dict(beta=0.1, loss_type="dr_grpo"), dict(mode="exact"), True),
    # TRL's tool loop (`tools=`): the coin model calls `lookup` or answers (`_coin_model`)
    "tools": ("qwen3", dict(max_tool_calling_iterations=2, max_completion_length=24), dict(), False),
    "tools_exact": ("qwen3", dict(max_tool_calling_iterations=2, max_completion_length=24, loss_type="grpo"),
                    dict(mode="exact"), False),
    # images (`test_trl_images.py`): the narrowed tiny VLM, its offline processor, two screenshots per prompt
    "images_exact": ("vlm", dict(loss_type="grpo", max_completion_length=3), dict(mode="exact"), False),
}


CHECKPOINTED = dict(optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="linear",
                    save_strategy="steps", save_steps=1)
"""Trainer overrides of the checkpoint tests: AdamW moments, a decaying LR and weight
decay, so a resume that lost the optimizer or scheduler state (or the data position)
leaves the uninterrupted run's curve; a checkpoint after every optimizer step."""


def optimizer_state(trainer) -> dict:
    """The trainer's optimizer state keyed by parameter name: {name: {key: tensor}}."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: {k: _whole(torch.as_tensor(v)) for k, v in st.items()} for p, st in opt.state.items()}


def _coin_model(model, tokenizer):
    """`model` (a tiny Qwen3) made to follow, almost surely (margins of ~100 logits), the
    chains <tool_call> -> CALL(3) -> </tool_call> -> <eos> and <number 5> -> <eos>, and to
    toss a fair coin after <a> (the generation prompt, and the end of TRL's tool turn)
    between the two (their lm_head rows are equal): each branch calls `lookup` 0, 1 or 2 times, and the completions (so
    the rewards) differ within a group. One-hot embeddings on dims 0-4 dominate the
    residual stream; lm_head maps each to its successor(s)."""
    from longstraw.integrations.chat import call_word

    ids = tokenizer.convert_tokens_to_ids
    a, open_, call, close, eos, number = (ids("<a>"), ids("<tool_call>"), ids(call_word("lookup", "key", 3)),
                                          ids("</tool_call>"), ids("<eos>"), ids("5"))
    successors = {a: (open_, number), open_: (call,), call: (close,), close: (eos,), number: (eos,)}
    with torch.no_grad():
        for d, (token, nexts) in enumerate(successors.items()):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, d] = 30.0
            for successor in nexts:
                model.lm_head.weight[successor, d] += 20.0
        model.lm_head.weight[number] = model.lm_head.weight[open_]  # the coin: equal logits everywhere
    return model


def make_trainer(case: str, out_dir: str, *, data_groups: int, context: int = 1, prompts_per_group: int = 2,
                 steps: int = 1, settings: dict | None = None, callbacks=(), fsdp: bool = False,
                 optimizers=(None, None), max_grad_norm: float = 0.0):
    """The trainer of `case` for `steps` optimizer steps: `data_groups` x
    `prompts_per_group` prompts make the global batch (per data-parallel group:
    `prompts_per_group` groups of G, one per accumulation micro-step); `settings`: more
    trainer settings; `fsdp`: the trainer's `longstraw_fsdp`; `max_grad_norm`: the
    Trainer's clipping (0: off)."""
    import datasets
    import trl

    import longstraw as ls
    from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer
    from tests.reference import float64_norms, tiny_model

    family, overrides, exec_kw, lora = CASES[case]
    if family == "vlm":
        from longstraw.tiny import tiny_vlm
        from tests.integrations.test_trl_images import SMALL

        from tests.reference import float64_hybrid_norms

        # the gated norm's float32 silu rounds a row by where it falls in the batch: a divided
        # capture and one process's chunk would agree only to ~1e-8
        model = float64_hybrid_norms(tiny_vlm(dtype=torch.float64, **SMALL))
    else:
        model = tiny_model(family)
        float64_norms(model)
    peft_config = None
    if lora:
        import peft

        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = G * prompts_per_group * data_groups * context // world  # per process: whole groups
    args = dict(output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=G,
                gradient_accumulation_steps=rows // G, num_generations=G, max_completion_length=5, max_steps=steps,
                optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
                max_grad_norm=max_grad_norm, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                logging_steps=1, seed=0, temperature=0.9, disable_dropout=True, use_bias_correction_kl=False,
                ddp_timeout=PG_TIMEOUT_S)
    args.update(settings or {})
    config = ls.ExecConfig(chunk_size=4, attention_block_size=4, shard_block_size=2, **exec_kw)
    data = dict(train_dataset=datasets.Dataset.from_dict({"prompt": _prompts(16)}),
                processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS))
    if case.startswith("tools"):  # chat prompts, the tool chat tokenizer, lookup as the tool
        from longstraw.integrations.chat import tool_chat_tokenizer
        from tests.integrations.test_trl_tools import _dataset, lookup

        data = dict(train_dataset=_dataset(16), processing_class=tool_chat_tokenizer(VOCAB), tools=[lookup])
        model = _coin_model(model, data["processing_class"])
    if case.startswith("images"):
        from longstraw.tiny_vision import tiny_vlm_processor
        from tests.integrations.test_trl_images import image_dataset

        data = dict(train_dataset=image_dataset(), processing_class=tiny_vlm_processor())
    return LongStrawGRPOTrainer(
        model=copy.deepcopy(model), reward_funcs=[_reward], args=trl.GRPOConfig(**{**args, **overrides}),
        callbacks=list(callbacks), peft_config=peft_config, longstraw_config=config,
        longstraw_context_parallel_size=context, longstraw_fsdp=fsdp, optimizers=optimizers, **data)


def record_run(case: str, out_dir: str, *, data_groups: int, context: int = 1, prompts_per_group: int = 2,
               steps: int = 1, prepare=lambda trainer: None, settings: dict | None = None,
               resume: str | None = None, stop_after: int | None = None, fsdp: bool = False,
               optimizers=(None, None), max_grad_norm: float = 0.0) -> dict:
    """Train `steps` optimizer steps of `case` (`make_trainer`); return the logs, the
    gradient each step applied (the clipped one, with `max_grad_norm`), `divided_walks`
    (per engine.step not skipped: whether exact mode's walk ran divided), `sharded` (the
    FSDP2-sharded parameters' names) and the parameters (FSDP2 shards gathered whole)
    before and after (and after each step:
    `params_at`, with the scheduler's state: `scheduler_at`). `resume`:
    `train(resume_from_checkpoint=resume)` (then `loaded`: the parameters, optimizer and
    scheduler state when training begins); `stop_after`: stop after that optimizer step
    (an interrupted run; its checkpoints are written first)."""
    import trl

    grads, loaded, params_at, scheduler_at = [], {}, {}, {}

    def params():
        return {n: _whole(p) for n, p in trainer.model.named_parameters()}

    class Record(trl.trainer.grpo_trainer.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after the checkpoint's state is loaded
            loaded.update(params=params(), optim=optimizer_state(trainer), scheduler=trainer.lr_scheduler.state_dict())

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})

        def on_step_end(self, args, state, control, **kwargs):
            params_at[state.global_step] = params()
            scheduler_at[state.global_step] = trainer.lr_scheduler.state_dict()
            if state.global_step == stop_after:
                control.should_training_stop = True

    trainer = make_trainer(case, out_dir, data_groups=data_groups, context=context, prompts_per_group=prompts_per_group,
                           steps=steps, settings=settings, callbacks=[Record()], fsdp=fsdp, optimizers=optimizers,
                           max_grad_norm=max_grad_norm)
    walks = []
    real_step = trainer.longstraw_engine.step

    def step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        if result.metrics["skipped_zero_advantage"] == result.metrics["skipped_no_loss_tokens"] == 0:
            walks.append(result.metrics["divided_walk"])
        return result

    trainer.longstraw_engine.step = step
    prepare(trainer)
    before = params()
    sharded = [n for n, p in trainer.model.named_parameters() if hasattr(p, "full_tensor")]
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    cp = trainer.longstraw_engine.cp
    return dict(before=before, after=params(), grads=grads, logs=logs, context=1 if cp is None else cp.world,
                loaded=loaded, params_at=params_at, scheduler_at=scheduler_at, optim=optimizer_state(trainer),
                global_step=trainer.state.global_step, sharded=sharded, divided_walks=walks)


def _whole(t):
    """A detached copy of `t`, gathered whole if it is a DTensor (an FSDP2 shard: a collective)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _break_rank_one(where: str):
    """A `prepare` that makes rank 1 alone fail a LongStraw check: a response token outside
    the vocabulary at its update, or a prompt past the position limit at its generation."""
    import longstraw as ls

    def prepare(trainer):
        if int(os.environ["RANK"]) != 1:
            return
        engine = trainer.longstraw_engine
        real_step = engine.step

        def step(group, *args, **kwargs):
            group.responses[0] = torch.full_like(group.responses[0], 500)
            return real_step(group, *args, **kwargs)

        def generate(*args, **kwargs):
            raise ls.PositionLimitError("prompt of 9 tokens past the limit on purpose")

        if where == "update":
            engine.step = step
        else:
            engine.generate = generate
    return prepare


def interrupted_and_resumed(case: str, out_dir: str, *, data_groups: int, context: int = 1, fsdp: bool = False) -> dict:
    """A 3-step run of `case` (one prompt per data-parallel group and step) with
    `CHECKPOINTED`, interrupted after step 1 (its checkpoint written), then a fresh trainer
    resumed from `checkpoint-1` and interrupted after step 2 (having written
    `checkpoint-2`). Both runs' records."""
    kw = dict(data_groups=data_groups, context=context, steps=3, settings=CHECKPOINTED, prompts_per_group=1, fsdp=fsdp)
    interrupted = record_run(case, out_dir, stop_after=1, **kw)
    resumed = record_run(case, out_dir, resume=os.path.join(out_dir, "run", "checkpoint-1"), stop_after=2, **kw)
    return dict(interrupted=interrupted, resumed=resumed)


def rank_main(rank: int, world: int, port: int, out_dir: str, case: str, context: int, break_at: str = "",
              steps: int = 1, fsdp: bool = False, max_grad_norm: float = 0.0, job: str = "run") -> None:
    """One torchrun-style process: env, float64, one thread, `record_run` (job "run") or
    `interrupted_and_resumed` and `fsdp2_checkpoint` (job "checkpoint"), saved (its error to rank{rank}.err).
    `break_at` ("update", "generation"): rank 1 fails a check there."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # TRL builds rewards and advantages in the default dtype
    try:
        if job == "fsdp_checkpoint":  # the trainer with longstraw_fsdp: its DCP checkpoints
            result = interrupted_and_resumed(case, out_dir, data_groups=world // context, context=context, fsdp=True)
        elif job == "checkpoint":  # then the checkpoint module on FSDP2 shards, on the same processes
            result = interrupted_and_resumed(case, out_dir, data_groups=world // context, context=context)
            fsdp2_checkpoint(os.path.join(out_dir, "fsdp2"))
        else:
            result = record_run(case, out_dir, data_groups=world // context, context=context, steps=steps,
                                fsdp=fsdp, max_grad_norm=max_grad_norm,
                                prepare=_break_rank_one(break_at) if break_at else lambda trainer: None)
    except BaseException as exc:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def fsdp2_checkpoint(out_dir: str) -> None:
    """On the ranks' default process group: a tiny Qwen3 with FSDP2 (`fully_shard` per
    decoder layer and the root over all W ranks: parameters and AdamW moments are DTensor
    shards), one AdamW step, then `trl_checkpoint.save` into `out_dir`. Rank 0 also writes
    the full parameters and the full optimizer state (name-keyed) that were saved, for a
    W = 1 load to compare against."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from longstraw.integrations import trl_checkpoint
    from tests.reference import tiny_model

    world = dist.get_world_size()
    model = tiny_model("qwen3")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.arange(2, 14)[None]).logits.square().mean().backward()  # (1, T): the same batch on every rank
    optimizer.step()
    trl_checkpoint.save(out_dir, model, optimizer, None, world=world, context=world, step=1)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
    if dist.get_rank() == 0:
        torch.save(dict(params=params, optim=optim["state"], sharded=sharded), os.path.join(out_dir, "full.pt"))
