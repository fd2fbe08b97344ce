"""integrations/trl_fsdp.py at W = 2 (gloo, CPU): the device mesh `shard_decoder_layers`
shards over waits LONGSTRAW_COLLECTIVE_TIMEOUT in every dimension's group, not the
default group's timeout nor torch's 30 minutes (issue 43, item 9b)."""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from tests.ranks import spawn

from longstraw.integrations.trl_fsdp import shard_decoder_layers
from longstraw.parallel.mesh import Mesh

STATED_S = 7.0  # LONGSTRAW_COLLECTIVE_TIMEOUT in the test
DEFAULT_GROUP_S = 120.0  # the default group's timeout, which a mesh's new_group does not inherit


def _group_timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _rank(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEFAULT_GROUP_S))
    torch.set_num_threads(1)
    try:
        from tests.reference import tiny_model

        layers = shard_decoder_layers(tiny_model("qwen3"), Mesh(world=world, context=world), torch.device("cpu"))
        meshes = {p.device_mesh for layer in layers for p in layer.parameters()}
        assert len(meshes) == 1, meshes
        (mesh,) = meshes
        assert mesh.mesh_dim_names == ("dp", "cp") and tuple(mesh.shape) == (1, world)
        seen = {name: _group_timeout(mesh.get_group(name)).total_seconds() for name in ("dp", "cp")}
        assert seen == {"dp": STATED_S, "cp": STATED_S}, seen
    finally:
        dist.destroy_process_group()


def test_the_fsdp_mesh_groups_wait_the_stated_collective_timeout(monkeypatch):
    monkeypatch.setenv("LONGSTRAW_COLLECTIVE_TIMEOUT", str(STATED_S))
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, args=(2, os.path.join(tmp, "init")), nprocs=2)
