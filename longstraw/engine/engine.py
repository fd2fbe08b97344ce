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

The engine knows no architecture: everything model-specific is in `models/`.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from longstraw.engine import grpo as G
from longstraw.config import ExecConfig, GRPOConfig
from longstraw.parallel.context import ContextParallel, check_same_group
from longstraw.errors import ConfigError, InvalidGroupError, LongStrawError, PositionLimitError
from longstraw.group import BatchTotals, Group, StepResult, validate_group
from longstraw.engine.kept_graphs import SavedBytes, chunks_to_keep
from longstraw.engine.logprobs import token_logprobs
from longstraw.models import adapter_for
from longstraw.models.placement import check_placement
from longstraw.state.offload import Stager, settle
from longstraw.parallel.collectives import Traffic
from longstraw.engine.rollout import Rollout, SamplingConfig, check_state, generate, stamp_state
from longstraw.parallel.divided import divided_capture, divided_chunks
from longstraw.parallel.fsdp import fsdp_sum_factor, summed_walk_gradients
from longstraw.parallel.gradients import replicate_gradients, replicated_parameters
from longstraw.state.prompt import PromptState, Shard


def _progress(iterable, *, enabled: bool, desc: str | None, total: int):
    """One progress bar per phase (capture, generate, replay, reverse); desc None: none
    (a branch's pieces run inside the replay bar, so they get no bar of their own)."""
    if not enabled or desc is None:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


def _clock(device: torch.device) -> float:
    """A phase timestamp: on CUDA, after the queued kernels finish (else the time of
    launching them, not of running them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _sequence_length(group: Group) -> int:
    """P + the longest response: the length of HF's one-pass forward over the group."""
    return int(group.prompt.numel()) + max(int(r.numel()) for r in group.responses)


def _fingerprint(group: Group | None, rewards) -> torch.Tensor:
    """A fixed-length float64 summary [8] of a group, to check that every rank got the
    same one (zeros for a group that failed validation)."""
    if group is None:
        return torch.zeros(8, dtype=torch.float64)
    lengths = torch.tensor([float(r.numel()) for r in group.responses], dtype=torch.float64)
    sums = torch.tensor([float(r.double().sum()) for r in group.responses], dtype=torch.float64)
    weights = torch.arange(1, group.size + 1, dtype=torch.float64)  # order matters
    r = torch.zeros(group.size, dtype=torch.float64) if rewards is None else rewards.double().cpu()
    return torch.tensor([float(group.prompt.numel()), float(group.prompt.double().sum()), float(group.size),
                         float((lengths * weights).sum()), float((sums * weights).sum()), float(r.sum()),
                         float((r * weights).sum()), float(rewards is not None)], dtype=torch.float64)


class _BranchStats:
    """Running sums of the per-token statistics over all branches and pieces, kept as
    device tensors (no host sync per piece); read once at the end."""

    def __init__(self):
        self.loss, self.tokens, self.ratio, self.clipped, self.kl = 0.0, 0, 0.0, 0.0, 0.0

    def add(self, loss: torch.Tensor, tok_stats: dict) -> None:
        self.loss = self.loss + loss.detach()
        self.tokens += tok_stats["ratio"].numel()
        self.ratio = self.ratio + tok_stats["ratio"].detach().sum()
        self.clipped = self.clipped + tok_stats["clipped"].detach().sum()
        self.kl = self.kl + (tok_stats["kl"].detach().sum() if "kl" in tok_stats else 0.0)

    def summary(self, with_kl: bool) -> dict:
        out = {"ratio_mean": float(self.ratio) / self.tokens, "clip_fraction": float(self.clipped) / self.tokens}
        if with_kl:
            out["kl_mean"] = float(self.kl) / self.tokens
        return out


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
        check_placement(model)  # one device, no accelerate hooks (models/placement.py)
        want, have = (torch.device(config.state_device) if config.state_device else None), self.adapter.device
        if want is not None and not config.offloads_state() \
                and (want.type != have.type or (want.index is not None and want.index != have.index)):
            raise ConfigError(
                f"ExecConfig.state_device={config.state_device!r} but the model is on {self.adapter.device}; pass "
                "None (the state on the model's device) or \"cpu\" (state offload to host memory)"
            )
        self.cp = ContextParallel.from_default_group(process_group) if config.context_parallel else None

    # ------------------------------------------------------------------------
    # validation: everything is checked before the first expensive step

    def _validate(self, group: Group, *, needs_ref: bool = False, needs_rewards: bool = True, totals=None,
                  state: PromptState | None = None):
        """Validate locally (and a reused `state`); under context parallelism every rank
        then learns whether any rank failed or was given a different group, and all raise
        together (`agree_across_ranks`). Returns the rewards."""
        return self.agree_across_ranks(
            lambda: self._validate_local(group, needs_ref=needs_ref, needs_rewards=needs_rewards, totals=totals,
                                         state=state),
            lambda rewards, failed: _fingerprint(None if failed else group, rewards))

    def check_positions(self, prompt_tokens: int, new_tokens: int, what: str) -> int:
        """Refuse prompt + `new_tokens` beyond the model's max_position_embeddings (unless
        `allow_position_overflow`); return the total."""
        limit, total = self.adapter.max_positions, prompt_tokens + new_tokens
        if limit is not None and total > limit and not self.config.allow_position_overflow:
            raise PositionLimitError(
                f"prompt ({prompt_tokens}) + {what} ({new_tokens}) = {total} tokens exceeds the model's "
                f"max_position_embeddings={limit}; shorten the input or pass ExecConfig(allow_position_overflow=True)"
            )
        return total

    def check_runnable(self) -> None:
        """Refuse model states and contexts we cannot run exactly (before any work)."""
        self.adapter.check_runnable()
        if torch.is_autocast_enabled(self.adapter.device.type):
            raise ConfigError(
                "torch.autocast is active: LongStraw's custom autograd kernels recompute in backward and would not "
                "see the same autocast state; load the model in bf16 instead (model.to(torch.bfloat16)): attention "
                "statistics, log-probs and the loss are computed in fp32 regardless"
            )

    def agree_across_ranks(self, local, fingerprint):
        """Run `local()` (it raises a LongStrawError on bad input) and return its result.
        Under context parallelism, one all-gather then tells every rank whether any rank
        failed or holds a different `fingerprint(result, failed)` (a fixed-length float64
        tensor), and all raise together: no rank waits out a timeout for a peer that
        raised. The failing rank raises its own error."""
        result, problem = None, None
        try:
            result = local()
        except LongStrawError as exc:
            if self.cp is None:
                raise
            problem = exc
        if self.cp is not None:
            try:
                check_same_group(fingerprint(result, problem is not None), self.cp,
                                 problem=f"{type(problem).__name__}: {problem}" if problem else "")
            except InvalidGroupError:
                if problem is not None:
                    raise problem from None  # this rank's own error, after telling the others
                raise
        return result

    def _validate_local(self, group: Group, *, needs_ref: bool, needs_rewards: bool, totals, state):
        rewards = validate_group(group, vocab_size=self.adapter.vocab_size, needs_ref=needs_ref,
                                 needs_rewards=needs_rewards)
        longest = max(int(r.numel()) for r in group.responses)
        total = self.check_positions(int(group.prompt.numel()), longest, "longest response")
        self.check_runnable()
        if self.cp is not None:
            self.adapter.check_context_parallel(total)
        if totals is not None:
            self._check_totals(group, totals)
        if state is not None:
            check_state(state, self, group.prompt, total=total)
        return rewards

    @staticmethod
    def _check_totals(group: Group, totals: BatchTotals) -> None:
        if not isinstance(totals, BatchTotals):
            raise InvalidGroupError(f"totals must be a longstraw.BatchTotals, got {type(totals).__name__}")
        longest = max(int(r.numel()) for r in group.responses)
        if (totals.num_sequences < group.size or totals.num_tokens < group.response_tokens
                or totals.max_response_tokens < longest):
            raise InvalidGroupError(
                f"totals {totals} are smaller than this group alone (G={group.size}, "
                f"tokens={group.response_tokens}, longest={longest}); pass BatchTotals.of(all groups of the batch)"
            )

    # ------------------------------------------------------------------------
    # the phases

    def _capture_chunks(self, ids: torch.Tensor, start: int, states: list[PromptState], size: int,
                        desc: str | None, keep_graph_bytes: int = 0) -> None:
        """Run ids [T] at positions start.. in chunks of `size` under no_grad,
        appending their state to states[-1].

        With `keep_graph_bytes` > 0 (exact mode; states[-1] already has its gradient
        buffers), the first chunk runs with autograd and its graph is measured
        (`kept_graphs.SavedBytes`); the last chunks whose graphs fit the budget then run
        with autograd too, and their roots are kept in `states[-1].kept` for the walk."""
        starts = list(range(0, ids.shape[0], size))
        keep: set[int] = set()
        for a in _progress(starts, enabled=self.config.progress, desc=desc, total=len(starts)):
            piece = ids[a : a + size]
            measure = keep_graph_bytes > 0 and a == 0
            saved = SavedBytes(self.model) if measure else contextlib.nullcontext()
            with torch.set_grad_enabled(measure or a in keep), saved:
                states[-1].seeds = []
                self.adapter.run(piece, start + a, states, phase="capture", block_size=self.config.attention_block_size)
            if measure:
                keep = chunks_to_keep(starts, saved.total, keep_graph_bytes)
            if a in keep:
                states[-1].kept[start + a] = states[-1].seeds
            states[-1].seeds = []
            states[-1].length += piece.shape[0]

    def progress_bar(self, desc: str):
        """A function wrapping an iterable in this engine's progress display (or not)."""
        return lambda iterable: _progress(iterable, enabled=self.config.progress, desc=desc, total=len(iterable))

    def capture(self, prompt: torch.Tensor, *, exact: bool = False, keep_graph_bytes: int = 0,
                rope_length: int | None = None) -> PromptState:
        """Run prompt[:-1] ([P-1] tokens) in chunks under no_grad; return its state,
        stamped with its origin (`rollout.StateOrigin`). With `exact`, it keeps what the
        reverse walk needs (every chunk boundary, every sliding-window position); `step`
        allocates its gradient buffers, unless `keep_graph_bytes` > 0: then they are
        allocated first and the last chunks' graphs that fit are kept (`kept_graphs.py`).
        `rope_length` (default P): the whole sequence's length (prompt + longest
        response), whose RoPE frequencies every call against the state uses
        (`models/rope.py`)."""
        ids = prompt[:-1].to(self.adapter.device)
        shard = self._shard()
        offload = self.config.offloads_state()
        state = self.adapter.new_state(ids.shape[0], exact=exact, shard=shard, host=offload)
        state.rope_length = int(prompt.numel()) if rope_length is None else rope_length
        if offload:  # per-token rows in host memory, staged one layer at a time (offload.py)
            state.offload = Stager(state, self.adapter.device)
        keep_graph_bytes = keep_graph_bytes if exact else 0
        if keep_graph_bytes > 0:
            state.enable_grad_buffers()  # the kept graphs add into these sinks in the walk
        if shard is not None and self.divides_capture(ids.shape[0], keep_graph_bytes):
            # each prompt token computed on one rank, layer by layer (`parallel.divided.py`)
            divided_capture(self.adapter, ids, state, shard, chunk_size=self.config.chunk_size, exact=exact,
                            block_size=self.config.attention_block_size)
        else:
            self._capture_chunks(ids, 0, [state], self.config.chunk_size, "capture", keep_graph_bytes)
        stamp_state(state, self, prompt, exact)
        return state

    def _shard(self) -> Shard | None:
        """This rank's deal of the prompt positions under context parallelism (None without)."""
        if self.cp is None:
            return None
        block = self.config.shard_block_size or self.config.attention_block_size
        return Shard(rank=self.cp.rank, world=self.cp.world, block=block, cp=self.cp)

    def divides_walk(self, state: PromptState) -> bool:
        """Whether exact mode's reverse walk over `state` runs divided under context
        parallelism (each prompt token recomputed and backpropagated on the rank that owns
        it, `parallel.divided.py`): the family supports it (every family LongStraw runs), the state
        is not offloaded, no capture graphs were kept (they are replicated), FSDP2-sharded
        layers (if any) shard over a 1-D mesh holding every context-parallel rank (their
        reduce-scatter is then set to sum the partial gradients: `fsdp_sum_factor`), and
        every rank owns a block."""
        if self.cp is None or not (self.config.divide_walk and self.adapter.divides_walk):
            return False
        if state.offload is not None or state.kept:
            return False
        sharded = self.adapter.sharded_modules()
        if sharded and fsdp_sum_factor(sharded, self.cp) is None:
            return False
        return self._every_rank_owns_a_block(state.length)

    def _every_rank_owns_a_block(self, positions: int) -> bool:
        """Whether `positions` prompt tokens deal at least one block to every rank (what a
        divided capture or walk needs; a shorter prompt runs replicated)."""
        return positions > (self.cp.world - 1) * self._shard().block

    def divides_capture(self, positions: int, keep_graph_bytes: int = 0) -> bool:
        """Whether a capture of `positions` tokens runs divided under context parallelism
        (each prompt token on one rank, `parallel.divided.py`): the family supports it,
        no chunk graphs are kept, the state is not offloaded (divided capture writes its
        rows in place on the device; an offloaded state is captured replicated), and every
        rank owns at least one block (a shorter prompt is captured replicated)."""
        if self.cp is None or not (self.config.divide_capture and self.adapter.divides_capture):
            return False
        if self.config.offloads_state():
            return False
        return keep_graph_bytes == 0 and self._every_rank_owns_a_block(positions)

    def walk_back(self, ids: torch.Tensor, start: int, states: list[PromptState], size: int, *,
                  piece_loss=None, desc: str | None = "reverse", shard: Shard | None = None) -> None:
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
        """
        n = ids.shape[0]
        if shard is None:
            chunks = [(a, min(n, a + size), None) for a in range(0, n, size)]
        else:
            assert start == 0 and len(states) == 1, "a divided walk runs over the prompt state"
            chunks = divided_chunks(n, size, shard, at_chunks=self.adapter.restarts_at_chunks)
        for a, b, divided in _progress(chunks[::-1], enabled=self.config.progress and len(chunks) > 1, desc=desc,
                                       total=len(chunks)):
            hidden, kept = None, states[-1].kept.pop(start + a, None)
            if kept is None:  # recompute the chunk (divided: this rank's positions of it) with autograd
                states[-1].seeds = []
                tokens = ids[a:b] if divided is None else ids[divided.positions(ids.device)]
                with torch.enable_grad():
                    hidden = self.adapter.run(tokens, start + a, states, phase="recompute",
                                              block_size=self.config.attention_block_size, divided=divided)
                kept, states[-1].seeds = states[-1].seeds, []
            roots = [(t, g.to(device=t.device, dtype=t.dtype)) for tensors, read in kept for t, g in zip(tensors, read())
                     if g is not None and t.requires_grad]
            if piece_loss is not None:
                with torch.enable_grad():
                    loss = piece_loss(hidden, a, b)
                roots.append((loss, torch.ones_like(loss)))
            if roots:
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
                settle(states)  # offloaded states: the last layers' gradient sinks back to host
            del roots, hidden, kept

    def replay_branch(self, state: PromptState, prompt: torch.Tensor, response: torch.Tensor, piece_loss) -> None:
        """Backpropagate one branch's loss against the read-only prompt state.

        The branch `[prompt[-1]] + response[:-1]` runs at positions P-1.. in pieces
        of `branch_chunk_size` (default: one piece): earlier pieces are captured
        under no_grad into a branch state, then walked back last to first, so the
        branch's peak is set by one piece, not by R.
        """
        inputs = torch.cat([prompt[-1:], response[:-1]]).to(self.adapter.device)  # (R,)
        start, size = prompt.shape[0] - 1, self.config.branch_chunk_size or inputs.shape[0]
        held = (inputs.shape[0] - 1) // size * size  # tokens of every piece but the last
        branch = self.adapter.new_state(held, start=start, exact=True)
        self._capture_chunks(inputs[:held], start, [state, branch], size, None)  # no bar inside replay's
        branch.enable_grad_buffers()
        self.walk_back(inputs, start, [state, branch], size, piece_loss=piece_loss, desc=None)

    def branch_logprobs(self, state: PromptState, prompt: torch.Tensor, response: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [R] of one response against `state`, in one piece
        (used by `score`, without grad; the state is only read)."""
        device = self.adapter.device
        inputs = torch.cat([prompt[-1:], response[:-1]]).to(device)  # (R,)
        hidden = self.adapter.run(inputs, prompt.shape[0] - 1, [state], phase="replay",
                                  block_size=self.config.attention_block_size)
        return self.logprobs(hidden, response.to(device), temperature)

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Chunked lm_head + log-softmax: hidden [n, d], targets [n] -> [n]."""
        return token_logprobs(self.adapter.lm_head, hidden, targets, temperature=temperature,
                              chunk_size=self.config.logits_chunk_size)

    # ------------------------------------------------------------------------
    # public API

    def generate(self, prompt: torch.Tensor, num_samples: int = 8, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, eos_token_id: int | list | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
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

        Returns:
            `Rollout` with `.responses` (G LongTensors [R_i]), `.logprobs` (the sampled tokens'
            log-probs under the temperature-scaled distribution, before top-k / top-p: what
            `score(group, temperature)` gives; temperature 1 for greedy), `.state` (reuse it in
            `step(..., state=)` and `score(..., state=)` while the weights are unchanged) and
            `.metrics`.
        """
        config = SamplingConfig(num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, eos_token_id=eos_token_id)
        return generate(self, prompt, config, generator)

    def _reuse_or_capture(self, group: Group, state: PromptState | None, exact: bool) -> PromptState:
        """The prompt state for `group`: the one given (already checked) or a new capture."""
        if state is None:
            state = self.capture(group.prompt, exact=exact, keep_graph_bytes=self.config.keep_graph_bytes,
                                 rope_length=_sequence_length(group))
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
        state = self.capture(group.prompt, rope_length=_sequence_length(group)) if state is None else state
        with torch.no_grad():
            return [self.branch_logprobs(state, group.prompt, r, temperature).detach() for r in group.responses]

    def step(self, group: Group, grpo: GRPOConfig | None = None, *, totals: BatchTotals | None = None,
             state: PromptState | None = None) -> StepResult:
        """One GRPO group: accumulate this group's share of the loss gradient into `.grad`.

        Args:
            group: the prompt, its G responses and rewards.
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
        rewards = self._validate(group, needs_ref=grpo.beta > 0, totals=totals, state=state)
        totals = BatchTotals.of([group]) if totals is None else totals

        t0, c0 = _clock(self.adapter.device), Traffic.received
        equal = bool(rewards.max() == rewards.min())
        adv = torch.zeros_like(rewards) if equal else G.advantages(rewards, grpo)
        metrics = {
            "context_parallel_world": float(self.cp.world if self.cp is not None else 1),
            "divided_capture": float(state is None and self.divides_capture(
                group.prompt.numel() - 1, self.config.keep_graph_bytes if self.config.mode == "exact" else 0)),
            "prompt_tokens": float(group.prompt.numel()),
            "response_tokens": float(group.response_tokens),
            "num_branches": float(group.size),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if group.size > 1 else 0.0,
            "advantage_mean": float(adv.mean()),
            "advantage_std": float(adv.std()) if group.size > 1 else 0.0,
            "advantage_min": float(adv.min()),
            "advantage_max": float(adv.max()),
            "skipped_zero_advantage": 0.0,
        }
        if equal and grpo.beta == 0:
            # Zero advantage and no KL term: the loss and its gradient are exactly 0.
            metrics.update(skipped_zero_advantage=1.0, divided_capture=0.0, divided_walk=0.0, state_bytes=0.0,
                           state_grad_bytes=0.0, time_capture_s=0.0, time_replay_s=0.0, time_reverse_s=0.0,
                           time_total_s=0.0, comm_bytes_capture=0.0, comm_bytes_replay=0.0, comm_bytes_reverse=0.0,
                           comm_bytes_gradients=0.0)
            return StepResult(loss=0.0, metrics=metrics)

        exact = self.config.mode == "exact"
        state = self._reuse_or_capture(group, state, exact)
        t1, c1 = _clock(self.adapter.device), Traffic.received
        stats = _BranchStats()
        branches = list(enumerate(group.responses))
        for i, response in _progress(branches, enabled=self.config.progress, desc="replay", total=len(branches)):
            weight = G.branch_weight(grpo, totals, response.numel())
            target = response.to(self.adapter.device)

            def piece_loss(hidden, a, b, i=i, weight=weight, target=target):
                logp = self.logprobs(hidden, target[a:b], grpo.temperature)  # (b - a,)
                old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i][a:b].to(logp)
                ref = group.ref_logprobs[i][a:b].to(logp) if grpo.beta > 0 else None
                per_tok, tok_stats = G.per_token_loss(logp, old, float(adv[i]), grpo, ref)
                loss = per_tok.sum() * weight
                stats.add(loss, tok_stats)
                return loss

            self.replay_branch(state, group.prompt, response, piece_loss)
        t2, c2 = _clock(self.adapter.device), Traffic.received
        divided = exact and self.divides_walk(state)
        if divided:  # each prompt token on one rank; the ranks' partial gradients summed once
            with summed_walk_gradients(self.model, self.cp, self.adapter.sharded_modules()):
                self.walk_back(group.prompt[:-1].to(self.adapter.device), 0, [state], self.config.chunk_size,
                               shard=self._shard())
        elif exact:
            self.walk_back(group.prompt[:-1].to(self.adapter.device), 0, [state], self.config.chunk_size)
        t3, c3 = _clock(self.adapter.device), Traffic.received
        if self.cp is not None and self.cp.world > 1 and not divided:
            # replay's (and a replicated walk's) gradients, which backward may sum in a different
            # order on each rank: the first rank's on every rank (a divided walk's sum does this)
            replicate_gradients(replicated_parameters(self.model), self.cp)
        t4, c4 = _clock(self.adapter.device), Traffic.received
        grad_bytes = state.grad_nbytes()
        state.release_grad_buffers()  # the walk spent dLoss/dState: a held state keeps only its rows
        if state.offload is not None:  # since the capture, or since the reused state's last step
            moved = state.offload.stats
            metrics.update(offload_h2d_bytes=float(moved.h2d_bytes), offload_d2h_bytes=float(moved.d2h_bytes),
                           offload_slot_bytes=float(moved.slot_bytes))
            moved.reset()
        metrics.update(
            divided_walk=float(divided),
            state_bytes=float(state.nbytes()),
            state_grad_bytes=float(grad_bytes),  # what the step held (released on return)
            time_capture_s=t1 - t0,
            time_replay_s=t2 - t1,
            time_reverse_s=t3 - t2,
            time_total_s=t4 - t0,
            # bytes this rank received through the context-parallel collectives, by phase
            # (`parallel.collectives.Traffic`'s model; 0 in one process)
            comm_bytes_capture=float(c1 - c0),
            comm_bytes_replay=float(c2 - c1),
            comm_bytes_reverse=float(c3 - c2),
            comm_bytes_gradients=float(c4 - c3),  # replicated gradients made the first rank's
            **stats.summary(with_kl=grpo.beta > 0),
        )
        return StepResult(loss=float(stats.loss), metrics=metrics)
