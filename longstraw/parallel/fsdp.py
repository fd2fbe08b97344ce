"""The FSDP2 shim of a divided reverse walk: FSDP2's reduce-scatter, set to sum the ranks'
partial gradients for the walk only. Every access to FSDP2's private internals
(`_get_fsdp_state`, `_fsdp_param_groups` and the groups' reduction knobs) is in this
module; `_fsdp_groups` returns None where a torch lays them out differently, and the walk
then runs replicated. The design: `longstraw.parallel`.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

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


def fsdp_sum_factor(modules, cp) -> float | None:
    """The divide factor with which FSDP2's reduce-scatter turns a divided walk's partial
    gradients into the right shard: its group's size / W (1: a plain sum when FSDP2 shards
    over the context-parallel ranks themselves; with more ranks, their data-parallel
    average of the per-group sums). None when the walk cannot run divided under these
    modules: a 2-D (HSDP) mesh, groups of different sizes, a context-parallel rank outside
    the FSDP2 group, or a torch whose FSDP2 internals are laid out differently."""
    cp_ranks = set(dist.get_process_group_ranks(cp.group if cp.group is not None else dist.group.WORLD))
    sizes = set()
    for module in modules:
        groups = _fsdp_groups(module)
        if groups is None:
            return None
        for g in groups:
            mesh = g.mesh_info
            if getattr(mesh, "replicate_process_group", None) is not None or not hasattr(mesh, "shard_process_group"):
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
    for g, *_ in saved:
        g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params = factor, True, True
    try:
        yield
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
