"""Agent episodes: the G branches' decode loop, with an environment between turns.

One loop serves every rollout (`rollout.generate`). Each branch holds the logits of its
next token; a step samples every live branch, then

    branch emitted eos, fewer than `max_turns` calls:  obs = environment(i, response_i)
        obs None, or response + obs past max_new_tokens   -> the branch ends (TRL's rule)
        else obs is appended (loss mask False, log-prob 0.0) and ABSORBED AS A CHUNK:
        [eos, obs...] runs the capture path into branch i's own state only, against the
        read-only prompt state (`absorb`), and its last row gives branch i's next logits
    otherwise: the branch decodes on; the live branches decode together, one token each,
        in ONE call whatever positions they stand at (`decode_live`: per-branch position
        ids, RoPE and own-cache lengths; branches drift apart when one absorbs an
        observation). Its naive twin `decode_live_grouped` makes one call per distinct
        position (the reference the tests compare against).

A `prefix` is absorbed the same way, once, into branch 0 ([prompt[-1], prefix...]) and
copied to every branch: its rows' logits give the prefix tokens' log-probs.

Shapes: G branches, B of them in a call, T tokens of a chunk, d hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.engine.logprobs import scaled_log_softmax
from longstraw.errors import ConfigError, EpisodeError
from longstraw.parallel.context import broadcast_from_first
from longstraw.phase import Phase


@dataclass(kw_only=True, slots=True)
class EpisodeConfig:
    """What `Engine.generate` adds to sampling for agent episodes (checked by `check`)."""

    environment: object = None
    """env(branch: int, response: LongTensor [R]) -> LongTensor [O] of observation ids, or
    None (the branch ends); called when a branch emits eos. None: single-turn."""
    max_turns: int = 1
    """Environment calls per branch at most (0: never called)."""
    prefix: torch.Tensor | None = None
    """LongTensor [L]: every response starts with these tokens (absorbed as a chunk)."""
    prefix_loss_mask: torch.Tensor | None = None
    """bool [L]: the prefix tokens' loss mask (default all True)."""

    def check(self, vocab_size: int, max_new_tokens: int, eos_ids: list) -> None:
        """Refuse, before any work, what the episode cannot run."""
        m = self.max_turns
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise EpisodeError(f"generate: max_turns must be an int >= 0, got {m!r}")
        if self.environment is not None:
            if not callable(self.environment):
                raise EpisodeError(f"generate: environment must be callable env(branch, response), got "
                                   f"{type(self.environment).__name__}")
            if not eos_ids:
                raise ConfigError("generate: an environment is called when a branch emits eos; pass eos_token_id")
        if self.prefix is not None:
            check_ids("prefix", self.prefix, vocab_size)
            if self.prefix.numel() > max_new_tokens:
                raise EpisodeError(f"generate: prefix has {self.prefix.numel()} tokens, more than max_new_tokens="
                                   f"{max_new_tokens} (responses include the prefix); raise max_new_tokens")
        mask = self.prefix_loss_mask
        if mask is not None:
            want = None if self.prefix is None else tuple(self.prefix.shape)
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != want:
                got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise EpisodeError(f"generate: prefix_loss_mask must be a bool tensor of the prefix's shape {want}, "
                                   f"got {got}" + (" (no prefix given)" if want is None else ""))


def check_ids(name: str, ids, vocab_size: int) -> None:
    """ids must be a 1-D LongTensor of ids in [0, vocab_size) (it may be empty)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.dim() != 1:
        got = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise EpisodeError(f"{name} must be a 1-D torch.LongTensor of token ids (or None), got {got}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise EpisodeError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


# ----------------------------------------------------------------------------
# the model calls


def absorb(engine, state, branches, i: int, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """Run tokens [T] at positions position.. into branch i's own state as ONE chunk
    (capture path, stacked after the read-only prompt state). Returns hidden [T, d]."""
    view = branches.view(i, rope_length=state.rope_length)
    hidden = engine.adapter.run(tokens.to(engine.adapter.device), position, [state, view], phase=Phase.CAPTURE,
                                block_size=engine.config.attention_block_size)
    branches.settle(i, view)
    return hidden


def decode_step(engine, state, branches, tokens: torch.Tensor, rows: list[int], position: int,
                positions: list[int] | None = None) -> torch.Tensor:
    """One token for each branch in `rows` (tokens [B]), all at `position` or each at its
    own `positions` [B] (`position` then their least). Returns hidden [B, d]."""
    return engine.adapter.run(tokens, position, [state], phase=Phase.DECODE,
                              block_size=engine.config.attention_block_size, branches=branches, rows=rows,
                              positions=positions)


def decode_live(engine, state, branches, going: list, rec: "Branches", logits: torch.Tensor) -> None:
    """The live branches' next token, [(branch, token)], in ONE decode call, each branch at
    its own position; writes their next logits into logits [G, V] and advances rec.fed."""
    _decode_call(engine, state, branches, going, rec, logits)


def _decode_call(engine, state, branches, going: list, rec: "Branches", logits: torch.Tensor) -> None:
    if not going:
        return
    device = engine.adapter.device
    rows = [i for i, _ in going]
    positions = [branches.start + rec.fed[i] for i in rows]
    ids = torch.tensor([t for _, t in going], dtype=torch.long, device=device)
    hidden = decode_step(engine, state, branches, ids, rows, min(positions), positions)
    logits[torch.tensor(rows, device=device)] = engine.adapter.lm_head(hidden).to(logits.dtype)
    for i in rows:
        rec.fed[i] += 1


def decode_live_grouped(engine, state, branches, going: list, rec: "Branches", logits: torch.Tensor) -> None:
    """`decode_live`'s naive twin: one decode call per distinct position the live branches
    stand at (branches of one call hold the same rows)."""
    at = {}
    for i, token in going:
        at.setdefault(rec.fed[i], []).append((i, token))
    for _, group in sorted(at.items()):
        _decode_call(engine, state, branches, group, rec, logits)


# ----------------------------------------------------------------------------
# the loop


@dataclass
class Branches:
    """The loop's per-branch records (python lists: G is small)."""

    tokens: list
    logps: list
    masks: list
    turns: list
    fed: list
    """rows in the branch's state (its next token goes at position start + fed)"""
    live: list


def start_logits(engine, state, branches, prompt, sampling, episode: EpisodeConfig, rec: Branches, temperature):
    """The G branches' first logits [G, V]: from the prompt's last token, or after the prefix."""
    g, start = sampling.num_samples, prompt.shape[0] - 1
    device = engine.adapter.device
    if episode.prefix is None:
        hidden = decode_step(engine, state, branches, prompt[-1:].to(device).expand(g).contiguous(), None, start)
        return engine.adapter.lm_head(hidden)  # (G, V)
    prefix = episode.prefix.to(device)
    hidden = absorb(engine, state, branches, 0, torch.cat([prompt[-1:].to(device), prefix]), start)  # (L + 1, d)
    branches.copy_branch(0, list(range(1, g)))
    logits = engine.adapter.lm_head(hidden)  # (L + 1, V)
    logp = scaled_log_softmax(logits[:-1], temperature).gather(-1, prefix[:, None])[:, 0]  # (L,)
    mask = episode.prefix_loss_mask if episode.prefix_loss_mask is not None else torch.ones_like(prefix, dtype=bool)
    for i in range(g):
        rec.tokens[i] += prefix.tolist()
        rec.logps[i] += logp.tolist()
        rec.masks[i] += mask.tolist()
        rec.fed[i] = prefix.numel() + 1
    return logits[-1:].expand(g, -1)


def take_turn(engine, state, branches, i: int, sampling, episode: EpisodeConfig, rec: Branches):
    """Branch i emitted eos: call the environment if it may, append and absorb the
    observation. Returns branch i's next logits [V], or None when it ends."""
    if episode.environment is None or rec.turns[i] >= episode.max_turns:
        return None
    response = torch.tensor(rec.tokens[i], dtype=torch.long)
    obs = episode.environment(i, response)
    rec.turns[i] += 1
    if obs is None:
        return None
    check_ids(f"environment(branch={i}) observation", obs, engine.adapter.vocab_size)
    engine.adapter.check_inputs(None, None, [obs], what="environment observation")  # text only (models/vision.py)
    room = sampling.max_new_tokens - len(rec.tokens[i])
    if obs.numel() > room:
        return None  # TRL: an observation that would pass max_new_tokens is not appended
    chunk = torch.cat([response[-1:], obs.to("cpu")])  # eos, which was never fed, then the observation
    rec.tokens[i] += obs.tolist()
    rec.logps[i] += [0.0] * obs.numel()
    rec.masks[i] += [False] * obs.numel()
    if obs.numel() == room:
        return None  # full: nothing more is sampled
    hidden = absorb(engine, state, branches, i, chunk, branches.start + rec.fed[i])
    rec.fed[i] += chunk.numel()
    return engine.adapter.lm_head(hidden[-1:])[0]


@torch.no_grad()
def run_episodes(engine, state, prompt, sampling, episode: EpisodeConfig, generator, progress, sample_tokens,
                 decode=None):
    """Decode G branches from a captured prompt state, with `episode`'s environment and
    prefix; `decode` steps the live branches (default `decode_live`; `decode_live_grouped`
    is its naive twin). Returns (responses, logprobs, loss_masks, turns, metrics)."""
    decode = decode_live if decode is None else decode
    adapter, g, n = engine.adapter, sampling.num_samples, sampling.max_new_tokens
    device = adapter.device
    branches = adapter.new_branch_state(state, g, n + 1)  # row 0 is the prompt's last token
    eos = set(sampling.eos_ids())
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    rec = Branches(tokens=[[] for _ in range(g)], logps=[[] for _ in range(g)], masks=[[] for _ in range(g)],
                   turns=[0] * g, fed=[1] * g, live=[True] * g)
    logits = start_logits(engine, state, branches, prompt, sampling, episode, rec, temperature).clone()  # (G, V)
    rec.live = [len(t) < n for t in rec.tokens]
    steps = sampled = 0
    ticks = iter(progress(range(n)))  # the bar counts steps (a multi-turn episode may take more)
    while any(rec.live):
        rows = [i for i in range(g) if rec.live[i]]
        sub = logits[torch.tensor(rows, device=device)]  # (B, V)
        nxt = sample_tokens(sub, sampling, generator)
        if engine.cp is not None:  # every rank samples the same; rank 0's draw is the one kept
            broadcast_from_first(nxt, engine.cp)
        logp = scaled_log_softmax(sub, temperature).gather(-1, nxt[:, None])[:, 0]  # (B,)
        steps, sampled = steps + 1, sampled + len(rows)
        next(ticks, None)
        going = []
        for i, token, lp in zip(rows, nxt.tolist(), logp.tolist()):
            rec.tokens[i].append(token)
            rec.logps[i].append(lp)
            rec.masks[i].append(True)
            if len(rec.tokens[i]) >= n:
                rec.live[i] = False
            elif token in eos:
                after = take_turn(engine, state, branches, i, sampling, episode, rec)
                rec.live[i] = after is not None
                if after is not None:
                    logits[i] = after
            else:
                going.append((i, token))
        decode(engine, state, branches, going, rec, logits)  # one call, each branch at its own position
    dtype = logits.dtype if logits.dtype == torch.float64 else torch.float32
    responses = [torch.tensor(t, dtype=torch.long, device=device) for t in rec.tokens]
    logprobs = [torch.tensor(lp, dtype=dtype, device=device) for lp in rec.logps]
    masks = [torch.tensor(m, dtype=torch.bool, device=device) for m in rec.masks]
    metrics = {"branch_state_bytes": float(branches.nbytes()), "decode_steps": float(steps),
               "generated_tokens": float(sampled), "environment_calls": float(sum(rec.turns))}
    return responses, logprobs, masks, list(rec.turns), metrics
