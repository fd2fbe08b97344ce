"""FSDP2 under `LongStrawGRPOTrainer` (`longstraw_fsdp=True`): each decoder layer
`fully_shard`-ed (`parallel.sharding.shard_model`) over the C ranks of its context-parallel group, on a 2-D (dp, cp) device
mesh, before the Trainer creates the optimizer. The contract is in docs/distributed.md.

* The mesh. W ranks as (D = W / C data-parallel replicas) x (C context-parallel shards),
  rank = dp * C + cp (`parallel.mesh`): FSDP2 on that 2-D mesh is HSDP, each layer's
  parameters sharded over the C ranks that run the same sequences (so FSDP2's per-call
  all-gathers and reduce-scatters pair up) and replicated across the D groups.
* The reduction across groups. FSDP2's HSDP would all-reduce every backward call's shards
  across the replicas; the groups run different sequences (different numbers of decode
  steps, branches, skipped groups), so those all-reduces would not pair up. It is turned
  off (`parallel.fsdp.hold_replica_reductions`), the engine moves the held shards into
  `.grad` (`settle_held_reductions`) and the trainer's one bucketed all-reduce per step
  (`parallel.data.reduce_gradients`, TRL's divisor) sums them, as for every replicated
  parameter. Exact mode's divided walk sums its partial gradients through FSDP2's
  reduce-scatter on this mesh too (`fsdp_sum_factor`).
* What stays replicated: the embeddings, final norm and lm_head (LongStraw calls them
  directly, not through the ...ForCausalLM's forward, so the root, wrapped by
  `parallel.sharding.shard_model` for FSDP2's resharding, manages none of them), and
  everything outside the decoder layers.
* C = 1 is refused: sharding over one rank is a no-op, and sharding over the data-parallel
  groups instead cannot pair FSDP2's per-call collectives (above). The one way to make
  them pair, unsharding every layer once per step and reduce-scattering once at its end,
  holds the full parameters and gradients all step: no memory saved over replication but
  the optimizer state's. Use C >= 2, or plain data parallelism without FSDP2.
"""

from __future__ import annotations

import torch
from longstraw.parallel.fsdp import hold_replica_reductions
from longstraw.parallel.launch import device_mesh
from longstraw.parallel.mesh import Mesh
from longstraw.parallel.sharding import decoder_layers, shard_model


def check_fsdp_settings(fsdp, mesh: Mesh, optimizers) -> list[str]:
    """What `longstraw_fsdp` refuses on this mesh, one message each (empty: fine)."""
    if not isinstance(fsdp, bool):
        return [f"longstraw_fsdp must be True or False, got {fsdp!r}"]
    if not fsdp:
        return []
    bad = []
    if mesh.context < 2:
        bad.append(f"longstraw_fsdp=True with longstraw_context_parallel_size={mesh.context}: FSDP2 shards each "
                   "decoder layer over the ranks of one context-parallel group (the ranks that run the same "
                   "sequences, so FSDP2's per-call collectives pair up); over one rank that is a no-op, and over "
                   "the data-parallel groups they would not pair (different sequences, different numbers of calls). "
                   "Set longstraw_context_parallel_size >= 2, or longstraw_fsdp=False (docs/distributed.md)")
    if optimizers is not None and optimizers[0] is not None:
        bad.append("longstraw_fsdp=True with optimizers=(optimizer, ...): an optimizer made before the layers are "
                   "sharded holds their unsharded parameters; let the Trainer create it (optim=..., or "
                   "optimizer_cls_and_kwargs=...)")
    return bad


def shard_decoder_layers(model, mesh: Mesh, device: torch.device) -> list:
    """FSDP2 over the 2-D (dp, cp) device mesh of `mesh` (HSDP: each decoder layer sharded
    over the cp ranks, replicated over dp; `parallel.sharding.shard_model`: resharded after
    each forward, the ...ForCausalLM the root over no parameter), the all-reduce across
    replicas held for LongStraw's one sum per step (`hold_replica_reductions`). The mesh's
    groups wait `LONGSTRAW_COLLECTIVE_TIMEOUT` (`parallel.launch.device_mesh`), not torch's
    default. Every rank must call it, before the optimizer is made. Returns the sharded layers."""
    fsdp_mesh = device_mesh(device.type, (mesh.data, mesh.context), ("dp", "cp"))
    layers = shard_model(model, fsdp_mesh)
    hold_replica_reductions(layers)
    return layers


def without_ddp(accelerator) -> None:
    """Make `accelerator.prepare` place the model without wrapping it in DDP, as transformers
    does for a model it sharded at load time (`prepare_model(..., evaluation_mode=True)`):
    DDP refuses DTensor parameters (or, on CPU, would broadcast rank 0's shards over every
    rank's), and LongStraw reduces the gradients itself (it never runs a forward through
    DDP anyway)."""
    prepare_model = accelerator.prepare_model

    def prepare_model_without_ddp(model, device_placement=None, evaluation_mode=False):
        return prepare_model(model, device_placement=False, evaluation_mode=True)

    accelerator.prepare_model = prepare_model_without_ddp


__all__ = ["check_fsdp_settings", "decoder_layers", "shard_decoder_layers", "without_ddp"]
