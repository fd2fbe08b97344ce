"""TRL integration: `LongStrawGRPOTrainer`, TRL's `GRPOTrainer` whose rollouts and
update run through LongStraw. A TRL user changes one class:

    from longstraw.integrations.trl import LongStrawGRPOTrainer
    trainer = LongStrawGRPOTrainer(model=model, reward_funcs=[reward_fn], args=trl.GRPOConfig(...),
                                   train_dataset=dataset, longstraw_config=ls.ExecConfig(mode="exact"))
    trainer.train()

What stays TRL's: the data loader and its RepeatSampler (each prompt num_generations
times in a row), tokenisation (each distinct prompt once), rewards, advantages, logging,
checkpoints (DCP, loadable at any W: `trl_checkpoint.py`), optimizer, scheduler, clipping.

What LongStraw replaces, through three of GRPOTrainer's hooks:

* `_generate_single_turn`: per prompt, one `engine.generate(prompt, num_samples=G)`
  samples the group from one capture and keeps that capture's state. With tools
  (`tools=`, `environment_factory=`), TRL's own `_tool_call_loop` parses the calls, runs
  the tools and builds `tool_mask`; it calls `_generate_single_turn` again with prompt +
  completion + tool result per sample, and each such continuation is sampled from the
  prompt's held state, the rest absorbed as `generate(prefix=..., state=...)`: no second
  capture anywhere in the tool loop. The update masks with `completion_mask * tool_mask`.
* `_get_per_token_logps_and_entropies`, which TRL calls under no_grad for the old
  log-probs (num_iterations > 1) and for the reference (beta > 0): `engine.score` per
  group, on the rollout's state while it is fresh. The reference is scored by a second
  engine over `ref_model`, or, with PEFT, on the model with the adapter disabled; its
  weights differ from the rollout's, so that is a separate capture.
* `_prepare_inputs` / `training_step`: stock TRL shuffles rows and runs one batched
  full-sequence forward + backward per micro-step, whose graph grows with
  rows x (P + R). Here the generation batch stays whole prompt groups, dealt over the
  gradient-accumulation micro-steps, and each group is one `engine.step(group,
  totals=BatchTotals.of(all groups), state=rollout.state)`: it accumulates `.grad`
  itself (one branch's graph at a time), so the Trainer's backward is skipped. With
  the batch-wide divisors the summed gradient equals TRL's for "dapo", "grpo" and
  "dr_grpo", however the groups fall into micro-steps.

Advantages are TRL's own (every `scale_rewards`); they reach the engine as the rewards
with `scale_rewards="none"` (already centred, so the engine's centring changes nothing).

Memory: each prompt keeps its state until its update (`longstraw_keep_states=False`:
dropped, captured again; with tools: until the tool loop ends). Screen: `trl_screen.py`.

Images (a processor as `processing_class`, TRL's `image` / `images` columns): each group's
processor outputs become its `prompt_inputs` (`trl_images.py`), for generate, score, step.

Many processes (`longstraw_context_parallel_size=C`): W / C data-parallel groups of C
context-parallel ranks (`trl_parallel.py`, docs/distributed.md); `longstraw_fsdp=True`
adds FSDP2 per decoder layer over each context-parallel group (`trl_fsdp.py`).

TRL settings that cannot run here: a `ConfigError` at construction (`unsupported_settings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..config import ExecConfig, GRPOConfig
from longstraw.parallel.context import check_replicas
from longstraw.engine.engine import Engine
from ..errors import ConfigError, ModelStateError, StaleStateError
from ..group import BatchTotals, Group
from ..measure import peak_rss_bytes
from longstraw.engine.rollout import check_state
from longstraw.parallel.launch import collective_timeout, init_distributed  # one restartable init (docs/faults.md)
from longstraw.parallel.mesh import Mesh, mesh_groups
from longstraw.parallel.nonfinite import DEFAULT_MAX_NONFINITE_STEPS, NonFiniteGuard
from longstraw.integrations.trl_settings import LOSS_TYPES, unsupported_settings  # noqa: F401 (public here too)
from longstraw.integrations.trl_settings import turn_off_activation_checkpointing
from longstraw.parallel.data import agreed, global_totals, process_group_view, reduce_gradients, sampling_generator
from longstraw.integrations.trl_parallel import (DataParallelView, check_mesh_settings, reduce_metrics,
                                                 seen_per_data_parallel_group)
from longstraw import quiet
from longstraw.integrations import trl_checkpoint, trl_fsdp
from longstraw.integrations.chat import token_id_tokenizer  # noqa: F401 (public here too)
from longstraw.integrations.trl_budget import check_prompt_tokens, fitted_config, held_prompt_states
from longstraw.integrations.trl_images import group_prompt_inputs  # images: each group's prompt_inputs
from longstraw.integrations.trl_screen import ScreenCallback

try:
    import trl
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("longstraw.integrations.trl needs TRL: pip install 'longstraw[trl]'") from exc

logger = logging.getLogger(__name__)
quiet.install()  # at import: a TRL script builds its GRPOConfig (and its FutureWarning) after this (quiet.py)

SUMMED_KEYS = ("captures", "tool_continuations", "groups", "skipped_zero_advantage", "skipped_no_loss_tokens")
WINDOW_KEYS = SUMMED_KEYS + ("time_capture_s", "time_generate_s", "time_replay_s", "time_reverse_s", "state_bytes",
                             "state_grad_bytes", "peak_memory_bytes", "skipped_nonfinite_steps", "nonfinite_grad")
"""The `longstraw/...` metrics logged per optimizer step (every rank reduces the same keys)."""

# ----------------------------------------------------------------------------
# the trainer


@dataclass
class _Pending:
    """One prompt group between generation and its update."""

    prompt: torch.Tensor  # [P]
    state: object  # the rollout's prompt state, or None once dropped
    prompt_inputs: dict | None = None  # its images (trl_images.py), or None
    group: Group | None = None


class _ReplicaCheck(TrainerCallback):
    """After every `every`-th optimizer step, `check_replicas(model)` over the default group."""

    def __init__(self, model, every: int):
        self.model, self.every = model, every

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            check_replicas(self.model)
        return control


@dataclass
class _MicroBatch:
    """What one gradient-accumulation micro-step steps: whole groups, batch-wide divisors."""

    items: list
    totals: BatchTotals


class LongStrawGRPOTrainer(trl_checkpoint.TrainerCheckpoints, trl.GRPOTrainer):
    """TRL's `GRPOTrainer` with LongStraw's rollouts and update (see the module doc).

    `model`, `reward_funcs`, `args`, `train_dataset`, `eval_dataset`, `processing_class`,
    `reward_processing_classes`, `callbacks`, `optimizers`, `peft_config` and the other
    keyword arguments are as `trl.GRPOTrainer`'s. `args.gradient_checkpointing` is turned
    off (LongStraw bounds activation memory itself); unsupported settings raise
    `ConfigError` (`unsupported_settings`).

    Args:
        longstraw_config: how the engine runs (`ExecConfig`: chunk sizes, mode). Default
            `ExecConfig()` (detached); `mode="exact"` gives the full-sequence gradient.
        longstraw_keep_states: keep each prompt's state from generation to its update
            (default); False drops it after generation (with tools: after the tool loop)
            and captures again at the update.
        longstraw_replica_check_every: every N optimizer steps, check that every process
            holds bitwise the same weights (`parallel.context.check_replicas` over the default
            group; a `DistributedError` stops training if they drifted apart). 0: off; one
            process: nothing to compare.
        longstraw_context_parallel_size: C, the ranks that share one prompt (context
            parallelism, `ExecConfig(context_parallel=True)` over their process group). W
            processes (torchrun / accelerate launch) form W / C data-parallel groups; C
            must divide W. 1 (default): plain data parallelism; W: every rank on one
            prompt. `per_device_train_batch_size` counts rows per data-parallel group.
        longstraw_fsdp: FSDP2, each decoder layer `fully_shard`-ed over the C ranks of its
            context-parallel group on a 2-D (dp, cp) mesh, before the optimizer is made
            (`trl_fsdp.py`; needs C >= 2 and no `optimizers=` optimizer). The sum across
            data-parallel groups stays one all-reduce per step.
        longstraw_max_nonfinite_steps: NaN/inf gradients on any rank skip the step on all ranks
            (`longstraw/skipped_nonfinite_steps`); this many in a row raise `NonFiniteError`.
        longstraw_memory_budget: `ls.fit_config` picks the engine's config for this bytes /
            "80GiB" budget and `longstraw_prompt_tokens` at construction (`trl_budget.py`;
            `longstraw_config`'s non-default fields pinned; `DoesNotFitError` if nothing fits).
        longstraw_prompt_tokens: P, the prompt length `longstraw_memory_budget` is fitted for.
    """

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None, *, longstraw_config: ExecConfig | None = None, longstraw_keep_states: bool = True,
                 longstraw_replica_check_every: int = 0, longstraw_context_parallel_size: int = 1,
                 longstraw_fsdp: bool = False, longstraw_max_nonfinite_steps: int = DEFAULT_MAX_NONFINITE_STEPS,
                 longstraw_memory_budget=None, longstraw_prompt_tokens: int | None = None, **kwargs):
        quiet.install()  # again (a no-op unless filters were reset): what is not the user's to act on
        init_distributed()  # a no-op when the script (or accelerate, from `args`) initialized the group
        longstraw_config = ExecConfig() if longstraw_config is None else longstraw_config
        if not isinstance(longstraw_replica_check_every, int) or longstraw_replica_check_every < 0:
            raise ConfigError(f"longstraw_replica_check_every must be an int >= 0 (0: off), got "
                              f"{longstraw_replica_check_every!r}")
        if not isinstance(longstraw_config, ExecConfig):
            raise ConfigError(f"longstraw_config must be a longstraw.ExecConfig, got {type(longstraw_config).__name__}")
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = trl.GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        bad = unsupported_settings(args, eval_dataset=eval_dataset, processing_class=processing_class,
                                   rollout_func=kwargs.get("rollout_func"), longstraw_config=longstraw_config)
        mesh = Mesh(world=args.world_size, context=longstraw_context_parallel_size)  # ConfigError unless C divides W
        bad += check_mesh_settings(args, mesh) + trl_fsdp.check_fsdp_settings(longstraw_fsdp, mesh, optimizers)
        if bad:
            raise ConfigError("LongStrawGRPOTrainer cannot run these TRL settings:\n  - " + "\n  - ".join(bad))
        turn_off_activation_checkpointing(args)
        if mesh.context > 1:  # TRL sized it for W processes; the C ranks of a group share its rows
            args.generation_batch_size = args.per_device_train_batch_size * mesh.data * args.steps_per_generation

        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, **kwargs)

        if self.aux_loss_enabled:
            raise ConfigError("the MoE load-balancing loss is not supported by LongStrawGRPOTrainer; "
                              "set GRPOConfig(router_aux_loss_coef=0.0)")
        policy = self.accelerator.unwrap_model(self.model)
        groups = mesh_groups(mesh, timeout=collective_timeout())
        self._nonfinite = NonFiniteGuard(max_in_row=longstraw_max_nonfinite_steps)
        if longstraw_fsdp:  # before the Trainer makes the optimizer (in train())
            trl_fsdp.shard_decoder_layers(self.model, mesh, self.accelerator.device)
            trl_fsdp.without_ddp(self.accelerator)
        self.longstraw_mesh = groups
        self.longstraw_memory_budget = longstraw_memory_budget  # with one, DoesNotFitError before any rollout
        longstraw_config, self.longstraw_prompt_tokens = fitted_config(
            policy, longstraw_config, memory_budget=longstraw_memory_budget, prompt_tokens=longstraw_prompt_tokens,
            args=args, context_parallel=mesh.context > 1, process_group=groups.context_group,
            held_states=held_prompt_states(args, longstraw_keep_states, bool(self.tools)))
        if mesh.context > 1:
            longstraw_config = dataclasses.replace(longstraw_config, context_parallel=True)
        engine_kw = dict(process_group=groups.context_group)
        self.longstraw_engine = Engine(policy, longstraw_config, **engine_kw)
        self.longstraw_ref_engine = (None if self.ref_model is None
                                     else Engine(self.accelerator.unwrap_model(self.ref_model), longstraw_config,
                                                 **engine_kw))
        self._data = process_group_view(groups.data_group)  # gradients and totals across data-parallel groups
        self._world = process_group_view(torch.distributed.group.WORLD) if mesh.world > 1 else None  # failures
        self._data_view = (DataParallelView(self.accelerator, groups.dp, self._data, mesh.data)
                           if mesh.context > 1 else None)  # with C = 1, accelerate's processes are the groups
        was_training = policy.training
        policy.train()  # the Trainer trains in train mode: refuse dropout now, not at the first step
        try:
            self.longstraw_engine.adapter.check_runnable()
        except ModelStateError as exc:
            raise ConfigError(f"{exc} With the trainer, set GRPOConfig(disable_dropout=True).") from exc
        finally:
            policy.train(was_training)
        self.longstraw_keep_states = longstraw_keep_states
        if longstraw_replica_check_every:
            self.add_callback(_ReplicaCheck(policy, longstraw_replica_check_every))
        self.longstraw_grpo = GRPOConfig(loss_type=args.loss_type, epsilon_low=self.epsilon_low,
                                         epsilon_high=self.epsilon_high, beta=self.beta, scale_rewards="none",
                                         temperature=self.temperature, max_completion_length=self.max_completion_length)
        self._pending: list[_Pending] = []
        self._in_tool_loop = False
        self._window = defaultdict(float)  # LongStraw metrics of the current optimizer step
        self._screen = ScreenCallback(speaks=self.accelerator.is_main_process)  # trl_screen.py: skips, the loss note
        self.add_callback(self._screen)

    # ------------------------------------------------------------------------
    # many processes: TRL's data and generation code sees the data-parallel groups

    def _per_data_parallel_group(self):
        if self._data_view is None:
            return contextlib.nullcontext()
        return seen_per_data_parallel_group(self, self._data_view)

    def get_train_dataloader(self):
        """TRL's loader, dealt per data-parallel group (the C ranks of one get the same rows)."""
        with self._per_data_parallel_group():
            return super().get_train_dataloader()

    def _generate_and_score_completions(self, inputs):
        """TRL's, with its gathers (rewards, advantages, metrics) over the data-parallel groups."""
        with self._per_data_parallel_group():
            return super()._generate_and_score_completions(inputs)

    def _sampler(self, ids: torch.Tensor) -> torch.Generator:
        return sampling_generator(self.args.seed, self.state.global_step, ids)

    # ------------------------------------------------------------------------
    # rollouts and scoring (called from TRL's _generate_and_score_completions)

    def _tokenize_prompts(self, prompts: list):
        """TRL's, with each distinct plain-text prompt tokenised once (TRL repeats each G times;
        tokenising is O(P) per rank: 0.13 s of a 9.5 s step at P = 32,768, G = 4, W = 2;
        docs/distributed.md). Chat-template and multimodal prompts go to TRL unchanged."""
        distinct = list(dict.fromkeys(prompts)) if all(isinstance(p, str) for p in prompts) else prompts
        if len(distinct) == len(prompts):
            return super()._tokenize_prompts(prompts)
        ids, images, fields = super()._tokenize_prompts(distinct)
        of = dict(zip(distinct, ids))
        return [list(of[p]) for p in prompts], images, fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """One `engine.generate` per prompt group (TRL repeats each prompt G times in a row);
        inside TRL's tool loop, each post-tool continuation from its prompt's held state."""
        if has_tool_images:
            raise ConfigError("LongStrawGRPOTrainer: a tool returned an image; responses are text (docs/vision.md)")
        if self._in_tool_loop:  # as many calls as this rank's tool rounds: no agreement across ranks here
            return self._continue_after_tools(prompt_ids), None
        inputs = group_prompt_inputs(prompt_ids, images, multimodal_fields, num_generations)
        return agreed(lambda: self._rollouts(prompt_ids, num_generations, inputs), self._world, "generation"), None

    def _rollouts(self, prompt_ids, num_generations, prompt_inputs) -> list[list[int]]:
        """One `engine.generate` per prompt group (with its images); the completions, row by row."""
        completions, self._pending = [], []
        for start, inputs in zip(range(0, len(prompt_ids), num_generations), prompt_inputs):
            rows = [list(r) for r in prompt_ids[start:start + num_generations]]
            if len(rows) != num_generations or any(r != rows[0] for r in rows):
                raise RuntimeError("expected each prompt num_generations times in a row (TRL's RepeatSampler)")
            prompt = torch.tensor(rows[0], dtype=torch.long)
            check_prompt_tokens(len(prompt), self.longstraw_prompt_tokens, self.longstraw_memory_budget, inputs)
            rollout = self.longstraw_engine.generate(
                prompt, num_samples=num_generations, max_new_tokens=self.max_completion_length,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0, eos_token_id=self.eos_token_ids,
                generator=self._sampler(prompt), prompt_inputs=inputs)
            completions += [r.tolist() for r in rollout.responses]
            held = self.longstraw_keep_states or bool(self.tools)  # the tool loop continues from it
            self._pending.append(_Pending(prompt, rollout.state if held else None, inputs))
            m = rollout.metrics
            self._window["captures"] += 1
            self._window["time_capture_s"] += m["time_capture_s"]
            self._window["time_generate_s"] += m["time_generate_s"]
            self._window["state_bytes"] = max(self._window["state_bytes"], m["state_bytes"])
        return completions  # sampling log-probs are only used for vLLM's importance sampling

    def _tool_call_loop(self, *args, **kwargs):
        """TRL's own tool loop (parsing, tool calls, tool_mask); its regenerations come back
        to `_generate_single_turn`, which serves them from the held prompt states."""
        self._in_tool_loop = True
        try:
            return super()._tool_call_loop(*args, **kwargs)
        finally:
            self._in_tool_loop = False
            if not self.longstraw_keep_states:
                for pending in self._pending:
                    pending.state = None

    def _continue_after_tools(self, rows) -> list[list[int]]:
        """Each row is prompt + completion + tool result ids (TRL's `prompt_completion_tool_ids`).
        Its prompt is one captured by this generation batch: the rest is absorbed as a
        `prefix=` into a branch of that prompt's state, and one continuation sampled (no
        second capture). Returns only the new ids per row, as TRL expects."""
        out = []
        for row in rows:
            row = list(row)
            starts = (p for p in self._pending if len(p.prompt) < len(row) and row[:len(p.prompt)] == p.prompt.tolist())
            pending = max(starts, key=lambda p: len(p.prompt), default=None)  # the longest prompt it starts with
            if pending is None or pending.state is None:
                raise RuntimeError("a post-tool continuation does not start with a prompt of this generation batch "
                                   "(or its state was dropped)")
            prefix = torch.tensor(row[len(pending.prompt):], dtype=torch.long)
            rollout = self.longstraw_engine.generate(
                pending.prompt, num_samples=1, max_new_tokens=self.max_completion_length, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k or 0, eos_token_id=self.eos_token_ids, prefix=prefix,
                state=pending.state, generator=self._sampler(torch.tensor(row, dtype=torch.long)),
                prompt_inputs=pending.prompt_inputs)
            out.append(rollout.responses[0][prefix.numel():].tolist())
            self._window["tool_continuations"] += 1
            self._window["time_generate_s"] += rollout.metrics["time_generate_s"]
        return out

    def _fresh_state(self, state, prompt, inputs):
        """`state` if the policy engine can still reuse it for `prompt` (and its images), else None."""
        if state is not None:
            try:
                check_state(state, self.longstraw_engine, prompt, inputs=inputs)
            except StaleStateError:
                return None
        return state

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """Old or reference log-probs [B, logits_to_keep] of the generation batch, per group
        through `engine.score` with its images (no full-sequence forward). Under no_grad."""
        if torch.is_grad_enabled() or compute_entropy or compute_aux_loss:
            raise RuntimeError("LongStrawGRPOTrainer scores log-probs only under no_grad; the loss goes through "
                               "engine.step")
        is_ref = self.ref_model is not None and model is self.ref_model
        engine = self.longstraw_ref_engine if is_ref else self.longstraw_engine
        split = input_ids.shape[1] - logits_to_keep  # prompt columns (left-padded)
        num_generations = self.num_generations
        out = None
        for k, start in enumerate(range(0, input_ids.shape[0], num_generations)):
            rows = range(start, start + num_generations)
            prompt = input_ids[start, :split][attention_mask[start, :split].bool()]
            responses = [input_ids[i, split:][attention_mask[i, split:].bool()] for i in rows]
            state = None if is_ref else self._fresh_state(self._pending[k].state, prompt, self._pending[k].prompt_inputs)
            self._window["captures"] += state is None
            logps = engine.score(Group(prompt=prompt, responses=responses, rewards=None,
                                       prompt_inputs=self._pending[k].prompt_inputs), self.temperature, state=state)
            if out is None:
                out = torch.zeros(input_ids.shape[0], logits_to_keep, dtype=logps[0].dtype, device=input_ids.device)
            for i, lp in zip(rows, logps):
                out[i, : lp.numel()] = lp
        return out, None, None

    # ------------------------------------------------------------------------
    # the update

    def _prepare_inputs(self, generation_batch):
        """Generate and score a generation batch every steps_per_generation x
        num_iterations micro-steps (as TRL); return this micro-step's groups."""
        if not self.model.training:
            raise RuntimeError("LongStrawGRPOTrainer does not evaluate")
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = self._micro_batches(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _micro_batches(self, batch) -> list[_MicroBatch]:
        """TRL's padded generation batch -> whole groups dealt over the micro-steps."""
        num_generations = self.num_generations
        if batch["completion_ids"].shape[0] != len(self._pending) * num_generations:
            raise RuntimeError("generation batch and rollouts are out of step")
        for k, pending in enumerate(self._pending):
            rows = list(range(k * num_generations, (k + 1) * num_generations))
            responses = [batch["completion_ids"][i][batch["completion_mask"][i].bool()] for i in rows]

            def per_row(key):
                if batch.get(key) is None:
                    return None
                return [batch[key][i, : r.numel()] for i, r in zip(rows, responses)]

            tool_mask = per_row("tool_mask")  # TRL's: 0 at tool-result tokens (the update uses completion x tool)
            pending.group = Group(prompt=pending.prompt, responses=responses, prompt_inputs=pending.prompt_inputs,
                                  loss_masks=None if tool_mask is None else [m.bool() for m in tool_mask],
                                  rewards=batch["advantages"][rows].detach().to("cpu", torch.float64),
                                  old_logprobs=per_row("old_per_token_logps"), ref_logprobs=per_row("ref_per_token_logps"))
        items, self._pending = self._pending, []
        totals = global_totals((item.group for item in items), self._data)  # over the whole global batch
        steps = self.args.steps_per_generation
        return [_MicroBatch(items[m::steps], totals) for m in range(steps)]

    def _step_groups(self, micro: _MicroBatch) -> tuple[float, dict]:
        """engine.step for each group of a micro-step, no collective but the engine's own;
        returns their summed loss and token-weighted sums (tokens, clipped, kl)."""
        loss = tokens = clipped = kl = 0.0
        for item in micro.items:
            state = self._fresh_state(item.state, item.group.prompt, item.prompt_inputs)
            item.state = None  # after this optimizer step it is stale; free it now
            result = self.longstraw_engine.step(item.group, self.longstraw_grpo, totals=micro.totals, state=state)
            m = result.metrics
            loss += result.loss
            skipped = m["skipped_zero_advantage"] > 0 or m["skipped_no_loss_tokens"] > 0
            for key, value in (("groups", 1.0), ("skipped_zero_advantage", m["skipped_zero_advantage"]),
                               ("skipped_no_loss_tokens", m["skipped_no_loss_tokens"])):  # what the screen counts
                self._window[key] += value
            if state is None and not skipped:  # the rollout's state was dropped or stale: captured again
                self._window["captures"] += 1
                self._window["time_capture_s"] += m["time_capture_s"]
            self._window["time_replay_s"] += m["time_replay_s"]
            self._window["time_reverse_s"] += m["time_reverse_s"]
            self._window["state_grad_bytes"] = max(self._window["state_grad_bytes"], m["state_grad_bytes"])
            if not skipped:
                tokens += m["response_tokens"]
                clipped += m["clip_fraction"] * m["response_tokens"]
                kl += m.get("kl_mean", 0.0) * m["response_tokens"]
        return loss, dict(tokens=tokens, clipped=clipped, kl=kl)

    def _log_micro_step(self, sums: dict) -> None:
        """Clip ratio and KL of a micro-step, token-weighted over every data-parallel group."""
        if self._data is not None:
            sums = reduce_metrics(sums, tuple(sums), self._data)
        if sums["tokens"]:
            self._metrics["train"]["clip_ratio/region_mean"].append(sums["clipped"] / sums["tokens"])
            if self.beta != 0.0:
                self._metrics["train"]["kl"].append(sums["kl"] / sums["tokens"])

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-step: `engine.step` per group accumulates `.grad` (no Trainer backward).
        Returns the micro-step's share of the batch loss (TRL's convention)."""
        start = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        micro = self._prepare_inputs(inputs)
        loss, sums = agreed(lambda: self._step_groups(micro), self._world, "the update")  # all fail together
        self._log_micro_step(sums)
        self._step += 1
        if self._step % self.current_gradient_accumulation_steps == 0:
            # the last micro-step: every data-parallel group's gradient added up (their divisors are the global batch's)
            reduce_gradients(self.longstraw_engine.model.parameters(), self._data)
            self._window["nonfinite_grad"] = float(self._nonfinite.skip_if_nonfinite(
                self.longstraw_engine.model.parameters(), self.state.global_step, rank=self.longstraw_mesh.rank,
                device=self.accelerator.device))
            self._window["skipped_nonfinite_steps"] = float(self._nonfinite.total)  # every rank skipped alike
            self._current_train_step_time += time.perf_counter() - start
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
            self._flush_window()
        else:
            self._current_train_step_time += time.perf_counter() - start
        # the Trainer logs the mean over W processes: each group's share x D makes that the global batch's loss
        return torch.tensor(loss * self.longstraw_mesh.mesh.data, device=self.args.device)

    def _flush_window(self) -> None:
        """Log this optimizer step's LongStraw metrics (TRL averages them per logging step)."""
        if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.accelerator.device)
        else:
            peak = peak_rss_bytes()
        self._window["peak_memory_bytes"] = float(peak)
        if self._data is not None:  # captures added up over the groups, times and bytes their max
            for key in WINDOW_KEYS:
                self._window.setdefault(key, 0.0)
            self._window = defaultdict(float, reduce_metrics(self._window, SUMMED_KEYS, self._data))
        self._screen.step(self._window)  # most steps without an update: one warning
        for key, value in self._window.items():
            self._metrics["train"][f"longstraw/{key}"].append(float(value))
        self._window.clear()
