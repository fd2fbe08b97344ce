"""`parallel.mesh.Mesh`: W ranks as (data-parallel, context-parallel) indices, rank = dp * C + cp
(the layout accelerate deals data by, `rank // C`), and its refusals."""

import pytest

import longstraw as ls
from longstraw.parallel.mesh import Mesh, mesh_groups


def test_ranks_are_dealt_data_parallel_major():
    mesh = Mesh(world=8, context=2)
    assert mesh.data == 4
    assert [mesh.coords(r) for r in range(8)] == [(d, c) for d in range(4) for c in range(2)]
    assert mesh.context_ranks(1) == [2, 3] and mesh.data_ranks(1) == [1, 3, 5, 7]
    every = sorted(r for d in range(mesh.data) for r in mesh.context_ranks(d))
    assert every == list(range(8))  # the context-parallel groups partition the world
    assert Mesh(world=4, context=1).data_ranks(0) == [0, 1, 2, 3]  # C = 1: plain data parallelism
    assert Mesh(world=4, context=4).context_ranks(0) == [0, 1, 2, 3] and Mesh(world=4, context=4).data == 1


@pytest.mark.parametrize("world,context,needle", [(4, 3, "does not divide"), (2, 0, "context"),
                                                  (0, 1, "world"), (2, True, "context")])
def test_bad_meshes_are_refused(world, context, needle):
    with pytest.raises(ls.ConfigError, match=needle):
        Mesh(world=world, context=context)


def test_one_process_needs_no_process_group():
    groups = mesh_groups(Mesh(world=1, context=1))
    assert (groups.dp, groups.cp, groups.context_group, groups.data_group) == (0, 0, None, None)
    with pytest.raises(ls.ConfigError, match="torch.distributed"):
        mesh_groups(Mesh(world=2, context=1))
    with pytest.raises(ls.ConfigError, match="outside the mesh"):
        Mesh(world=2, context=1).coords(2)
