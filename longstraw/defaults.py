"""The execution defaults that the engine's `ExecConfig` and the planner's `PlanConfig`
share: one source of truth, plain constants, torch-free (the planner imports it without
torch). `tests/test_plan.py` checks that both dataclasses take their defaults from here.
"""

MODES = ("detached", "exact")
"""What `mode` may be: "detached" (the prompt state is a constant) or "exact"."""

MODE = "detached"
CHUNK_SIZE = 4096
"""Prompt tokens per capture chunk."""

BRANCH_CHUNK_SIZE = None
"""Replay each branch in pieces of this many tokens; None: one piece."""

ATTENTION_BLOCK_SIZE = 1024
"""Prompt positions per block of the blockwise attention over the captured state."""

LOGITS_CHUNK_SIZE = 1024
"""Response tokens per lm_head + log-softmax chunk."""

DIVIDE_CAPTURE = True
DIVIDE_WALK = True
"""Context parallelism: compute each prompt token of capture / of the reverse walk on one rank."""

KEEP_GRAPH_BYTES = 0
"""Exact mode: bytes of capture-chunk graphs kept instead of recomputed (0: recompute every chunk)."""

SHARE_RESPONSE_PREFIXES = True
"""Compute the response tokens that several responses of a group share once (prefix trees)."""

RECOMPUTE_LAYERS = None
"""Replay: recompute each decoder layer in backward; None: where it pays (`recompute_pays`)."""

OFFLOAD_SNAPSHOTS = None
"""Exact mode: the recurrent layers' per-chunk snapshots in host memory (True), on the
device (False), or in host memory exactly when the state is offloaded (None)."""


def offloads_snapshots(setting: bool | None, exact: bool, offload_state: bool) -> bool:
    """Whether exact mode keeps its recurrent snapshots (but the latest) in host memory:
    the engine's and the planner's one rule. `setting` is `offload_snapshots`."""
    return exact and (offload_state if setting is None else bool(setting))


RECOMPUTE_MIN_TOKENS = 1024
"""`recompute_layers=None` recomputes the layers of replay pieces of at least this many tokens."""


def recompute_pays(setting: bool | None, piece_tokens: int, layers: int) -> bool:
    """Whether replay pieces of `piece_tokens` tokens recompute each decoder layer in
    backward (the engine's and the planner's one rule; kept here, torch-free, beside
    its constants).

    `setting` is `recompute_layers`: True / False as given; None: on when the model has
    2+ decoder layers and a piece holds at least `RECOMPUTE_MIN_TOKENS` tokens. The price
    is one more forward of the piece's layers (about a third more replay compute); the
    gain is the graph of all but one layer (of the order of tokens x layers x 10 x hidden
    bytes), which at a thousand tokens and more is what sets a replay's peak."""
    if setting is not None:
        return bool(setting)
    return layers >= 2 and piece_tokens >= RECOMPUTE_MIN_TOKENS
