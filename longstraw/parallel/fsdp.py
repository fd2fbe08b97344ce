"""The FSDP2 shim of a divided reverse walk: FSDP2's reduce-scatter, set to sum the ranks'
partial gradients for the walk only. Every access to FSDP2's private internals
(`_get_fsdp_state`, `_fsdp_param_groups` and the groups' reduction knobs) is in this
module; `_fsdp_groups` returns None where a torch lays them out differently, and the walk
then runs replicated. The design: `longstraw.parallel`.

A 2-D (HSDP) mesh, (data-parallel replicate, context-parallel shard): FSDP2 would
all-reduce every backward call's shards across the replicas, but the data-parallel groups
run different sequences (different numbers of calls), so those collectives would not pair
up. `hold_replica_reductions` turns that all-reduce off (`set_requires_all_reduce(False)`);
FSDP2 then holds each call's reduce-scattered shard in the parameter group instead of the
gradient, and `settle_held_reductions` moves what it holds into the sharded `.grad` (as
FSDP2's own reduction would after its all-reduce, without it). The one sum across replicas
per optimizer step is LongStraw's (`parallel.data.reduce_gradients`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from longstraw.errors import ConfigError, DistributedError

try:  # FSDP2's own choice of pre- and post-division, which `settle_held_reductions` finishes
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
except ImportError:  # pragma: no cover - a torch laid out differently: a 2-D mesh's walk runs replicated
    _get_gradient_divide_factors = None

from longstraw.parallel.gradients import partial_gradients, replicated_parameters


def _fsdp_groups(module):
    """An FSDP2 module's parameter groups (torch's private `FSDPParamGroup`s), or None
    when this torch lays them out differently."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    groups = getattr(state, "_fsdp_param_groups", None)
    knobs = ("gradient_divide_factor", "force_sum_reduction_for_comms", "reduce_scatter_unused_params", "mesh_info")
    if groups is None or not all(hasattr(g, k) for g in groups for k in knobs):
        return None
    return groups


def manages_no_parameter(module) -> bool:
    """Whether `module` is an FSDP2 unit with no parameter group of its own (the root of
    `parallel.sharding.shard_model`, over replicated embeddings, norm and lm_head)."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    return state is not None and not getattr(state, "_fsdp_param_groups", [None])


def initialize_root(root) -> None:
    """FSDP2's lazy initialization of `root` (an FSDP2 unit), as its first forward would
    run it: the units below become non-roots sharing its state (so they reshard after
    forward and share one post-backward callback). LongStraw never runs the root's
    forward, so without this the first layer to run would make itself a root."""
    state = root._get_fsdp_state()
    if getattr(state, "_is_root", None) is None:
        state._lazy_init()


def _storage_key(tensor) -> int | None:
    """The tensor's StorageImpl (FSDP2 frees and refills a parameter's in place); None for
    a tensor without one (a subclass, sparse)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


class _Gathered:
    """A saved tensor that is (a view of) an FSDP2 unsharded parameter, and its module."""

    __slots__ = ("tensor", "module")

    def __init__(self, tensor, module):
        self.tensor, self.module = tensor, module


@contextlib.contextmanager
def gathered_when_read(modules):
    """Within the block (a forward with autograd), every tensor autograd saves that is
    (a view of) an unsharded FSDP2 parameter of `modules` is marked, and backward gathers
    that module's weights (`FSDPModule.unshard`, a no-op when they are gathered) before it
    reads one. FSDP2 reshards a layer after its forward and gathers it again in its
    pre-backward hook, which fires when the gradient reaches the layer's output; exact
    mode's reverse walk seeds each layer's own state rows, so backward can enter a layer
    (the last one: only so) before that hook fires, and would read freed weights. The
    layer's post-backward hook (at its inputs) reshards it as usual. A no-op without
    FSDP2 modules."""
    owners = {}
    for module in modules:
        for group in _fsdp_groups(module) or ():
            for param in getattr(group, "fsdp_params", ()):
                full = getattr(param, "_unsharded_param", None)
                if full is not None:
                    owners[_storage_key(full)] = module
    if not owners:
        yield
        return

    def pack(tensor):  # detached: an op that saves its own output would else hold it, and the output's
        # grad_fn the saved copy, a cycle through the C++ graph that is never freed (engine/kept_graphs.py)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        module = owners.get(_storage_key(tensor))
        return tensor.detach() if module is None else _Gathered(tensor.detach(), module)

    def unpack(saved):
        if isinstance(saved, _Gathered):
            saved.module.unshard()
            return saved.tensor
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def gather_for_recompute(module) -> None:
    """Gather an FSDP2 module's weights before a layer-wise recompute runs its forward
    inside backward (`models/recompute.py`): the recompute calls the layer's own forward,
    not its hooks, and backward can reach it before FSDP2's pre-backward hook (see
    `gathered_when_read`). A no-op for other modules or gathered ones."""
    if _fsdp_groups(module):
        module.unshard()


def fsdp_sharded_parameters(model) -> dict:
    """id(parameter) -> its FSDP2 sharded DTensor, for every parameter FSDP2 manages in
    `model`: the sharded parameter itself and, once made, the full tensor FSDP2 registers
    in its place while the module is unsharded (between a forward and the reshard). Empty
    without FSDP2 (or where a torch lays its internals out differently)."""
    out = {}
    for module in model.modules():
        for group in _fsdp_groups(module) or ():
            for param in getattr(group, "fsdp_params", ()):
                sharded = getattr(param, "sharded_param", None)
                if sharded is None:
                    continue
                out[id(sharded)] = sharded
                full = getattr(param, "_unsharded_param", None)
                if full is not None:
                    out[id(full)] = sharded
    return out


def shard_world(model) -> int | None:
    """The ranks FSDP2 shards `model`'s parameters over: the size of the mesh dimensions its
    sharded DTensors are `Shard`-placed on (W on a 1-D mesh; on a 2-D (replicate, shard)
    HSDP mesh, the shard dimension's C). None without FSDP2. `ConfigError` where two units
    shard over different numbers of ranks (`parallel.sharding.shard_model` never does)."""
    worlds = set()
    for sharded in fsdp_sharded_parameters(model).values():
        mesh, placements = sharded.device_mesh, sharded.placements
        worlds.add(math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_shard()))
    if len(worlds) > 1:
        raise ConfigError(f"the model's FSDP2 units shard over different numbers of ranks {sorted(worlds)}; "
                               "shard every decoder layer over one mesh (parallel.sharding.shard_model)")
    return worlds.pop() if worlds else None


def _holds_replica_reduction(group) -> bool:
    """Whether an FSDP2 parameter group on a 2-D mesh keeps its reduce-scattered shards for
    `settle_held_reductions` (all-reduce across replicas off, on a torch whose FSDP2 holds
    them where this module reads them)."""
    return (_get_gradient_divide_factors is not None and getattr(group, "all_reduce_grads", True) is False
            and hasattr(group, "_partial_reduce_output"))


def fsdp_sum_factor(modules, cp) -> float | None:
    """The divide factor with which FSDP2's reduce-scatter turns a divided walk's partial
    gradients into the right shard: its group's size / W (1: a plain sum when FSDP2 shards
    over the context-parallel ranks themselves; with more ranks, their data-parallel
    average of the per-group sums). A 2-D (HSDP) mesh is accepted when its all-reduce
    across replicas is held (`hold_replica_reductions`): the factor is then its shard
    group's. None when the walk cannot run divided under these modules: a 2-D mesh whose
    FSDP2 all-reduces every call, groups of different sizes, a context-parallel rank
    outside the FSDP2 shard group, or a torch whose FSDP2 internals are laid out
    differently."""
    cp_ranks = set(dist.get_process_group_ranks(cp.group if cp.group is not None else dist.group.WORLD))
    sizes = set()
    for module in modules:
        groups = _fsdp_groups(module)
        if groups is None:
            return None
        for g in groups:
            mesh = g.mesh_info
            if not hasattr(mesh, "shard_process_group"):
                return None
            if getattr(mesh, "replicate_process_group", None) is not None and not _holds_replica_reduction(g):
                return None
            ranks = set(dist.get_process_group_ranks(mesh.shard_process_group))
            if not cp_ranks <= ranks:
                return None
            sizes.add(len(ranks))
    if len(sizes) != 1:
        return None
    return sizes.pop() / cp.world


@contextlib.contextmanager
def fsdp_sums_partials(modules, factor: float):
    """Within the block (a divided walk), FSDP2's reduce-scatter of each module's
    gradients sums the ranks' partial gradients instead of averaging replicated ones:
    divide factor `factor` (`fsdp_sum_factor`), the sum reduction forced (gloo has no
    pre-multiplied sum), and unused parameters reduce-scattered as zeros (a safeguard: a
    parameter that none of this rank's tokens of a chunk reached, say a per-expert module
    of an MoE, would have no gradient here but one on another rank, and every rank must
    send the same layout; HF's fused experts are one parameter, always reached). Each
    module's previous settings are restored on exit."""
    saved = [(g, g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params)
             for m in modules for g in _fsdp_groups(m)]
    settle_held_reductions(modules)  # what replay left held was divided by replay's factor, not the walk's
    for g, *_ in saved:
        g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params = factor, True, True
    try:
        yield
        settle_held_reductions(modules)  # under the walk's factor
    finally:
        for g, factor0, force0, unused0 in saved:
            g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params = (
                factor0, force0, unused0)


@contextlib.contextmanager
def summed_walk_gradients(model, cp, fsdp_modules):
    """A divided walk's parameter gradients, each summed over ranks once: FSDP2-sharded
    parameters (`fsdp_modules`, which `fsdp_sum_factor` must accept) by FSDP2's own
    reduce-scatter (`fsdp_sums_partials`, as each chunk's backward ends), every other
    (replicated) parameter by `partial_gradients`' one bucketed all-reduce after the walk."""
    replicated = replicated_parameters(model)
    fsdp = fsdp_sums_partials(fsdp_modules, fsdp_sum_factor(fsdp_modules, cp)) if fsdp_modules else None
    with fsdp or contextlib.nullcontext(), partial_gradients(replicated, cp):
        yield


# ----------------------------------------------------------------------------
# a 2-D (HSDP) mesh: the all-reduce across replicas held, summed once per step by LongStraw


def hold_replica_reductions(modules) -> None:
    """Set FSDP2 modules on a 2-D (replicate, shard) mesh for LongStraw's one gradient sum
    across replicas per optimizer step: FSDP2's per-call all-reduce across replicas off
    (`set_requires_all_reduce(False)`), replicated gradients averaged over the shard group
    only (divide factor = its size; FSDP2's default divides by replicas x shards), and
    unused parameters reduce-scattered as zeros (every call then holds the same layout).

    Raises:
        DistributedError: a module is not FSDP2 on a 2-D mesh, or this torch's FSDP2 does
            not hold the reductions where `settle_held_reductions` reads them.
    """
    for module in modules:
        groups = _fsdp_groups(module)
        if not groups or any(getattr(g.mesh_info, "replicate_process_group", None) is None for g in groups):
            raise DistributedError(f"{type(module).__name__} is not FSDP2-sharded on a 2-D (replicate, shard) mesh; "
                                   "hold_replica_reductions is for fully_shard(module, mesh=<2-D DeviceMesh>)")
        module.set_requires_all_reduce(False, recurse=False)
        module.set_gradient_divide_factor(float(groups[0].mesh_info.shard_process_group.size()))
        module.set_reduce_scatter_unused_params(True, recurse=False)
        if not all(_holds_replica_reduction(g) for g in groups):
            raise DistributedError("this torch's FSDP2 does not hold HSDP reductions as LongStraw expects "
                                   "(FSDPParamGroup._partial_reduce_output); shard over a 1-D mesh instead")


def settle_held_reductions(modules) -> None:
    """Move what FSDP2 holds of each backward call's reduce-scattered shards (a 2-D mesh with
    `hold_replica_reductions`) into the parameters' sharded `.grad` (added to what is
    there), divided as FSDP2's own reduction would after its all-reduce; a no-op for
    modules that hold nothing. No communication."""
    for module in modules:
        for g in _fsdp_groups(module) or ():
            held = getattr(g, "_partial_reduce_output", None)
            if held is None:
                continue
            g._partial_reduce_output = None
            _, post, _, _ = _get_gradient_divide_factors(
                g._reduce_scatter_process_group, g._all_reduce_process_group, held.dtype, held.device.type,
                g.gradient_divide_factor, g.force_sum_reduction_for_comms)
            flat = held.reshape(-1) / (post or 1.0)  # (sum of padded shard sizes,)
            params = [p for p in g.fsdp_params if p.sharded_param.requires_grad]  # the layout every call holds
            if flat.numel() != sum(p.padded_sharded_param_size.numel() for p in params):
                raise DistributedError(f"FSDP2 held {flat.numel()} gradient elements for {len(params)} trainable "
                                       "parameters of another size; a backward call reduced a different set of "
                                       "parameters (set_reduce_scatter_unused_params(True), hold_replica_reductions)")
            offset = 0
            for p in params:
                grad = flat[offset: offset + p.sharded_size.numel()].view(p.sharded_size).to(p.sharded_param.dtype)
                if p.sharded_param.grad is None:
                    p.sharded_param.grad = p.to_sharded_dtensor(grad)
                else:
                    p.sharded_param.grad._local_tensor += grad
                offset += p.padded_sharded_param_size.numel()
