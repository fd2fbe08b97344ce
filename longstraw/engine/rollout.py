"""Rollouts from the captured prompt state: one capture per GRPO iteration.

`Engine.generate` captures the prompt once (the same state `step` and `score` read),
or reuses a given one, then decodes the G branches together, one token per step
(the loop, with agent episodes' environment and prefix, is `episode.py`):

    tokens [G] at position P-1+j  ->  adapter.run(phase=Phase.DECODE)  ->  hidden [G, d]
    ->  lm_head  ->  logits [G, vocab]  ->  sample (temperature, top-k, top-p)

Every branch starts by feeding the prompt's last token, exactly as replay does, and
keeps only its own tokens' state (`state/branch.py`); the prompt state is shared and
only read. The returned `Rollout.state` is that prompt state, stamped with where it came
from (`StateOrigin`), so `step(group, state=...)` and `score(group, state=...)` can skip
capture and refuse, before any work, a state from another prompt, engine or mode, or
one captured under weights that have since changed (an optimizer step, a LoRA adapter
switch): nothing is silently stale.

Log-probs are those of the sampled tokens under the temperature-scaled distribution,
before top-k / top-p truncation (what `score(group, temperature)` returns); for greedy
decoding (temperature 0) under the unscaled distribution (temperature 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from longstraw.engine.clock import clock
from longstraw.host import to_host
from longstraw.engine.episode import EpisodeConfig, run_episodes
from longstraw.engine.inputs import check_inputs
from longstraw.engine.logprobs import scaled_logits
from longstraw.errors import ConfigError, StaleStateError, StateMismatchError
from longstraw.group import check_token_ids
from longstraw.models.rope import rotary_of
from longstraw.models.vision import placeholder_ids
from longstraw.parallel.fsdp import fsdp_sharded_parameters


@dataclass
class Rollout:
    """What `Engine.generate` returns.

    Fields:
        responses: G LongTensors [R_i]; a response that hit eos ends with it.
        logprobs: G float tensors [R_i], the sampled tokens' log-probs (see module doc).
        state: the captured prompt state; pass it to `step` / `score` while the weights
            are unchanged.
        metrics: floats: time_capture_s, time_generate_s, generated_tokens (sampled),
            tokens_per_s, state_bytes, branch_state_bytes, decode_steps, environment_calls.
        loss_masks: G bool tensors [R_i]: True exactly at the tokens the policy sampled
            (and at prefix tokens, unless `prefix_loss_mask` says otherwise); False at
            observation tokens, whose log-prob is 0.0.
        turns: G ints, the environment calls each branch made.
    """

    responses: list
    logprobs: list
    state: object
    metrics: dict = field(default_factory=dict)
    loss_masks: list = field(default_factory=list)
    turns: list = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """The sampling parameters of `Engine.generate` (HF `generate` / vLLM meanings)."""

    num_samples: int = 8
    """G, branches sampled from the one prompt state."""
    max_new_tokens: int = 256
    """Tokens per branch at most (a branch that emits eos stops there)."""
    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    eos_token_id: int | list | None = None
    """Token id(s) that end a branch (kept as its last token)."""
    suppressed_ids: tuple = ()
    """Token ids never sampled, greedy included (`generate` sets a VLM's image / video
    placeholders: responses are text). The returned log-probs stay the model's own."""

    def __post_init__(self):
        for name in ("num_samples", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"generate: {name} must be a positive int, got {value!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ConfigError(f"generate: top_p must be in (0, 1], got {p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"generate: top_k must be an int >= 0 (0: no top-k), got {self.top_k!r}")

    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else list(eos)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"generate: eos_token_id must be an int >= 0 or a list of them, got {eos!r}")
        return ids


# ----------------------------------------------------------------------------
# where a state came from, and whether it may be reused


def weights_stamp(model) -> tuple:
    """A cheap fingerprint of the weights a state is computed from: every parameter's
    version counter (bumped by any in-place update, e.g. `optimizer.step()`) and storage,
    a checksum of a strided sample of its values (catches updates through `.data`), and
    the active / disabled / merged adapters of PEFT layers. An FSDP2 parameter is stamped
    by its sharded DTensor, whether the module is sharded or unsharded just now."""
    shards = fsdp_sharded_parameters(model)  # FSDP2 swaps sharded and full tensors: stamp the shards
    params = list({id(q): q for q in (shards.get(id(p), p) for p in model.parameters())}.values())
    versions = []
    samples = []
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p  # DTensor (FSDP2): its local shard
        versions.append((p._version, local._version, 0 if is_fake(local) else local.data_ptr()))
        flat = local.detach().reshape(-1) if local.is_contiguous() else local.detach().flatten()
        step = max(1, flat.numel() // 32)
        samples.append(flat[::step][:32].double().sum() if flat.numel() else flat.new_zeros((), dtype=torch.float64))
    checksum = to_host(torch.stack(samples), bytes) if samples else b""  # one sync
    adapters = []
    for name, module in model.named_modules():
        if hasattr(module, "active_adapters") and hasattr(module, "disable_adapters") and hasattr(module, "merged"):
            adapters.append((name, tuple(module.active_adapters), bool(module.disable_adapters),
                             tuple(getattr(module, "merged_adapters", ()))))
    return tuple(versions), checksum, tuple(adapters)


@dataclass
class StateOrigin:
    """What a captured prompt state was computed from (set by `Engine.capture`)."""

    engine: object
    """the capturing `Engine` (compared by identity)"""
    prompt: torch.Tensor
    """the prompt ids [P] (on the CPU)"""
    stamp: tuple
    """`weights_stamp` of the model at capture"""
    exact: bool
    """captured with what exact mode's reverse walk needs"""
    inputs: dict | None = None
    """the prompt's non-text inputs (`Group.prompt_inputs`) it was captured with"""


def stamp_state(state, engine, prompt: torch.Tensor, exact: bool, prompt_inputs: dict | None = None) -> None:
    inputs = None if prompt_inputs is None else {k: v for k, v in prompt_inputs.items() if v is not None}
    state.origin = StateOrigin(engine=engine, prompt=prompt.detach().to("cpu", torch.long).clone(),
                               stamp=weights_stamp(engine.model), exact=exact, inputs=inputs)


def same_inputs(held: dict | None, given: dict | None) -> bool:
    """Whether prompt inputs `given` are those a state was captured with (`held`)."""
    given = None if given is None else {k: v for k, v in given.items() if v is not None}
    if not held or not given:
        return not held and not given
    return held.keys() == given.keys() and all(
        held[k] is given[k] or (held[k].shape == given[k].shape and held[k].dtype == given[k].dtype
                                and torch.equal(held[k], given[k].to(held[k].device))) for k in held)


def check_state(state, engine, prompt: torch.Tensor, total: int | None = None, inputs: dict | None = None) -> None:
    """Refuse, before any work, a state that `engine` cannot reuse for `prompt` (and a
    group of `total` = P + longest response positions).

    Raises:
        StateMismatchError: not a captured state, or one from another engine, prompt or
            mode, or (length-dependent RoPE) captured for fewer than `total` positions.
        StaleStateError: the model's weights or adapters changed since the capture.
    """
    origin = getattr(state, "origin", None)
    if not isinstance(origin, StateOrigin):
        raise StateMismatchError(f"state must be a prompt state returned by Engine.generate (rollout.state), "
                                 f"got {type(state).__name__}")
    if origin.engine is not engine:
        raise StateMismatchError("this state was captured by another Engine; pass it to the engine that "
                                 "generated it (or capture again)")
    if origin.exact != (engine.config.mode == "exact"):
        raise StateMismatchError(f"this state was captured for mode={'exact' if origin.exact else 'detached'}, "
                                 f"but the engine runs mode={engine.config.mode!r}")
    ids = prompt.detach().to("cpu", torch.long)
    if ids.shape != origin.prompt.shape or not torch.equal(ids, origin.prompt):
        raise StateMismatchError(f"this state was captured for another prompt ({origin.prompt.numel()} tokens); "
                                 f"the group's prompt has {ids.numel()} tokens or different ids")
    if not same_inputs(origin.inputs, inputs):
        raise StateMismatchError("this state was captured with other prompt_inputs (pixel values, image grids or "
                                 "token types) than the group's; pass the inputs it was captured with, or capture "
                                 "again")
    if total is not None and total > state.rope_length and rotary_of(engine.adapter.backbone) is not None:
        raise StateMismatchError(
            f"this state's RoPE frequencies are those of a {state.rope_length}-position sequence (rope_type "
            f"{engine.adapter.config.rope_parameters.get('rope_type')!r} picks them from the length), but the group "
            f"needs {total} positions; capture again (call step/score without state=, or generate with a larger "
            "max_new_tokens)")
    if weights_stamp(engine.model) != origin.stamp:
        raise StaleStateError("the model's weights (or active adapters) changed since this state was captured, "
                              "e.g. by optimizer.step(); capture again (call engine.generate again)")


# ----------------------------------------------------------------------------
# sampling


def sample_tokens(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [G] from logits [G, vocab]: argmax when temperature is 0, else a draw
    from softmax(logits / temperature) restricted to the top-k and the top-p nucleus."""
    if config.suppressed_ids:  # (G, vocab): a VLM's placeholders can never be drawn
        logits = logits.index_fill(-1, torch.tensor(config.suppressed_ids, device=logits.device), float("-inf"))
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    scores = scaled_logits(logits, config.temperature)  # (G, vocab), float32 for half precision
    if 0 < config.top_k < scores.shape[-1]:
        kth = scores.topk(config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= config.top_p  # mass before a token already reaches top_p
        drop[..., 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator)[:, 0].to(logits.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------
# the rollout


def validate_prompt(engine, prompt, config: SamplingConfig) -> None:
    """Everything `generate` checks before any work."""
    check_token_ids("prompt", prompt, engine.adapter.vocab_size, min_len=2)
    config.eos_ids()
    engine.check_positions(int(prompt.numel()), config.max_new_tokens, "max_new_tokens")
    engine.check_runnable()


def generate(engine, prompt: torch.Tensor, config: SamplingConfig, generator=None,
             episode: EpisodeConfig | None = None, state=None, prompt_inputs: dict | None = None) -> Rollout:
    """Capture `prompt` once (or reuse `state`, checked) and sample `config.num_samples`
    responses from its state, with `episode`'s environment and prefix. See `Engine.generate`."""
    episode = episode if episode is not None else EpisodeConfig()

    def fingerprint(_, failed: bool) -> torch.Tensor:
        prefix = episode.prefix if episode.prefix is not None and not failed else torch.zeros(0)
        fields = [0.0] * 9 if failed else [prompt.numel(), prompt.double().sum(), config.num_samples,
                                            config.max_new_tokens, config.temperature, config.top_p, config.top_k,
                                            prefix.numel(), prefix.double().sum()]
        return torch.tensor([float(x) for x in fields], dtype=torch.float64)

    def validate():
        validate_prompt(engine, prompt, config)
        episode.check(engine.adapter.vocab_size, config.max_new_tokens, config.eos_ids())
        check_inputs(engine, prompt, prompt_inputs, [] if episode.prefix is None else [episode.prefix], "prefix")
        if state is not None:
            check_state(state, engine, prompt, total=prompt.numel() + config.max_new_tokens, inputs=prompt_inputs)

    engine.agree_across_ranks(validate, fingerprint)
    config = dataclasses.replace(config, suppressed_ids=placeholder_ids(engine.adapter.vision))
    t0 = clock(engine.adapter.device)
    if state is None:
        with engine.phase_hook("capture"):
            state = engine.capture(prompt, exact=engine.config.mode == "exact", prompt_inputs=prompt_inputs,
                                   rope_length=prompt.numel() + config.max_new_tokens)  # the sampler's RoPE length
    t1 = clock(engine.adapter.device)
    progress = engine.progress_bar("generate")
    with engine.phase_hook("generate"):  # the planner's generate phase (`plan/generate.py`)
        responses, logprobs, masks, turns, metrics = run_episodes(engine, state, prompt, config, episode, generator,
                                                                  progress, sample_tokens)
    t2 = clock(engine.adapter.device)
    metrics.update(time_capture_s=t1 - t0, time_generate_s=t2 - t1, state_bytes=float(state.nbytes()),
                   tokens_per_s=metrics["generated_tokens"] / max(t2 - t1, 1e-9))
    return Rollout(responses=responses, logprobs=logprobs, state=state, metrics=metrics, loss_masks=masks,
                   turns=turns)
