"""Configuration objects: how to execute (`ExecConfig`) and what to optimise (`GRPOConfig`).

Both are keyword-only dataclasses, validated in `__post_init__` with messages that
name the bad value and the fix. `GRPOConfig` follows TRL's meanings of each field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import defaults
from .defaults import MODES
from .errors import ConfigError

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "none")


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(kw_only=True, slots=True)
class ExecConfig:
    """How the engine runs one group."""

    chunk_size: int = defaults.CHUNK_SIZE
    """Prompt tokens per capture chunk. Any value >= 1; it changes speed and peak
    memory of capture, never the result (beyond float rounding)."""

    mode: str = defaults.MODE
    """"detached": the prompt state is a constant (the paper's gradient).
    "exact": also push gradients through the prompt (the full-sequence gradient)."""

    branch_chunk_size: int | None = defaults.BRANCH_CHUNK_SIZE
    """Replay each branch in pieces of this many tokens, walked back last to first
    (the paper's 4 x 2048 for an 8K response). None: one piece. It bounds a branch's
    peak by one piece instead of R, and changes nothing in the result."""

    attention_block_size: int = defaults.ATTENTION_BLOCK_SIZE
    """Prompt positions per block in the blockwise attention over the captured
    state. Working memory per layer is O(queries x block), never O(queries x P)."""

    logits_chunk_size: int = defaults.LOGITS_CHUNK_SIZE
    """Response tokens per lm_head + log-softmax chunk. Logits for backward are
    recomputed per chunk, so no [R, vocab] tensor is kept."""

    context_parallel: bool = False
    """Shard the prompt state over the ranks of the initialized torch.distributed
    process group (every rank calls `step` with the same group). See
    docs/distributed.md."""

    expert_parallel: bool = False
    """Context parallelism with MoE models: each rank keeps only its slice of every MoE
    layer's experts (rank r of W: experts [r E // W, (r+1) E // W)), cut in place when the
    engine is built, so no rank ever holds or gathers a whole MoE layer; each MoE call
    computes the local experts and combines the ranks' partials (replicated tokens: one
    all-reduce; a divided capture or walk: all-gather, then reduce-scatter). Same result
    as the replicated MoE. An expert's gradient is complete on its owner (not summed
    over ranks); build the optimizer after the engine. Needs `context_parallel=True`
    (the engine refuses it otherwise; the trainer sets it itself). See docs/distributed.md."""

    shard_block_size: int | None = None
    """Context parallelism: positions per round-robin block of the sharded state.
    None: `attention_block_size`."""

    divide_capture: bool = defaults.DIVIDE_CAPTURE
    """Context parallelism: compute each prompt token of capture on one rank (the owner
    of its block), layer by layer (dense attention, Gated DeltaNet hybrids and the
    MLA/DSA families; an offloaded state (`state_device="cpu"`) too: each rank writes its
    own rows to host); False replicates capture's token computation on every rank (what
    kept capture graphs always get). Same result either way. See docs/distributed.md."""

    divide_walk: bool = defaults.DIVIDE_WALK
    """Context parallelism, exact mode: recompute and backpropagate each prompt token of
    the reverse walk on one rank (the owner of its block), every family; the walk's
    parameter gradients are then partial per rank and summed once per step (one bucketed
    all-reduce; FSDP2-sharded layers: their own reduce-scatter, set to sum). False
    replicates the walk on every rank (what an offloaded state, kept capture graphs, or
    FSDP2 on a 2-D mesh get). Same result either way (HF's float32 MoE routers round
    differently, as with another chunk_size). See docs/distributed.md."""

    allow_position_overflow: bool = False
    """Allow P + R beyond the model's `max_position_embeddings` (RoPE then
    extrapolates). Off by default: such inputs raise `PositionLimitError`."""

    keep_graph_bytes: int = defaults.KEEP_GRAPH_BYTES
    """Exact mode: bytes of capture-chunk autograd graphs to keep instead of recomputing
    those chunks in the reverse walk (the last chunks that fit; their graphs are
    measured). 0 recomputes every chunk (smallest peak); a budget that holds every
    chunk's graph skips recomputation entirely (fastest). Only the kept graphs count
    against it, not the state or the weights. Applies to a step's own capture; a state
    reused from `generate` is walked by recomputation. See docs/exact.md."""

    keep_attention_outputs: bool | None = defaults.KEEP_ATTENTION_OUTPUTS
    """Exact mode: capture keeps what each attention layer's backward needs from its
    forward, the output [H, Dv] and the log-sum-exp [H] per prompt position (model dtype
    and float32 / float64), so the reverse walk recomputes only norms, projections and the
    MLP and runs attention's backward from what was kept, without a second attention over
    the prompt (`state/kept_outputs.py`). It costs H * (Dv + 1) numbers per position and
    attention layer on the device, freed chunk by chunk as the walk passes. Applies to a
    step's own capture and GQA / MQA attention layers (the fused flash kernel or the
    blockwise one, sliding windows too: `ops/flash.keeps_outputs`); not yet to attention
    sinks, MLA / DSA layers or a divided walk, which recompute attention as before. Same
    result. None (the default): on where it was measured to pay and costs little memory
    (`defaults.keeps_attention_outputs`): the state on the device, no context parallelism,
    torch's fused flash backward for the model's device and dtype (CPU), and the outputs
    at most `defaults.KEPT_OUTPUTS_SHARE` (1) times the state's rows and gradients per
    prompt position; `step` reports the choice as `kept_attention_bytes`. See docs/exact.md."""

    state_device: str | None = None
    """Where the prompt state's per-token rows (K/V, MLA latents, DSA indexer keys and
    exact mode's gradients for them) live. None (or the model's own device): on the
    model's device. "cpu": state offload, in host memory (pinned when CUDA is
    available), staged to the model's device one layer at a time, the next layer's copy
    overlapping the current layer's compute; constant-size state (the latest GDN
    snapshot, a detached sliding window) stays on the device, and exact mode's earlier
    GDN snapshots go to host memory too (`offload_snapshots`). It changes where bytes live and
    how many cross PCIe, never the result. See docs/offload.md."""

    offload_snapshots: bool | None = defaults.OFFLOAD_SNAPSHOTS
    """Exact mode: keep the recurrent layers' snapshots at every capture-chunk boundary
    (GDN, Mamba2, KDA: per layer a state [H, Dk, Dv] in fp32 + a conv tail, which the
    reverse walk restarts each chunk from) in host memory, all but the latest; the walk
    stages one back per chunk and layer. Their gradients are never staged: the walk
    drops each once it has seeded its chunk, so at most two per layer exist. None: when
    the state is offloaded (`state_device="cpu"`). True with the state on the device
    too: the divided walk under context parallelism, which an offloaded state cannot
    run, keeps them on host that way. Changes nothing in the result; `step` reports
    the bytes moved (`snapshot_h2d_bytes`, `snapshot_d2h_bytes`). See docs/offload.md."""

    share_response_prefixes: bool = defaults.SHARE_RESPONSE_PREFIXES
    """Prefix trees: `step` and `score` build the trie of the group's responses below the
    prompt (a segment is shared where two or more responses hold the same tokens and,
    in `step`, the same loss-mask values) and run each shared segment once, on top of
    the prompt state and the segments above it, with exact gradients through it in both
    modes (only the root prompt follows `mode`). Loss and `.grad` are the flat group's.
    False: every response replayed whole (the flat path, kept as the reference). See
    docs/trees.md."""
    recompute_layers: bool | None = defaults.RECOMPUTE_LAYERS
    """Replay: keep only each decoder layer's input per piece and recompute the layer's
    forward in backward (`models/recompute.py`), so a piece's live graph holds one
    layer's activations instead of all of them, for about one more forward per piece.
    None (the default): on only where the memory is plainly worth the time, i.e. where
    one piece's (`branch_chunk_size`, else the response) autograd graph, as the planner
    estimates it for this model's shapes, would exceed `defaults.RECOMPUTE_GRAPH_SHARE`
    (2) times what the step holds anyway on this rank: the weights, the gradients of
    what is trained, the prompt state and (exact mode) its gradients and snapshots
    (`defaults.recompute_pays`; the planner applies the same rule, and exact mode's
    reverse walk decides for its chunks the same way). So no time is traded for memory
    unasked: a budget (`ls.fit_config`, `longstraw plan --fit`) turns it on where the fit
    needs it. Changes nothing in the result; `step` reports the choice as the metrics
    `recompute_layers` and `walk_recompute_layers`. See docs/planner.md."""

    replay_batch: int | None = defaults.REPLAY_BATCH
    """Replay up to this many branches as one batch (`engine/batched.py`): their tokens
    run through the model together (a batch dimension of b; shorter ones padded at the
    end, which a causal model's earlier tokens never see), every branch reading the same
    prompt state (never copied: each attention folds the batch into the query rows of the
    shared prefix, a recurrent layer's snapshot is expanded), each with its own loss, one
    backward for the batch (the state's gradient summed over its branches). 1: one branch
    at a time. A branch replayed in pieces (`branch_chunk_size` < its length) runs on its
    own as before, and so does a prompt with images. Same result; a larger b trades one
    branch's graph for b of them for fewer, larger matmuls. Families whose adapter takes a
    batch (`Adapter.batches_replay`: dense, MoE, windowed, Gated DeltaNet hybrids, MLA /
    DSA); others, and context parallelism, refuse b > 1 when the engine is built. None
    (the default): `defaults.replay_batch_for`: in exact mode, where the branches can
    batch and the reverse walk keeps a whole chunk's graph, b up to `REPLAY_BATCH_MAX` (8)
    whose b x R tokens fit in one walk chunk (a graph the step holds anyway); else 1, so
    the peak stays flat in G. The planner applies the same rule, and `step` reports the
    choice as the metric `replay_batch`. See docs/exact.md."""

    progress: bool = False
    """Show a progress bar over capture chunks and branches (stderr)."""

    def __post_init__(self):
        _positive_int("ExecConfig.chunk_size", self.chunk_size)
        _positive_int("ExecConfig.attention_block_size", self.attention_block_size)
        _positive_int("ExecConfig.branch_chunk_size", self.branch_chunk_size, allow_none=True)
        _positive_int("ExecConfig.shard_block_size", self.shard_block_size, allow_none=True)
        _positive_int("ExecConfig.logits_chunk_size", self.logits_chunk_size)
        _positive_int("ExecConfig.replay_batch", self.replay_batch, allow_none=True)
        if isinstance(self.keep_graph_bytes, bool) or not isinstance(self.keep_graph_bytes, int) \
                or self.keep_graph_bytes < 0:
            raise ConfigError(f"ExecConfig.keep_graph_bytes must be an int >= 0, got {self.keep_graph_bytes!r}")
        if self.keep_attention_outputs is not None and not isinstance(self.keep_attention_outputs, bool):
            raise ConfigError(f"ExecConfig.keep_attention_outputs must be True, False or None (where it pays), got "
                              f"{self.keep_attention_outputs!r}")
        if not isinstance(self.share_response_prefixes, bool):
            raise ConfigError(f"ExecConfig.share_response_prefixes must be True or False, got "
                              f"{self.share_response_prefixes!r}")
        if self.recompute_layers is not None and not isinstance(self.recompute_layers, bool):
            raise ConfigError(f"ExecConfig.recompute_layers must be True, False or None (on where it pays), "
                              f"got {self.recompute_layers!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ConfigError(f"ExecConfig.expert_parallel must be True or False, got {self.expert_parallel!r}")
        if self.offload_snapshots is not None and not isinstance(self.offload_snapshots, bool):
            raise ConfigError(f"ExecConfig.offload_snapshots must be True, False or None (when the state is "
                              f"offloaded), got {self.offload_snapshots!r}")
        if self.mode not in MODES:
            raise ConfigError(f"ExecConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.state_device is not None:
            try:
                ok = isinstance(self.state_device, str) and torch.device(self.state_device) is not None
            except (RuntimeError, TypeError):
                ok = False
            if not ok:
                raise ConfigError(f"ExecConfig.state_device must be None, \"cpu\" (state offload) or the model's "
                                  f"device, got {self.state_device!r}")
            if self.offloads_state() and self.keep_graph_bytes > 0:
                raise ConfigError("ExecConfig.keep_graph_bytes > 0 keeps capture graphs that read the state on the "
                                  "device, which state_device=\"cpu\" does not hold; use keep_graph_bytes=0 or "
                                  "state_device=None")
            if self.offloads_state() and self.keep_attention_outputs:
                raise ConfigError("ExecConfig.keep_attention_outputs keeps per-position attention outputs on the "
                                  "device, which state_device=\"cpu\" is meant to spare; use "
                                  "keep_attention_outputs=False or state_device=None")

    def offloads_snapshots(self) -> bool:
        """Whether exact mode keeps its recurrent snapshots (but the latest) in host memory."""
        return defaults.offloads_snapshots(self.offload_snapshots, self.mode == "exact", self.offloads_state())

    def offloads_state(self) -> bool:
        """Whether the prompt state's per-token rows live in host memory (state offload)."""
        return self.state_device is not None and torch.device(self.state_device).type == "cpu"


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """The GRPO objective, with TRL's field meanings."""

    loss_type: str = "dapo"
    """"dapo": sum over every response token of the batch / their count.
    "grpo": token mean per sequence, then mean over sequences.
    "dr_grpo": sum / (num_sequences * max_completion_length)."""

    epsilon_low: float = 0.2
    """Lower clip: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]."""

    epsilon_high: float = 0.2
    """Upper clip (DAPO's clip-higher uses e.g. 0.28)."""

    beta: float = 0.0
    """Weight of the k3 KL to the reference policy; > 0 needs `group.ref_logprobs`."""

    scale_rewards: str = "group"
    """"group": advantages (r - mean) / (std_unbiased + 1e-4); "none": r - mean."""

    temperature: float = 1.0
    """Logits are divided by this before the log-softmax."""

    max_completion_length: int | None = None
    """Denominator length for "dr_grpo". None: the longest response of the batch."""

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"GRPOConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(
                f"GRPOConfig.scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}"
            )
        for name in ("epsilon_low", "epsilon_high", "beta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"GRPOConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.epsilon_low >= 1:
            raise ConfigError(f"GRPOConfig.epsilon_low must be < 1, got {self.epsilon_low!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"GRPOConfig.temperature must be a finite number > 0, got {t!r}")
        _positive_int("GRPOConfig.max_completion_length", self.max_completion_length, allow_none=True)
