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
