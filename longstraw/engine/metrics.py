"""The one schema of `Engine.step`'s metrics (`StepResult.metrics`): every key, in the
order it is reported, with its default. The zero-advantage early return and the full
update fill the same dataclass; a field left None is not reported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class StepMetrics:
    """What one `Engine.step` reports (floats; `.as_dict()` is `StepResult.metrics`)."""

    context_parallel_world: float = 1.0
    """Ranks the prompt is divided over (1 without context parallelism)."""
    divided_capture: float = 0.0
    """1 when this step's capture ran divided over the ranks."""
    prompt_tokens: float = 0.0
    response_tokens: float = 0.0
    """Loss tokens: the response tokens that `Group.loss_masks` keep (all without masks)."""
    num_branches: float = 0.0
    replay_tokens: float = 0.0
    """Response tokens replay ran through the model: each token of a shared segment once
    (prefix trees, `ExecConfig.share_response_prefixes`); every response token flat."""
    shared_segments: float = 0.0
    """Segments of the response trie held by two or more responses (0 flat)."""
    reward_mean: float | None = 0.0
    """None (not reported) when the group gives only `advantages`."""
    reward_std: float | None = 0.0
    advantage_mean: float = 0.0
    advantage_std: float = 0.0
    advantage_min: float = 0.0
    advantage_max: float = 0.0
    skipped_zero_advantage: float = 0.0
    """1 when every advantage is 0 and beta is 0: the loss and its gradient are exactly 0."""
    skipped_no_loss_tokens: float = 0.0
    """1 when every loss mask of the group is all False: nothing to learn, loss 0, no work."""
    recompute_layers: float = 0.0
    """1 when replay recomputed each decoder layer in backward (`ExecConfig.recompute_layers`;
    decided for the group's longest piece)."""
    replay_batch: float = 1.0
    """Branches replayed as one batch (`ExecConfig.replay_batch`; None: the rule's choice)."""
    offload_h2d_bytes: float | None = None
    """State offload only: bytes staged host -> device since the capture (or the last step)."""
    offload_d2h_bytes: float | None = None
    offload_slot_bytes: float | None = None
    snapshot_h2d_bytes: float | None = None
    """Exact mode with `ExecConfig.offload_snapshots`: recurrent snapshot bytes staged
    host -> device (the walk's chunk starts) since the capture (or the last step)."""
    snapshot_d2h_bytes: float | None = None
    """... and moved device -> host (capture's snapshots, all but the latest)."""
    divided_walk: float = 0.0
    """1 when exact mode's reverse walk ran divided over the ranks."""
    walk_recompute_layers: float = 0.0
    """1 when exact mode's reverse walk recomputed each decoder layer in backward
    (`ExecConfig.recompute_layers`, decided for one walk chunk: `Engine.walk_recomputes_layers`)."""
    kept_graph_chunks: float = 0.0
    """Exact mode: capture chunks whose autograd graph capture kept (`ExecConfig.keep_graph_bytes`),
    which the reverse walk backpropagated through without recomputing them."""
    kept_attention_bytes: float = 0.0
    """Exact mode with `ExecConfig.keep_attention_outputs`: bytes of the attention outputs and
    LSEs capture kept for the reverse walk (`state/kept_outputs.py`), freed chunk by chunk."""
    state_bytes: float = 0.0
    state_grad_bytes: float = 0.0
    """What the step held in state gradients after its walk (released on return): the
    per-token rows'; each recurrent snapshot's gradient was dropped once the walk had
    seeded its chunk with it."""
    time_capture_s: float = 0.0
    time_replay_s: float = 0.0
    time_reverse_s: float = 0.0
    time_total_s: float = 0.0
    comm_bytes_capture: float = 0.0
    """Bytes this rank received through the context-parallel collectives, by phase
    (`parallel.collectives.Traffic`'s model; 0 in one process)."""
    comm_bytes_replay: float = 0.0
    comm_bytes_reverse: float = 0.0
    comm_bytes_gradients: float = 0.0
    """Replicated gradients made the first rank's."""
    ratio_mean: float | None = None
    """Mean importance ratio over every response token (None: the step was skipped)."""
    clip_fraction: float | None = None
    kl_mean: float | None = None
    """Mean k3 KL to the reference (beta > 0 only)."""

    def as_dict(self) -> dict[str, float]:
        """The reported metrics: every field that is not None, in declaration order."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}
