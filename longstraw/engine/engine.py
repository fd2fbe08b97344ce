"""The LongStraw engine: capture -> (score) -> replay, one branch at a time.

1. Capture runs prompt[:-1] in chunks of `chunk_size` under no_grad. The adapter
   keeps only the per-layer state later tokens need (K/V for attention layers).
   Under context parallelism it runs divided instead where it can: each prompt token
   on one rank, layer by layer (`parallel.divided.py`).
2. Replay runs each branch `[prompt[-1]] + response[:-1]` at positions P-1 .. with
   autograd against the read-only state, computes that branch's share of the group
   loss, calls backward, and frees the graph before the next branch. Peak memory is
   parameters + grads + state + the larger of one capture chunk's working set and one
   branch's (or piece's) graph: independent of G. (At the default chunk_size=4096 on
   small models the capture chunk sets it; bench/ and docs/results-dense.md measure it.)
3. Exact mode (`ExecConfig(mode="exact")`): replay also sums dLoss/dState over the
   branches into buffers the state owns. Then the capture chunks are walked in
   reverse: each is recomputed with autograd from the state of earlier chunks, and
   its accumulated state gradient is pushed through it. That adds its parameter
   gradients and the gradients of earlier chunks' state. The result is the
   full-sequence gradient; memory is state + state gradients + one chunk's autograd
   graph, so pick chunk_size well below P in this mode (see docs/exact.md). With
   `keep_graph_bytes`, the last capture chunks that fit keep their autograd graph
   and are backpropagated without recomputation (`kept_graphs.py`). Under context
   parallelism the walk runs divided where it can: each prompt token recomputed and
   backpropagated on one rank, the ranks' parameter gradients summed once
   (`parallel.divided.py`).
4. `step` only accumulates `.grad`, exactly as `loss.backward()` would; the caller
   steps the optimizer.
5. `generate` samples the G responses from one capture (`rollout.py`); `step` and
   `score` reuse that state (`state=`), refusing a stale or mismatched one.
6. State offload (`ExecConfig(state_device="cpu")`): capture allocates the prompt
   state's per-token rows in host memory and `offload.Stager` stages them to the device
   one layer at a time in every phase above (`docs/offload.md`); nothing else changes.

The engine knows no architecture: everything model-specific is in `models/`. `Engine`
is the facade; each concern has its module: `validate.py` (checks before any work),
`capture.py`, `replay.py` (branches), `walk.py` (the reverse walk), `grpo.py` (the
loss), `metrics.py` (the step's metrics), `clock.py` (phase times, progress bars).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from longstraw.config import ExecConfig, GRPOConfig
from longstraw.defaults import keeps_attention_outputs
from longstraw.engine import grpo as G
from longstraw.engine.capture import capture, divides_capture, divides_walk, rank_shard
from longstraw.engine.clock import clock, progress
from longstraw.engine.episode import EpisodeConfig
from longstraw.host import on_host, to_host
from longstraw.engine.logprobs import token_logprobs
from longstraw.engine.metrics import StepMetrics
from longstraw.engine.replay import branch_logprobs, replay_branch, replay_group
from longstraw.engine.rollout import Rollout, SamplingConfig, generate
from longstraw.engine.tree import replay_tree, score_tree
from longstraw.engine.validate import (agree_across_ranks, check_positions, check_runnable, sequence_length,
                                       validate)
from longstraw.engine.walk import walk_back
from longstraw.errors import ConfigError
from longstraw.group import BatchTotals, Group, StepResult
from longstraw.models import adapter_for
from longstraw.models.placement import check_placement
from longstraw.models.recompute import recompute_pays
from longstraw.ops.flash import fused_backward_kernel
from longstraw.shapes import graph_bytes_per_token, kept_output_bytes_per_position, model_held_bytes
from longstraw.parallel.collectives import Traffic
from longstraw.models.experts import shard_experts
from longstraw.parallel.context import ContextParallel
from longstraw.parallel.fsdp import settle_held_reductions, summed_walk_gradients
from longstraw.parallel.gradients import replicate_gradients, replicated_parameters
from longstraw.state.prompt import PromptState, RecurrentState, Shard


def _no_phase(name: str):
    """The default `Engine.phase_hook`: nothing around a phase."""
    return contextlib.nullcontext()


class Engine:
    """Runs GRPO updates for one long shared prompt at a time.

    Args:
        model: a stock Hugging Face `...ForCausalLM` of a supported family, or a
            PEFT-wrapped one, in any dtype, on any device.
        config: how to execute (`ExecConfig`); defaults to `ExecConfig()`.
    """

    def __init__(self, model: nn.Module, config: ExecConfig | None = None, *, process_group=None):
        config = ExecConfig() if config is None else config
        if not isinstance(config, ExecConfig):
            raise ConfigError(f"config must be a longstraw.ExecConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.adapter = adapter_for(model)
        self._graph_per_token: float | None = None  # recomputes_layers' estimate, made once
        # name -> context manager around each phase of step (a rehearsal's tracker): capture,
        # replay, walk, and "gradients" (the W > 1 broadcast)
        self.phase_hook = _no_phase
        check_placement(model)  # one device, no accelerate hooks (models/placement.py)
        want, have = (torch.device(config.state_device) if config.state_device else None), self.adapter.device
        if want is not None and not config.offloads_state() \
                and (want.type != have.type or (want.index is not None and want.index != have.index)):
            raise ConfigError(
                f"ExecConfig.state_device={config.state_device!r} but the model is on {self.adapter.device}; pass "
                "None (the state on the model's device) or \"cpu\" (state offload to host memory)"
            )
        if config.expert_parallel and not config.context_parallel:
            raise ConfigError("ExecConfig(expert_parallel=True) splits the experts over the context-parallel ranks; "
                              "set context_parallel=True as well (one process holds every expert)")
        if (config.replay_batch or 1) > 1 and not self.adapter.batches_replay:
            raise ConfigError(f"ExecConfig(replay_batch={config.replay_batch}): {type(self.adapter).__name__} "
                              f"(model_type {self.adapter.config.model_type!r}) replays one branch at a time (its "
                              "mixers take no batch); use replay_batch=1")
        if (config.replay_batch or 1) > 1 and config.context_parallel:
            raise ConfigError(f"ExecConfig(replay_batch={config.replay_batch}) is not supported with "
                              "context_parallel=True yet (the sharded state's merges run one branch); use "
                              "replay_batch=1")
        self.cp = ContextParallel.from_default_group(process_group) if config.context_parallel else None
        if config.expert_parallel:
            shard_experts(model, self.cp)  # in place: this rank's experts only (models/experts.py)

    # ------------------------------------------------------------------------
    # checks before any work (`validate.py`)

    def _validate(self, group: Group, *, needs_ref: bool = False, needs_rewards: bool = True, totals=None,
                  state: PromptState | None = None):
        return validate(self, group, needs_ref=needs_ref, needs_rewards=needs_rewards, totals=totals, state=state)

    def check_positions(self, prompt_tokens: int, new_tokens: int, what: str) -> int:
        """Refuse prompt + `new_tokens` beyond the model's max_position_embeddings (unless
        `allow_position_overflow`); return the total."""
        return check_positions(self, prompt_tokens, new_tokens, what)

    def check_runnable(self) -> None:
        """Refuse model states and contexts we cannot run exactly (before any work)."""
        check_runnable(self)

    def agree_across_ranks(self, local, fingerprint):
        """Run `local()` and return its result; under context parallelism every rank
        raises together when any failed or holds a different `fingerprint(result, failed)`
        (`validate.agree_across_ranks`)."""
        return agree_across_ranks(self, local, fingerprint)

    # ------------------------------------------------------------------------
    # the phases (`capture.py`, `replay.py`, `walk.py`)

    def progress_bar(self, desc: str):
        """A function wrapping an iterable in this engine's progress display (or not)."""
        return lambda iterable: progress(iterable, enabled=self.config.progress, desc=desc, total=len(iterable))

    def capture(self, prompt: torch.Tensor, *, exact: bool = False, keep_graph_bytes: int = 0,
                rope_length: int | None = None, prompt_inputs: dict | None = None,
                keep_attention_outputs: bool = False) -> PromptState:
        """Run prompt[:-1] ([P-1] tokens) in chunks under no_grad; return its state,
        stamped with its origin (`rollout.StateOrigin`). With `exact`, it keeps what the
        reverse walk needs (every chunk boundary, every sliding-window position); `step`
        allocates its gradient buffers, unless `keep_graph_bytes` > 0: then they are
        allocated first and the last chunks' graphs that fit are kept (`kept_graphs.py`).
        `rope_length` (default P): the whole sequence's length (prompt + longest
        response), whose RoPE frequencies every call against the state uses
        (`models/rope.py`). `prompt_inputs`: the prompt's images (`Group.prompt_inputs`),
        run through the model's vision tower once, whole, without grad; the state keeps
        their embeddings and the prompt's M-RoPE positions and remembers the inputs.
        `keep_attention_outputs` (with `exact`): it also keeps the attention layers'
        outputs and LSEs for the reverse walk (`state/kept_outputs.py`)."""
        return capture(self, prompt, exact=exact, keep_graph_bytes=keep_graph_bytes, rope_length=rope_length,
                       prompt_inputs=prompt_inputs, keep_attention_outputs=keep_attention_outputs)

    def divides_walk(self, state: PromptState) -> bool:
        """Whether exact mode's reverse walk over `state` runs divided under context
        parallelism (each prompt token recomputed and backpropagated on the rank that owns
        it, `parallel.divided.py`): the family supports it (every family LongStraw runs), the state
        is not offloaded, no capture graphs were kept (they are replicated), FSDP2-sharded
        layers (if any) shard over a group holding every context-parallel rank, on a 1-D mesh or a
        2-D one whose replica all-reduce is held (`hold_replica_reductions`) (their
        reduce-scatter is then set to sum the partial gradients: `fsdp_sum_factor`), and
        every rank owns a block."""
        return divides_walk(self, state)

    def divides_capture(self, positions: int, keep_graph_bytes: int = 0) -> bool:
        """Whether a capture of `positions` tokens runs divided under context parallelism
        (each prompt token on one rank, `parallel.divided.py`): the family supports it,
        no chunk graphs are kept, and every rank owns at least one block (a shorter prompt
        is captured replicated). An offloaded state is captured divided too: each rank
        writes its own rows straight to host."""
        return divides_capture(self, positions, keep_graph_bytes)

    def walk_back(self, ids: torch.Tensor, start: int, states: list[PromptState], size: int, *,
                  piece_loss=None, desc: str | None = "reverse", shard: Shard | None = None,
                  recompute_layers: bool = False) -> None:
        """Recompute the chunks of ids [T] (positions start..) last to first, with
        autograd, and backpropagate through each before the next.

        states[-1] holds the state these chunks wrote at capture, with gradient
        buffers. Each chunk's own state tensors are seeded with their accumulated
        gradients, complete by then (everything later has been walked); backward
        adds parameter gradients and the gradients of the state before the chunk.
        `piece_loss(hidden [n, d], a, b)`, if given, is the loss of tokens [a, b)
        and joins the same backward. One chunk's graph is alive at a time.

        `shard` (context parallelism; the prompt's walk, start 0): divided. The chunks
        are whole cycles of the deal, or whole capture chunks for a family that restarts
        from their snapshots (`parallel.divided.walk_chunks`), and this rank
        recomputes and backpropagates only its own positions of each; its parameter
        gradients are partial (the caller sums them over ranks: `summed_walk_gradients`).
        `recompute_layers`: each chunk keeps only its decoder layers' inputs, and each
        layer is recomputed in backward (`models/recompute.py`; replay's pieces).
        """
        walk_back(self, ids, start, states, size, piece_loss=piece_loss, desc=desc, shard=shard,
                  recompute_layers=recompute_layers)

    def recomputes_layers(self, piece_tokens: int, state: PromptState | None = None) -> bool:
        """Whether replay pieces of `piece_tokens` tokens recompute each decoder layer in
        backward (`ExecConfig.recompute_layers`; None: `defaults.recompute_pays`, when the
        piece's estimated graph exceeds `RECOMPUTE_GRAPH_SHARE` x `held_bytes(state)`)."""
        layers = len(self.adapter.backbone.layers)
        setting = self.config.recompute_layers
        if setting is not None or layers < 2:
            return recompute_pays(setting, 0.0, 0.0, layers)
        return recompute_pays(None, self.branch_graph_bytes(piece_tokens), self.held_bytes(state), layers)

    def branch_graph_bytes(self, tokens: int) -> float:
        """The planner's estimate of one replay piece's autograd graph of `tokens` tokens for
        this model's shapes (`shapes.py`): the yardstick of the recompute and batch rules."""
        if self._graph_per_token is None:
            self._graph_per_token = graph_bytes_per_token(self.model, len(self.adapter.backbone.layers))
        return tokens * self._graph_per_token

    def keeps_attention_outputs(self, prompt_tokens: int, exact: bool) -> bool:
        """Whether a step's capture of a `prompt_tokens` prompt keeps the attention outputs
        for the reverse walk (`ExecConfig.keep_attention_outputs`; None:
        `defaults.keeps_attention_outputs` with this model's per-position bytes and whether
        torch's fused flash backward runs on its device and dtype)."""
        setting = self.config.keep_attention_outputs
        if setting is not None or not exact:
            return keeps_attention_outputs(setting, exact=exact, offload_state=False, parallel=False,
                                           fused_backward=False, output_bytes=0.0, state_bytes=0.0)
        output_bytes, state_bytes = kept_output_bytes_per_position(self.model, prompt_tokens)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        return keeps_attention_outputs(None, exact=True, offload_state=self.config.offloads_state(),
                                       parallel=self.cp is not None,
                                       fused_backward=fused_backward_kernel(self.adapter.device.type, dtype) is not None,
                                       output_bytes=output_bytes, state_bytes=state_bytes)

    def held_bytes(self, state: PromptState | None = None) -> int:
        """What a step holds on this rank anyway, the default recompute rule's yardstick:
        the weights, the gradients of what is trained, and `state` (its rows, snapshots
        and exact mode's gradient buffers)."""
        return model_held_bytes(self.model) + (0 if state is None else state.nbytes() + state.grad_nbytes())

    def walk_recomputes_layers(self, positions: int, state: PromptState | None = None) -> bool:
        """Whether exact mode's reverse walk over a prompt state of `positions` captured
        tokens recomputes each decoder layer in backward: the replay rule
        (`recomputes_layers`) for its chunks of min(chunk_size, positions) tokens. A chunk
        then keeps only each layer's input [chunk, d], and the live graph holds one layer.
        Under FSDP2 too: a recompute gathers its layer first (`models/recompute.py`)."""
        return self.recomputes_layers(min(self.config.chunk_size, positions), state)

    def replay_branch(self, state: PromptState, prompt: torch.Tensor, response: torch.Tensor, piece_loss) -> None:
        """Backpropagate one branch's loss against the read-only prompt state.

        The branch `[prompt[-1]] + response[:-1]` runs at positions P-1.. in pieces
        of `branch_chunk_size` (default: one piece): earlier pieces are captured
        under no_grad into a branch state, then walked back last to first, so the
        branch's peak is set by one piece, not by R. Each piece recomputes its decoder
        layers in backward where `recomputes_layers` says so.
        """
        replay_branch(self, state, prompt, response, piece_loss)

    def branch_logprobs(self, state: PromptState, prompt: torch.Tensor, response: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [R] of one response against `state`, in one piece
        (used by `score`, without grad; the state is only read)."""
        return branch_logprobs(self, state, prompt, response, temperature)

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Chunked lm_head + log-softmax: hidden [n, d], targets [n] -> [n]."""
        return token_logprobs(self.adapter.lm_head, hidden, targets, temperature=temperature,
                              chunk_size=self.config.logits_chunk_size)

    # ------------------------------------------------------------------------
    # public API

    def generate(self, prompt: torch.Tensor, num_samples: int = 8, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, eos_token_id: int | list | None = None,
                 generator: torch.Generator | None = None, *, environment=None, max_turns: int = 1,
                 prefix: torch.Tensor | None = None, prefix_loss_mask: torch.Tensor | None = None,
                 state: PromptState | None = None, prompt_inputs: dict | None = None) -> Rollout:
        """Sample `num_samples` responses from one capture of `prompt`.

        The G branches decode together, one token per step, against the one shared prompt
        state (never copied or expanded per branch); each keeps only its own tokens' state.

        Args:
            prompt: LongTensor [P], P >= 2.
            num_samples: G. max_new_tokens: tokens per branch at most.
            temperature: 0 is greedy; top_p in (0, 1]; top_k >= 0 (0: off).
            eos_token_id: id (or ids) that end a branch; the branch keeps it as its last token.
            generator: a torch.Generator for reproducible samples (on the model's device, or
                on the CPU). Under context parallelism every rank must seed it identically.
            environment: agent episodes: env(branch, response) -> LongTensor of observation
                ids, or None (the branch ends), called when branch `branch` emits eos and has
                made fewer than `max_turns` calls (needs eos_token_id). The observation is
                appended (loss mask False, log-prob 0.0) and absorbed as one chunk into that
                branch's own state; `max_new_tokens` bounds sampled + observation tokens, and
                an observation that would pass it is not appended: the branch ends.
            max_turns: environment calls per branch at most (>= 0).
            prefix: LongTensor [L] (L <= max_new_tokens): every response starts with it,
                absorbed as one chunk; its log-probs are those of the current weights.
            prefix_loss_mask: bool [L], the prefix tokens' loss mask (default all True).
            state: a prompt state from an earlier `generate` of this prompt (checked like
                `step(state=)`): no second capture.
            prompt_inputs: the prompt's images, as `Group.prompt_inputs` (pass the same dict
                to the group that steps this rollout). Responses and observations are text.

        Returns:
            `Rollout` with `.responses` (G LongTensors [R_i]), `.logprobs` (the sampled tokens'
            log-probs under the temperature-scaled distribution, before top-k / top-p: what
            `score(group, temperature)` gives; temperature 1 for greedy), `.state` (reuse it in
            `step(..., state=)` and `score(..., state=)` while the weights are unchanged) and
            `.metrics`, `.loss_masks` (G bool [R_i]: True at sampled tokens) and `.turns`
            (G ints: environment calls).
        """
        config = SamplingConfig(num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, eos_token_id=eos_token_id)
        episode = EpisodeConfig(environment=environment, max_turns=max_turns, prefix=prefix,
                                prefix_loss_mask=prefix_loss_mask)
        return generate(self, prompt, config, generator, episode, state, prompt_inputs)

    def _reuse_or_capture(self, group: Group, state: PromptState | None, exact: bool) -> PromptState:
        """The prompt state for `group`: the one given (already checked) or a new capture."""
        if state is None:
            state = self.capture(group.prompt, exact=exact, keep_graph_bytes=self.config.keep_graph_bytes,
                                 rope_length=sequence_length(group), prompt_inputs=group.prompt_inputs,
                                 keep_attention_outputs=self.keeps_attention_outputs(group.prompt.shape[0], exact))
            if exact and self.config.keep_graph_bytes > 0:
                return state  # its gradient buffers were allocated before capture: kept graphs add into them
        if exact:
            state.enable_grad_buffers()  # zeroed for this step, also when a state is stepped again
        return state

    def score(self, group: Group, temperature: float = 1.0, *, state: PromptState | None = None) -> list[torch.Tensor]:
        """Per-token log-probs under the current model, no grad.

        Args:
            group: the prompt and responses (rewards are not needed).
            temperature: logits are divided by it.
            state: a prompt state from `generate` for this prompt (skips capture).

        Returns:
            list of G tensors [R_i] (detached, on the model's device).
        """
        GRPOConfig(temperature=temperature)  # validates the temperature
        self._validate(group, needs_rewards=False, state=state)
        if state is None:
            state = self.capture(group.prompt, rope_length=sequence_length(group), prompt_inputs=group.prompt_inputs)
        if self.config.share_response_prefixes:  # each shared segment once (`tree.py`)
            return score_tree(self, state, group, temperature)
        with torch.no_grad():
            return [self.branch_logprobs(state, group.prompt, r, temperature).detach() for r in group.responses]

    def step(self, group: Group, grpo: GRPOConfig | None = None, *, totals: BatchTotals | None = None,
             state: PromptState | None = None) -> StepResult:
        """One GRPO group: accumulate this group's share of the loss gradient into `.grad`.

        Args:
            group: the prompt, its G responses and rewards (or advantages as given), and
                optionally loss masks (False: context only, no loss term). A group whose
                every mask is all False is skipped (loss 0, `.grad` untouched).
            grpo: the objective; defaults to `GRPOConfig()`.
            totals: batch-wide divisors when a batch of several groups is stepped one
                group at a time; defaults to this group alone.
            state: the prompt state from `generate` (`rollout.state`) for this prompt: no
                second capture. It may be stepped again while the weights are unchanged;
                a stale one raises `StaleStateError` before any work.

        Returns:
            StepResult with the loss (this group's share) and metrics.
        """
        grpo = GRPOConfig() if grpo is None else grpo
        if not isinstance(grpo, GRPOConfig):
            raise ConfigError(f"grpo must be a longstraw.GRPOConfig, got {type(grpo).__name__}")
        with on_host():  # the real inputs checked for real, also in a rehearsal (`longstraw/host.py`)
            rewards = self._validate(group, needs_ref=grpo.beta > 0, totals=totals, state=state)
            totals = BatchTotals.of([group]) if totals is None else totals
            t0, c0 = clock(self.adapter.device), Traffic.received
            adv, skip = G.step_advantages(group, rewards, grpo)
            metrics = self._host_metrics(group, state, rewards, adv)
        if skip or group.loss_tokens == 0:  # zero advantage and no KL term, or no loss token: loss, gradient 0
            metrics.skipped_zero_advantage, metrics.skipped_no_loss_tokens = float(skip), float(not skip)
            metrics.divided_capture = 0.0
            return StepResult(loss=0.0, metrics=metrics.as_dict())
        return self._update(group, grpo, totals, state, adv, metrics, (t0, c0))

    def _host_metrics(self, group: Group, state: PromptState | None, rewards, adv: torch.Tensor) -> StepMetrics:
        """The step's metrics known before any work, from the real (host) inputs."""
        return StepMetrics(
            context_parallel_world=float(self.cp.world if self.cp is not None else 1),
            divided_capture=float(state is None and self.divides_capture(
                group.prompt.numel() - 1, self.config.keep_graph_bytes if self.config.mode == "exact" else 0)),
            prompt_tokens=float(group.prompt.numel()),
            response_tokens=float(group.loss_tokens),
            num_branches=float(group.size),
            reward_mean=None if rewards is None else float(rewards.mean()),
            reward_std=None if rewards is None else (float(rewards.std()) if group.size > 1 else 0.0),
            advantage_mean=float(adv.mean()),
            advantage_std=float(adv.std()) if group.size > 1 else 0.0,
            advantage_min=float(adv.min()),
            advantage_max=float(adv.max()),
        )

    def _update(self, group: Group, grpo: GRPOConfig, totals: BatchTotals, state: PromptState | None,
                adv: torch.Tensor, metrics: StepMetrics, t0c0: tuple) -> StepResult:
        """The step's work once it is not skipped: capture (unless `state`), replay every
        branch, exact mode's reverse walk, the ranks' gradients made one; fills `metrics`."""
        exact = self.config.mode == "exact"
        marks = [t0c0]  # (time, bytes received) after each phase

        def mark():
            marks.append((clock(self.adapter.device), Traffic.received))

        with self.phase_hook("capture"):
            state = self._reuse_or_capture(group, state, exact)
        metrics.kept_graph_chunks = float(len(state.kept))  # the walk pops them as it reaches them
        longest = max(int(r.numel()) for r in group.responses)  # replay's longest piece decides the metric
        metrics.recompute_layers = float(self.recomputes_layers(min(self.config.branch_chunk_size or longest, longest),
                                                                state))
        try:
            mark()
            replay = replay_tree if self.config.share_response_prefixes else replay_group  # trie / flat
            with self.phase_hook("replay"):
                stats = replay(self, state, group, grpo, totals, adv)
            mark()
            divided = exact and self.divides_walk(state)
            walk_rc = exact and self.walk_recomputes_layers(group.prompt.numel() - 1, state)
            if divided:
                state.outputs = None  # a divided walk attends for its own rows: it recomputes attention
            metrics.kept_attention_bytes = float(state.outputs.nbytes()) if state.outputs is not None else 0.0
            with self.phase_hook("walk"):  # exact mode's reverse walk (nothing in detached mode)
                if divided:  # each prompt token on one rank; the ranks' partial gradients summed once
                    with summed_walk_gradients(self.model, self.cp, self.adapter.sharded_modules()):
                        self.walk_back(group.prompt[:-1].to(self.adapter.device), 0, [state], self.config.chunk_size,
                                       shard=rank_shard(self), recompute_layers=walk_rc)
                        # the image rows' partial gradients summed, each rank's images through the tower
                        self.adapter.backprop_inputs(state.inputs, group.prompt_inputs, self.cp)
                elif exact:
                    self.walk_back(group.prompt[:-1].to(self.adapter.device), 0, [state], self.config.chunk_size,
                                   recompute_layers=walk_rc)
                    self.adapter.backprop_inputs(state.inputs, group.prompt_inputs)  # every image, one at a time
            settle_held_reductions(self.adapter.sharded_modules())  # a 2-D FSDP2 mesh: held shards into .grad
            mark()
            if self.cp is not None and self.cp.world > 1 and not divided:
                # replay's (and a replicated walk's) gradients, which backward may sum in a different
                # order on each rank: the first rank's on every rank (a divided walk's sum does this)
                with self.phase_hook("gradients"):
                    replicate_gradients(replicated_parameters(self.model), self.cp)
            mark()
            metrics.state_grad_bytes = float(state.grad_nbytes())  # what the step held (released on return)
        finally:  # the walk spent dLoss/dState (or the step failed): a held state keeps only its rows
            state.release_grad_buffers()
            state.outputs = None
        (t0, c0), (t1, c1), (t2, c2), (t3, c3), (t4, c4) = marks
        if state.offload is not None:  # since the capture, or since the reused state's last step
            moved = state.offload.stats
            metrics.offload_h2d_bytes, metrics.offload_d2h_bytes = float(moved.h2d_bytes), float(moved.d2h_bytes)
            metrics.offload_slot_bytes = float(moved.slot_bytes)
            moved.reset()
        recurrent = [layer for layer in state.layers if isinstance(layer, RecurrentState) and layer.host]
        if recurrent:  # exact mode's snapshot offload, since the capture or the last step
            metrics.snapshot_h2d_bytes = float(sum(layer.h2d_bytes for layer in recurrent))
            metrics.snapshot_d2h_bytes = float(sum(layer.d2h_bytes for layer in recurrent))
            for layer in recurrent:
                layer.reset_moved()
        metrics.divided_walk, metrics.state_bytes = float(divided), float(state.nbytes())
        metrics.walk_recompute_layers = float(walk_rc)
        metrics.replay_tokens, metrics.shared_segments = float(stats.forwarded), float(stats.shared)
        metrics.replay_batch = float(stats.batch)
        metrics.time_capture_s, metrics.time_replay_s, metrics.time_reverse_s = t1 - t0, t2 - t1, t3 - t2
        metrics.time_total_s = t4 - t0
        metrics.comm_bytes_capture, metrics.comm_bytes_replay = float(c1 - c0), float(c2 - c1)
        metrics.comm_bytes_reverse, metrics.comm_bytes_gradients = float(c3 - c2), float(c4 - c3)
        for key, value in stats.summary(with_kl=grpo.beta > 0).items():  # ratio_mean, clip_fraction, kl_mean
            setattr(metrics, key, value)
        return StepResult(loss=to_host(stats.loss), metrics=metrics.as_dict())
