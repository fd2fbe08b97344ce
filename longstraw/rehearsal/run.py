"""`rehearse`: the engine's own `step` at full size on fake tensors (shapes, no data).

The model's weights, the prompt state and every activation are `FakeTensor`s
(`torch._subclasses.fake_tensor.FakeTensorMode`): each op computes its output's shape,
dtype and strides and allocates nothing. The token ids and rewards stay real (random,
small) and are checked for real (`longstraw.host.on_host`); every read of device data
goes through `longstraw.host.to_host`, which answers a fake tensor with a stand-in and
counts the read. `LiveBytes` counts the fake storages the way it counts real ones, so
the peak a rehearsal reports is the peak the same code holds in live tensors on a real
device (tests/test_rehearse.py checks this against real tiny models).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import multiprocessing
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.config import ExecConfig, GRPOConfig
from longstraw.engine import Engine
from longstraw.engine.clock import loop_position
from longstraw.errors import ConfigError, LongStrawError
from longstraw.group import Group
from longstraw.rehearsal.fast_fake import fake_mode
from longstraw.rehearsal.lora import check_lora, check_twin, like, twin_adapters, with_adapters, with_lora
from longstraw.rehearsal.kernels import DeviceKernels, needs_device_kernels
from longstraw.rehearsal.measure import StepFigures, measure_steps
from longstraw.rehearsal.ranks import check_world, fake_group, rehearsed_ranks, shard_fake
from longstraw.rehearsal.tracker import LiveBytes


@dataclass(kw_only=True, slots=True)
class Rehearsal:
    """What a rehearsal measured (bytes are live-tensor bytes on the rehearsed device)."""

    peak_bytes_per_rank: int
    """The highest live bytes over every rehearsed step: the planner's `peak_bytes_per_rank`."""
    phases: dict[str, int]
    """Peak live bytes per phase (capture, replay, walk in exact mode, optimizer if given), worst step."""
    flops: dict[str, int]
    """FLOPs per phase of the first step (`torch.utils.flop_counter`'s formulas)."""
    host_syncs: int
    """Reads of device data per step (the most of any step)."""
    steps: list[StepFigures] = field(default_factory=list)
    """Each step's own figures (a leak shows as a later step's higher peak)."""
    wall_s: float = 0.0
    """The rehearsal's own wall time (building the fake model included)."""
    device: str = "cuda"
    comm_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """{phase: {collective: bytes}} this rank received in the first step (capture, replay,
    walk, gradients; `parallel.collectives.Traffic`'s model, the engine's `comm_bytes_*`
    split by collective); {} for world_size 1."""
    host_bytes: int = 0
    """The highest live host bytes over every rehearsed step (the planner's host figure:
    offloaded snapshots, state offload's arenas; never among `peak_bytes_per_rank`)."""
    host_phases: dict[str, int] = field(default_factory=dict)
    """Peak live host bytes per phase, worst step."""
    rank: int = 0
    """The rank these figures are of: of the rehearsed ranks, the one with the highest peak."""
    world_size: int = 1
    rank_peaks: dict[int, int] = field(default_factory=dict)
    """{rank: peak_bytes} of every rehearsed rank (`rehearsal.ranks.rehearsed_ranks`)."""
    rank_comm_bytes: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)
    """{rank: comm_bytes} of every rehearsed rank (first step): the ranks receive different
    bytes (a broadcast's source none; the rank with the fewest prompt rows the most of capture's)."""

    def as_dict(self) -> dict:
        """The JSON form (`longstraw plan --rehearse`'s "rehearsal")."""
        return {"peak_bytes_per_rank": self.peak_bytes_per_rank, "phases": dict(self.phases),
                "flops": dict(self.flops), "host_syncs": self.host_syncs, "wall_s": self.wall_s,
                "device": self.device, "step_peaks": [s.peak_bytes for s in self.steps],
                "ops": [s.ops for s in self.steps], "comm_bytes": {k: dict(v) for k, v in self.comm_bytes.items()},
                "host_bytes": self.host_bytes, "host_phases": dict(self.host_phases),
                "rank": self.rank, "world_size": self.world_size, "rank_peaks": dict(self.rank_peaks),
                "rank_comm_bytes": {r: {k: dict(v) for k, v in c.items()} for r, c in self.rank_comm_bytes.items()}}


def _default_device() -> str:
    return "cuda" if torch.backends.cuda.is_built() else "cpu"


def fake_model(config, *, device: str, dtype: torch.dtype, mode: FakeTensorMode, lora: tuple[int, str] | None = None,
               adapters=None, like: dict | None = None) -> nn.Module:
    """A stock HF causal LM of `config` whose parameters and buffers are fake tensors on
    `device` (built on the meta device, nothing initialised, nothing allocated).

    `lora` = (rank, targets): wrapped with PEFT LoRA on the planner's linears
    (`rehearsal.lora.with_lora`). `adapters`: a PEFT model's own (`lora.twin_adapters`),
    each parameter then given the dtype and `requires_grad` of `like`'s (`lora.like`)."""
    config = copy.deepcopy(config)  # the caller's (a real model's) keeps its attention implementation
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora is not None:
        model = with_lora(model, *lora)
    elif adapters is not None:
        model = with_adapters(model, adapters)
    if like is not None:
        check_twin(model, like)
    with mode:
        for prefix, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    _, dt, grad = (like or {}).get(f"{prefix}.{name}" if prefix else name, (None, p.dtype,
                                                                                            p.requires_grad))
                    module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device),
                                                            requires_grad=grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model.eval()


def rehearsal_group(*, prompt_tokens: int, group: int, response_tokens: int, vocab_size: int,
                    seed: int = 0, shared_prefix: int = 0) -> Group:
    """The real (host) inputs of a rehearsed step: random prompt and response ids, distinct
    rewards; every response starts with the same `shared_prefix` ids (then differs), the
    trie a prefix-tree step (`ExecConfig(share_response_prefixes=True)`) runs once."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen)
    head = torch.randint(0, vocab_size, (shared_prefix,), generator=gen)
    responses = [torch.cat([head, torch.randint(0, vocab_size, (response_tokens - shared_prefix,), generator=gen)])
                 for _ in range(group)]
    return Group(prompt=prompt, responses=responses, rewards=torch.arange(group, dtype=torch.float32))


def rehearse(model, config: ExecConfig | None = None, *, prompt_tokens: int, group: int, response_tokens: int,
             world_size: int = 1, rank: int | list[int] | None = None, shard_params: bool = False,
             device: str | None = None, steps: int = 1, generate: bool = False,
             dtype: torch.dtype = torch.bfloat16, grpo: GRPOConfig | None = None,
             optimizer: bool = False, shared_prefix: int = 0, lora_rank: int | None = None,
             lora_targets: str = "attention", progress: bool = False, workers: int = 1) -> Rehearsal:
    """Run `Engine.step` at full size on fake tensors and measure it: live bytes per
    phase, FLOPs per phase, host syncs per step, collective bytes per phase, wall time.

    Nothing is computed and nothing is allocated: a 27B model at 2M prompt tokens
    rehearses on a laptop. The figures are those of this exact code at this exact size
    (the live tensors a real device would hold); see docs/rehearse.md for what a
    rehearsal cannot see (allocator fragmentation, kernel workspaces, speed).

    Args:
        model: an HF config (`transformers.PretrainedConfig`) of a supported family, or a
            stock HF model (its config is used: the rehearsal builds its own fake twin).
        config: the `ExecConfig` to rehearse (default `ExecConfig()`); world_size > 1
            needs `context_parallel=True` (and takes `expert_parallel`).
        prompt_tokens: P. group: G responses. R: response_tokens each.
        world_size: ranks W; each rehearsed rank plays rank r of W in this process on the
            fake process group (`rehearsal/ranks.py`), which is torn down after. Refused
            while this process has a process group of its own.
        rank: the rank(s) to rehearse; default rank 0 (the most prompt rows) and, under
            expert parallelism, the first rank with the most experts. The result is the
            rehearsed rank with the highest peak (`Rehearsal.rank`, `rank_peaks`).
        shard_params: FSDP2 over the W ranks (`parallel.sharding.shard_model`), as
            `longstraw plan --shard-params`.
        device: the fake tensors' device: "cuda" (the CUDA branches; needs a CUDA build
            of torch, since autograd on a fake device checks the device is built in) or
            "cpu"; default "cuda" where torch is built with CUDA, else "cpu".
        steps: steps rehearsed one after the other (the gradients set to None between).
        generate: rehearse `generate` too (not yet: raises `ConfigError`).
        dtype: the weights' dtype for a config (a model gives its own).
        grpo: the objective (default `GRPOConfig()`).
        optimizer: add an AdamW step after each step (phase "optimizer": its moments).
        shared_prefix: the responses' common first tokens (< response_tokens): with
            `ExecConfig(share_response_prefixes=True)` a prefix tree of one shared segment
            and G leaves.
        lora_rank: train PEFT LoRA adapters of this rank instead of every weight (the base
            frozen), on the linears the planner counts for `lora_targets` ("attention":
            the token mixers' projections; "all-linear": also the dense and shared-expert
            MLPs'), in the weights' dtype (`rehearsal/lora.py`). A PEFT model passed as
            `model` keeps its own adapters instead (then leave lora_rank None).
        progress: write a line to stderr as each rank's phase ends (rank, step, phase, time
            since the start, ops so far): a rehearsal at the paper's size takes minutes.
        workers: ranks rehearsed at once, each in a spawned process (`model` a config; a calling
            script guards its entry point with `if __name__ == "__main__":`); the same figures.

    Returns:
        `Rehearsal` (`peak_bytes_per_rank`, `phases`, `host_bytes`, `host_phases`, `flops`,
        `host_syncs`, `comm_bytes`, `rank`, `world_size`, `steps`, `wall_s`).
    """
    t0 = time.perf_counter()
    config = ExecConfig() if config is None else config
    if generate:
        raise ConfigError("rehearse: generate=True is not rehearsed yet; pass generate=False")
    if not 0 <= shared_prefix < response_tokens:
        raise ConfigError(f"rehearse: need 0 <= shared_prefix < response_tokens (the responses must differ, or "
                          f"their advantages do not matter), got shared_prefix={shared_prefix}")
    if min(prompt_tokens - 2, group - 2, response_tokens - 1, steps - 1) < 0:
        raise ConfigError(f"rehearse: need prompt_tokens >= 2, group >= 2 (one response has zero advantage: the "
                          f"engine skips the update, nothing would be rehearsed), response_tokens >= 1 and "
                          f"steps >= 1; got {prompt_tokens}, {group}, {response_tokens}, {steps}")
    check_world(config, world_size, rank, shard_params)
    _check_workers(workers, model)
    device = _default_device() if device is None else device
    if torch.device(device).type == "cuda" and not torch.backends.cuda.is_built():
        raise ConfigError("rehearse: device='cuda' needs a CUDA build of torch (autograd checks the device even on "
                          "fake tensors); pass device='cpu' to rehearse the same code on the CPU branches")
    build = _build(model, lora_rank, lora_targets)
    hf_config, dtype = (model.config, next(model.parameters()).dtype) if isinstance(model, nn.Module) else (model, dtype)
    inputs = rehearsal_group(prompt_tokens=prompt_tokens, group=group, response_tokens=response_tokens,
                             vocab_size=hf_config.get_text_config().vocab_size, shared_prefix=shared_prefix)
    ranks = rehearsed_ranks(hf_config, config, world_size, rank)
    jobs = {r: dict(hf_config=hf_config, config=config, inputs=inputs, device=device, dtype=dtype, steps=steps,
                    grpo=grpo or GRPOConfig(), optimizer=optimizer, shard=world_size if shard_params else 0,
                    build=build, rank=r, world_size=world_size, t0=t0 if progress else None) for r in ranks}
    return _result(_run_jobs(jobs, workers), t0=t0, device=device, world_size=world_size)


def _check_workers(workers, model) -> None:
    """`ConfigError` for a `workers` count `rehearse` cannot use, before any work."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"rehearse: workers must be an int >= 1, got {workers!r}")
    if workers > 1 and isinstance(model, nn.Module):
        raise ConfigError("rehearse: workers > 1 rehearses the ranks in processes of their own from the model's "
                          "config; pass the HF config (model.config), or workers=1")


def _run_jobs(jobs: dict, workers: int) -> dict[int, list[StepFigures]]:
    """{rank: its steps' figures}: the ranks' `_rank_job`s one after the other, or up to
    `workers` at once in spawned processes (a fresh process: no inherited group or fake mode)."""
    if workers == 1 or len(jobs) == 1:
        return {r: _rank_job(job) for r, job in jobs.items()}
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx) as pool:
            return dict(zip(jobs, pool.map(_rank_job, jobs.values())))
    except concurrent.futures.process.BrokenProcessPool as e:
        raise LongStrawError("rehearse: a rank's worker process ended without a result (killed, or out of "
                             "memory?). A script that calls rehearse(workers > 1) must guard its entry point "
                             "with `if __name__ == \"__main__\":`; or pass workers=1") from e


def _rank_job(job: dict) -> list[StepFigures]:
    """One rank's steps in its fake group (`job`: `_rehearse_rank`'s arguments); module-level,
    so a worker process can run it."""
    with fake_group(job["rank"], job["world_size"]):
        return _rehearse_rank(**job)


def _result(by_rank: dict[int, list[StepFigures]], *, t0: float, device: str, world_size: int) -> Rehearsal:
    """The `Rehearsal` of the rehearsed ranks' steps: the rank with the highest peak, its
    worst step's peak per phase (the device's, and the host's apart)."""
    peaks = {r: max(f.peak_bytes for f in figures) for r, figures in by_rank.items()}
    worst = max(peaks, key=lambda r: (peaks[r], -r))
    figures = by_rank[worst]
    phases: dict[str, int] = {}
    host_phases: dict[str, int] = {}
    for f in figures:
        for into, got in ((phases, f.phases), (host_phases, f.host_phases)):
            for name, peak in got.items():
                into[name] = max(into.get(name, 0), peak)
    return Rehearsal(peak_bytes_per_rank=peaks[worst], phases=phases, flops=dict(figures[0].flops),
                     host_bytes=max(f.host_peak_bytes for f in figures), host_phases=host_phases,
                     host_syncs=max(f.host_syncs for f in figures), steps=figures, wall_s=time.perf_counter() - t0,
                     device=device, comm_bytes=figures[0].comm_bytes, rank=worst, world_size=world_size,
                     rank_peaks=peaks, rank_comm_bytes={r: f[0].comm_bytes for r, f in by_rank.items()})


def _progress(rank: int, world_size: int, t0: float):
    """`measure_steps`' on_phase for `progress=True`: one stderr line a phase."""
    def line(step: int, name: str, ops: int) -> None:
        print(f"rehearse: rank {rank} of {world_size}, step {step + 1}: {name} done at {time.perf_counter() - t0:.0f} s "
              f"({ops:,} ops in the step so far)", file=sys.stderr, flush=True)
    return line


PROGRESS_EVERY_S = 60.0
"""`progress=True`: besides a line as each phase ends, one every this many seconds while a
phase runs (the paper's exact walk runs for half an hour)."""


@contextlib.contextmanager
def _ticking(tracker: LiveBytes, rank: int, world_size: int, t0: float | None):
    """While the block runs (t0 given: progress asked), a stderr line every
    PROGRESS_EVERY_S seconds: the phase open now and the ops so far, from a daemon thread."""
    if t0 is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(PROGRESS_EVERY_S):
            phase = tracker.current_phase
            if phase is not None:
                print(f"rehearse: rank {rank} of {world_size}: {phase} running at {time.perf_counter() - t0:.0f} s "
                      f"({tracker.ops:,} ops so far{_pace(loop_position())})", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="rehearse-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _pace(position) -> str:
    """'; reverse 37 of 255, ~14 min left in it' from `clock.loop_position` (nothing before
    the loop's first item finishes): the loop's own pace so far, extrapolated."""
    if position is None or position[1] < 1:
        return ""
    desc, done, total, elapsed = position
    left = elapsed / done * (total - done)
    return f"; {desc} {done:,} of {total:,}, ~{left / 60:.0f} min left in it" if left >= 60 else \
        f"; {desc} {done:,} of {total:,}, ~{left:.0f} s left in it"


def _build(model, lora_rank: int | None, lora_targets: str) -> dict:
    """`fake_model`'s adapter arguments: the planner's LoRA, a PEFT model's own, or none;
    `ConfigError` for a bad rank or targets, or a PEFT model given a rank too."""
    check_lora(lora_rank, lora_targets)
    adapters = twin_adapters(model) if isinstance(model, nn.Module) else None
    if lora_rank is None:
        return {"adapters": adapters, "like": like(model)} if adapters else {}
    if adapters:
        raise ConfigError("rehearse: the model is a PEFT model, rehearsed with its own adapters; drop lora_rank, "
                          "or pass its base model (`model.get_base_model()`) with lora_rank")
    return {"lora": (lora_rank, lora_targets)}


def _rehearse_rank(hf_config, config: ExecConfig, inputs: Group, *, device: str, dtype: torch.dtype, steps: int,
                   grpo: GRPOConfig, optimizer: bool, shard: int, build: dict, rank: int, world_size: int,
                   t0: float | None) -> list[StepFigures]:
    """One rank's measured steps (in the fake group, if any): the fake model (with the
    adapters of `build`, `_build`), its engine, FSDP2 over `shard` ranks when nonzero;
    with `t0` (the rehearsal's start) its progress lines (`_progress`, `_ticking`)."""
    on_phase = None if t0 is None else _progress(rank, world_size, t0)
    mode = fake_mode(allow_non_fake_inputs=True)
    fake = fake_model(hf_config, device=device, dtype=dtype, mode=mode, **build)
    tracker = LiveBytes(torch.device(device).type)
    kernels = DeviceKernels() if needs_device_kernels(torch.device(device).type, dtype) else contextlib.nullcontext()
    with mode, kernels:
        engine = Engine(fake, config)
        counted = (shard_fake(fake, shard, torch.device(device).type, expert_parallel=config.expert_parallel)
                   if shard else contextlib.nullcontext())
        tracker.adopt(list(fake.parameters()) + list(fake.buffers()))
        opt = torch.optim.AdamW(fake.parameters(), foreach=False) if optimizer else None
        with counted, _ticking(tracker, rank, world_size, t0):
            return measure_steps(engine, inputs, grpo, steps=steps, tracker=tracker, optimizer=opt, on_phase=on_phase)
