"""The process mesh of a multi-process run: W ranks as D = W / C data-parallel groups of C
context-parallel ranks (`Mesh`, torch-free arithmetic), and the torch.distributed process
groups along each dimension (`mesh_groups`).

Layout: rank = dp * C + cp, so one context-parallel group is C consecutive ranks (one node
for C <= GPUs per node: the prompt's attention traffic stays on the fast links), and the
data-parallel group of context-parallel index `cp` is ranks cp, cp + C, cp + 2C, ...
(accelerate deals data the same way over a device mesh with a "cp" dimension: processes
with the same `rank // C` get the same batch). C = 1 is plain data parallelism, C = W the
paper's setting (one prompt over every rank). The design: `longstraw.parallel`;
docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from longstraw.errors import ConfigError


@dataclass(frozen=True)
class Mesh:
    """W ranks as (data-parallel index, context-parallel index) pairs.

    Fields:
        world: W, the number of processes.
        context: C, ranks per context-parallel group (1 <= C, C divides W).
    """

    world: int
    context: int

    def __post_init__(self):
        for name in ("world", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Mesh.{name} must be an int >= 1, got {value!r}")
        if self.world % self.context:
            raise ConfigError(f"the context-parallel size {self.context} does not divide the {self.world} processes; "
                              f"pick a divisor of {self.world} (longstraw_context_parallel_size)")

    @property
    def data(self) -> int:
        """D = W / C, the number of data-parallel groups."""
        return self.world // self.context

    def coords(self, rank: int) -> tuple[int, int]:
        """rank -> (dp index in [0, D), cp index in [0, C))."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the mesh of {self.world} processes")
        return divmod(rank, self.context)

    def context_ranks(self, dp: int) -> list[int]:
        """The global ranks of data-parallel group `dp` (one context-parallel group)."""
        return [dp * self.context + c for c in range(self.context)]

    def data_ranks(self, cp: int) -> list[int]:
        """The global ranks holding context-parallel index `cp`, one per data-parallel group
        (the group over which gradients are reduced across data-parallel groups)."""
        return [d * self.context + cp for d in range(self.data)]


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place in a `Mesh` and its process groups.

    Fields:
        mesh: the mesh.
        rank: this process's global rank.
        dp, cp: its (data-parallel, context-parallel) indices.
        context_group: the process group of its C context-parallel ranks (None when C = 1).
        data_group: the process group of its D data-parallel peers (None when D = 1).
    """

    mesh: Mesh
    rank: int
    dp: int
    cp: int
    context_group: object = None
    data_group: object = None


def mesh_groups(mesh: Mesh, backend: str | None = None, timeout=None) -> MeshGroups:
    """Build the mesh's process groups on the initialized default group (every rank must
    call it, in the same order as every other `new_group`); returns this rank's.

    Args:
        mesh: the mesh; `mesh.world` must equal the default group's size.
        backend: the groups' backend (default: the default group's).
        timeout: the groups' collective timeout, a timedelta (default: torch's; a
            `new_group` does not inherit the default group's: pass
            `parallel.launch.collective_timeout()`).
    """
    if not dist.is_available() or not dist.is_initialized():
        if mesh.world == 1:
            return MeshGroups(mesh=mesh, rank=0, dp=0, cp=0)
        raise ConfigError(f"a mesh of {mesh.world} processes needs an initialized torch.distributed default group: "
                          "launch with torchrun or accelerate launch")
    if dist.get_world_size() != mesh.world:
        raise ConfigError(f"the mesh has {mesh.world} processes but torch.distributed has {dist.get_world_size()}")
    rank = dist.get_rank()
    dp, cp = mesh.coords(rank)
    context_group = data_group = None
    for d in range(mesh.data):  # every rank creates every group, in the same order
        g = dist.new_group(mesh.context_ranks(d), backend=backend, timeout=timeout) if mesh.context > 1 else None
        context_group = g if d == dp else context_group
    for c in range(mesh.context):
        g = dist.new_group(mesh.data_ranks(c), backend=backend, timeout=timeout) if mesh.data > 1 else None
        data_group = g if c == cp else data_group
    return MeshGroups(mesh=mesh, rank=rank, dp=dp, cp=cp, context_group=context_group, data_group=data_group)
