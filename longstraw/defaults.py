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

REPLAY_BATCH = None
"""Branches replayed together as one batch (1: one at a time). None: as many as fit
under a graph the step holds anyway (`replay_batch_for`)."""

REPLAY_BATCH_MAX = 8
"""`replay_batch=None` batches at most this many branches."""


def replay_batch_for(setting: int | None, *, group: int, batches: bool, response_tokens: int,
                     free_tokens: int) -> int:
    """Branches of a group replayed together as one batch: the engine's and the planner's one
    rule (`ExecConfig.replay_batch`; kept here, torch-free, beside its constant).

    `setting` is `replay_batch`: as given (at most G). None: 1 where the branches cannot
    batch (`batches` False: a family whose mixers take no batch, context parallelism, a
    prefix tree, prompt images, or branches replayed in pieces); else the largest b <=
    min(G, REPLAY_BATCH_MAX) whose b x `response_tokens` tokens fit in `free_tokens`,
    the tokens whose autograd graph the step holds anyway at another moment: exact mode's
    reverse-walk chunk (min(chunk_size, P - 1)) where the walk keeps a whole chunk's graph
    (no layer recompute), 0 in detached mode. So the default batch moves the planned peak
    by about 1% at most (docs/exact.md), and the peak stays flat in G; a batch runs fewer,
    larger matmuls and less Python per branch (measured: bench/results/replay_batch_*.csv).
    More, where memory is left over: `fit_config` searches b against the budget."""
    if setting is not None:
        return max(1, min(int(setting), group))
    if not batches or group < 2:
        return 1
    return max(1, min(group, REPLAY_BATCH_MAX, free_tokens // max(int(response_tokens), 1)))


ATTENTION_BLOCK_SIZE = 1024
"""Prompt positions per block of the blockwise attention over the captured state."""

GRADIENT_BUCKET_BYTES = 32 << 20
"""The gradients' collectives (context- and data-parallel) flatten up to this many bytes at
a time (`parallel.collectives.in_buckets`; the planner's 'gradients' phase)."""

FLASH_BACKWARD_BLOCK = 8192
"""Prompt positions per call of the fused attention backward (`ops.flash.FlashAttention`):
each call holds the block's K and V copies and their dK, dV (the planner counts them)."""

DIVIDED_QUERY_ROWS = 4096
"""A divided capture's own query rows attended over one fetched piece of another rank's keys
in one fused call (`parallel.attention.divided_causal_attention`): the blocks that see the
whole piece go together, up to this many rows (fewer, larger kernel calls). Their partial
output and its merge (4 x rows x heads x head_dim in float32) are the planner's divided
capture transient (`plan/divided_capture.py`)."""

DIVIDED_SPARSE_ENTRIES = 1 << 18
DIVIDED_SPARSE_QUERIES = 1024
"""A divided capture's DSA attention over one fetched piece (`parallel.divided_dsa`): the
queries that selected rows of the piece go in blocks of at most DIVIDED_SPARSE_QUERIES
queries and DIVIDED_SPARSE_ENTRIES selected rows (the gathered rows, their scores and the
block's partial output are the planner's transient: `plan/divided_capture.py`)."""

SELECT_QUERY_BLOCK = 128
SELECT_BLOCK_ELEMENTS = 1 << 26
SELECT_MAX_QUERY_BLOCK = 1024
"""Context parallelism's DSA selection across ranks (`models/mla._select_across_ranks`)
scores queries in blocks, each block's shard top-k agreed by radix rounds (collectives):
`select_query_block`."""


def select_query_block(keys: int) -> int:
    """Queries a block of the selection across context ranks scores at once, over `keys`
    positions (the rank's shard plus the replicated ones): the largest power-of-two
    multiple of SELECT_QUERY_BLOCK, at most SELECT_MAX_QUERY_BLOCK, whose [block, keys]
    score block holds at most SELECT_BLOCK_ELEMENTS values (what 128 queries over 524,288
    keys hold), never below SELECT_QUERY_BLOCK. Fewer keys a rank, fewer blocks: fewer
    loop turns, shard top-ks and radix collectives. GLM-5.2 on 32 ranks at P = 2,088,960 (73,472 keys a block): 512."""
    block = SELECT_QUERY_BLOCK
    while block * 2 <= SELECT_MAX_QUERY_BLOCK and block * 2 * max(keys, 1) <= SELECT_BLOCK_ELEMENTS:
        block *= 2
    return block


LOGITS_CHUNK_SIZE = 1024
"""Response tokens per lm_head + log-softmax chunk."""

DIVIDE_CAPTURE = True
DIVIDE_WALK = True
"""Context parallelism: compute each prompt token of capture / of the reverse walk on one rank."""

KEEP_GRAPH_BYTES = 0
"""Exact mode: bytes of capture-chunk graphs kept instead of recomputed (0: recompute every chunk)."""

KEEP_ATTENTION_OUTPUTS = None
"""Exact mode: capture keeps each attention layer's output and log-sum-exp, so the reverse
walk runs attention's backward without a second forward over the prompt. None: where
it pays and costs little memory (`keeps_attention_outputs`)."""

KEPT_OUTPUTS_SHARE = 1.0
"""`keep_attention_outputs=None` keeps the outputs exactly when they take at most this many
times the bytes per prompt position that exact mode holds anyway for the state (its rows
and their gradients): at most doubling what the prompt costs per position. GQA with g
query heads per kv head keeps about g / 4 of that (Qwen3's g = 2 to 8: 0.5 to 2)."""


def keeps_attention_outputs(setting: bool | None, *, exact: bool, offload_state: bool, parallel: bool,
                            fused_backward: bool, output_bytes: float, state_bytes: float) -> bool:
    """Whether exact mode's capture keeps the attention outputs for the reverse walk: the
    engine's and the planner's one rule (kept here, torch-free, beside its constant).

    `setting` is `keep_attention_outputs`: True / False as given (in exact mode). None: on
    exactly when the state is on the device (`offload_state` False), the walk is not
    divided over ranks (`parallel` False: context parallelism, whose divided walk attends
    again), the fused flash backward kernel runs attention's backward (`fused_backward`:
    torch's CPU kernel, where the kept walk was measured faster; the planner plans GPUs,
    whose backward is the blockwise one, so it passes False), and the outputs' bytes per
    prompt position (`output_bytes`) are at most `KEPT_OUTPUTS_SHARE` times the state's
    rows and gradients per position (`state_bytes`). The price is that memory; the gain is
    one attention forward over the whole prompt in the walk."""
    if not exact:
        return False
    if setting is not None:
        return bool(setting)
    return (not offload_state and not parallel and fused_backward and output_bytes > 0
            and output_bytes <= KEPT_OUTPUTS_SHARE * state_bytes)

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


RECOMPUTE_GRAPH_SHARE = 2.0
"""`recompute_layers=None` recomputes the layers of a replay piece (or an exact-mode walk
chunk) exactly when its autograd graph would exceed this many times what the step holds
anyway: the weights, their gradients, the prompt state and (exact mode) its gradients
and snapshots. Below that the graph at most triples the step's memory, and recompute
would spend about a third more replay compute on memory that nobody asked to save; above
it recompute cuts the peak by two thirds or more. A memory budget (`fit_config`,
`longstraw plan --fit`) turns recompute on wherever the fit needs it instead."""


def recompute_pays(setting: bool | None, graph_bytes: float, held_bytes: float, layers: int) -> bool:
    """Whether a replay piece (or walk chunk) whose autograd graph would hold `graph_bytes`
    recomputes each decoder layer in backward: the engine's and the planner's one rule
    (kept here, torch-free, beside its constant).

    `setting` is `recompute_layers`: True / False as given. None: on when the model has
    2+ decoder layers and `graph_bytes > RECOMPUTE_GRAPH_SHARE * held_bytes`, where
    `held_bytes` is what the step holds anyway on this rank (weights, gradients, prompt
    state, exact mode's state gradients and snapshots). The price of recompute is one
    more forward of the piece's layers (about a third more replay compute); the gain is
    the graph of all but one layer."""
    if setting is not None:
        return bool(setting)
    return layers >= 2 and graph_bytes > RECOMPUTE_GRAPH_SHARE * held_bytes
