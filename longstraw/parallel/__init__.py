"""Context parallelism (`ExecConfig(context_parallel=True)`): one prompt divided over the W
ranks of a `torch.distributed` group (gloo on CPU, NCCL on GPU). This docstring is the
design; each module says what it does and points here (users' guide: docs/distributed.md).

Modules:
    deal.py         the round-robin deal of positions over ranks (torch-free; the state,
                    ops, models and planner all use it)
    context.py      the process group (`ContextParallel`), cross-rank validation, replica checks
    collectives.py  collectives on the backend's device, and the autograd Functions on them
    attention.py    the divided capture's attention, MLA and DSA ops over every rank's shard
    divided.py      the divided capture driver and the divided reverse walk's chunks
    gradients.py    partial gradients summed over ranks; replicated gradients made the first rank's
    fsdp.py         FSDP2's reduce-scatter set to sum a divided walk's partials, a layer gathered
                    when backward reads its weights early (its private internals)
    sharding.py     `shard_model`: the one FSDP2 wrapping (layers resharded after forward, a root)
    experts.py      expert parallelism: each rank its slice of the MoE experts, the combines
                    (replicated tokens: all-reduce; divided: all-gather + reduce-scatter)

The deal. Prompt positions are cut into blocks of B (`shard_block_size`), block b on rank
b % W, so causal work is balanced (`deal.Deal`). The per-token prompt state (attention
K/V, MLA latent rows, DSA indexer keys) is sharded by it (`state.Shard`); small state (GDN
recurrent state and conv tail) is replicated. Every rank runs the same group
(`Engine.step` with the same `Group` on every rank; `context.check_same_group`).

Divided capture (`divided.divided_capture`). Capture's usual order, chunk by chunk through
all layers, needs every earlier chunk's state in every layer: dividing it would need a
wavefront pipeline. It runs layer by layer instead, each rank over its own positions (the
state's deal, so the rows a rank computes are the rows it keeps); between layers a rank
keeps its shard of the hidden states, [N, d], N ~ P/W:

    projections, norms, MLP/MoE   on the rank's own N tokens (MLP in pieces of chunk_size),
                                  no communication
    attention                     own K/V into the shard; queries attend over every rank's
                                  rows, fetched piece by piece (broadcast, `attention.py`):
                                  (W-1)/W * P * Hkv * (D + Dv) values received per layer
    MLA                           own latent rows into the shard; fetched the same way:
                                  (W-1)/W * P * (R + Dr) values per layer
    DSA indexer                   own indexer keys into the shard; the global top-k of own
                                  queries over every rank's keys, fetched piece by piece
                                  ((W-1)/W * P * Di values); the sparse attention over the
                                  selected rows merges each piece's partial
    Gated DeltaNet                per own segment an affine transition of the state, a relay
                                  carries it across ranks, then each rank finishes its
                                  outputs; the conv's K-1 tail comes from the previous
                                  block's owner; the snapshots are summed from their owners

Replay (and decode) run their token computation on every rank; only attention over the
prompt state is distributed:

    forward    each rank attends over its own shard -> partial (o_r, lse_r); merged by
               log-sum-exp across ranks -> the same (o, lse) everywhere (`MergeAcrossRanks`)
    backward   each rank turns the (replicated) upstream gradient into its partial's
               gradient (no communication), runs its shard's blockwise backward, and the
               query gradient is summed over ranks (`SumGradAcrossRanks`)

Divided reverse walk (exact mode; `divided.divided_chunks`). Chunk by chunk, last to first
(whole cycles of the deal, or for hybrids the fewest capture chunks that hold a cycle, since
GDN layers restart from the snapshots at capture-chunk starts), each rank recomputes its own
positions of the chunk through every layer with autograd and backpropagates them. Attention
gathers the chunk's q/k/v rows of every rank, runs the part over earlier chunks against the
sharded state and its own causal part for this rank's query rows only (`own_rows`), and
keeps this rank's output rows; a GDN layer gathers the chunk's projected rows and runs the
conv and recurrence over the whole chunk on every rank; an MLA layer gathers the chunk's
absorbed queries and latent rows (and the indexer's inputs) (each family's module: `models/attention.py`, `gated_deltanet.py`, `mla.py`). Each rank
seeds its own K/V (latent) rows with the gradients its shard accumulated; a replicated
walk instead sums each chunk's seeds over ranks before pushing them through.

Gradients (`gradients.py`, `fsdp.py`). Replay's gradients are complete on every rank (all
outside the prompt attention is replicated with replicated gradients, LoRA and K/V
projections included). A divided walk's are partial: one bucketed all-reduce per step sums
them (`partial_gradients`), or, for FSDP2-sharded layers, FSDP2's own reduce-scatter, set to
sum for the walk (`fsdp_sums_partials`); on a 2-D (HSDP) mesh FSDP2's all-reduce across
replicas is held (`hold_replica_reductions`: the data-parallel groups' calls would not pair)
and what it holds is settled into `.grad` after each step's backward
(`settle_held_reductions`), for one sum per optimizer step across groups. Replicated is bitwise only where backward is
deterministic (on CUDA `index_add_` with repeated indices is not), so a step without a
divided walk ends with one bucketed broadcast of the first rank's gradients
(`replicate_gradients`), and `context.check_replicas` compares the ranks' weights exactly.

Expert parallelism (`ExecConfig(expert_parallel=True)`, `experts.py`): rank r keeps experts
[r E // W, (r+1) E // W) of each MoE layer for good; an MoE call computes only those and
sums the ranks' partials. Expert gradients are complete on their owner and are left out of
both sums above (`experts.is_expert_shard`).

Images in the prompt (Qwen3.5 VLMs, `models/vision.py`; docs/vision.md): the image rows
and M-RoPE ids stay whole on every rank and are looked up by sequence index, so the
divided phases read their own positions' rows and ids. The tower runs whole images dealt
over the ranks (`deal_images`), its rows summed from zeroed tables; a divided walk's
partial image-row gradient is all-reduced, each rank pushes its own images through the
tower, and the tower's partial parameter gradients join the walk's one sum.

What stays replicated: replay of the branches (R-sized), a walk over kept capture graphs
(`keep_graph_bytes`), an offloaded state, FSDP2 on a 2-D mesh whose replica all-reduce is not held
(`fsdp_sum_factor`), captures
that keep chunk graphs or of an offloaded state, and rollouts' decode.

Collectives run on the device the group's backend carries (`ContextParallel.device`: the
current CUDA device for NCCL, so call `torch.cuda.set_device(local_rank)` before building
the engine; CPU for gloo); `collectives.py` moves tensors there and back.

What this buys: each rank holds ~1/W of the prompt state and does ~1/W of the attention
work over it and of capture's and the reverse walk's token computation; replay's token
computation is not divided.
"""
