"""``groups.py`` without processes: rank tables, SP groups and their checks, against the
mesh's own rank arithmetic (``Mesh.coords``) and tables written out by hand."""
from __future__ import annotations

import pytest
import torch

from xfuser_swiftfusion.groups import (SPGroups, build_groups, check_sp_groups, global_mesh_tensor,
                                       mesh_tensor)
from xfuser_swiftfusion.mesh import choose_mesh
from xfuser_swiftfusion.topology import Topology


def test_mesh_tensor_holds_each_gpu_at_its_coordinates():
    for topo, heads in ((Topology(2, 4), 4), (Topology(2, 4), 2), (Topology(2, 2), 4), (Topology(3, 2), 6)):
        mesh = choose_mesh(topo, heads)
        ranks = mesh_tensor(mesh)
        assert ranks.shape == (mesh.torus, mesh.ulysses_intra, mesh.ring)
        assert sorted(ranks.flatten().tolist()) == list(range(mesh.world_size))
        for x in range(mesh.world_size):
            t, u, r = mesh.coords(x)
            assert ranks[t, u, r] == x
    # 2x4, 2 heads: P_u = 2 across the machines, ring of 4 inside each: [[0..3], [4..7]]
    assert mesh_tensor(choose_mesh(Topology(2, 4), 2)).tolist() == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_check_sp_groups():
    assert check_sp_groups([[0, 1], [2, 3]], 4) == ((0, 1), (2, 3))
    for bad in ([[0, 1], [2]], [[0, 1], [1, 2]], [], [[0, 1], [2, 4]], [[0, 1, 2, 3]]):
        with pytest.raises(ValueError):
            check_sp_groups(bad, 3 if bad == [[0, 1, 2, 3]] else 4)


def test_sp_groups_views():
    mesh = choose_mesh(Topology(2, 2), 2)  # U2 across the machines, ring of 2 inside each
    g = SPGroups(mesh, 1, members=(4, 5, 6, 7), sp_groups=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert g.global_members == (4, 5, 6, 7) and g.to_global(2) == 6 and g.global_rank == 5
    assert g.all_sp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert g.ring_groups == [(0, 1), (2, 3)] and g.ulysses_groups == [(0, 2), (1, 3)]
    assert g.ring_ranks == (0, 1) and g.ulysses_ranks == (1, 3)
    alone = SPGroups(mesh, 3)
    assert alone.global_members == (0, 1, 2, 3) and alone.all_sp_groups == ((0, 1, 2, 3),)
    assert alone.for_mesh(choose_mesh(Topology(2, 2), 4)).ulysses_groups == [(0, 1, 2, 3)]
    for kw in ({"rank": 4}, {"rank": -1}, {"rank": 0, "members": (0, 1, 2)},
               {"rank": 0, "members": (4, 5, 6, 7), "sp_groups": ((0, 1, 2, 3),)}):
        with pytest.raises(ValueError):
            SPGroups(mesh, **kw)


def test_global_mesh_tensor_maps_every_group():
    mesh = choose_mesh(Topology(1, 2), 2)  # [1, 2, 1]
    assert global_mesh_tensor(mesh, [(4, 6)]).tolist() == [[[4], [6]]]
    assert global_mesh_tensor(mesh, [(0, 2), (1, 3)]).tolist() == [[[[0], [2]]], [[[1], [3]]]]


def test_build_groups_without_processes():
    mesh = choose_mesh(Topology(1, 2), 2)
    g = build_groups(mesh, 1, "cpu", members=(0, 1))  # the identity: no members kept
    assert g.members is None and g.sp_groups is None and g.global_rank == 1
    g = build_groups(mesh, 0, "cpu", members=(2, 3), sp_groups=[(0, 1), (2, 3)])
    assert g.members == (2, 3) and g.sp_groups == ((0, 1), (2, 3)) and g.global_rank == 2
    g = build_groups(mesh, 0, "cpu", members=(1, 0), sp_groups=[(1, 0)])  # one group: not kept
    assert g.sp_groups is None and g.members == (1, 0) and g.global_rank == 1
    assert torch.equal(g.ranks, mesh_tensor(mesh))


def test_build_groups_finds_my_sp_rank(monkeypatch):
    """Without ``rank``: my global rank's index in ``members`` (the default group: itself)."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 3)
    mesh = choose_mesh(Topology(1, 2), 2)
    assert build_groups(mesh, None, "cpu", members=(2, 3), sp_groups=[(0, 1), (2, 3)]).rank == 1
    assert build_groups(choose_mesh(Topology(2, 2), 4), None, "cpu").rank == 3
    with pytest.raises(ValueError):
        build_groups(mesh, None, "cpu", members=(0, 1), sp_groups=[(0, 1), (2, 3)])


def test_groups_of_another_mesh_build_their_own_device_mesh():
    g = SPGroups(choose_mesh(Topology(2, 2), 2), 0)
    g._device_mesh = object()  # this mesh's, once built
    assert g.for_mesh(choose_mesh(Topology(2, 2), 4))._device_mesh is None


def test_mesh_tensor_of_a_ulysses_group_not_in_whole_machines():
    """USP on 3x2 with 3 heads: P_u = 3 spans 1.5 machines: ``[1, P_u, R]`` by (g, r)."""
    mesh = choose_mesh(Topology(3, 2), 3, "usp")
    ranks = mesh_tensor(mesh)
    assert ranks.shape == (1, 3, 2)
    for x in range(6):
        g, r = mesh.g_r_of(x)
        assert ranks[0, g, r] == x


def test_sp_groups_compare_by_identity():
    mesh = choose_mesh(Topology(2, 2), 2)
    a, b = SPGroups(mesh, 0), SPGroups(mesh, 0)
    assert a != b and len({a, b}) == 2  # each holds its own process groups


def test_build_groups_device_type(monkeypatch):
    """Given, it stays; else CUDA under NCCL, CPU otherwise (no process group: CPU)."""
    mesh = choose_mesh(Topology(1, 2), 2)
    assert build_groups(mesh, 0, "cuda").device_type == "cuda"
    assert build_groups(mesh, 0).device_type == "cpu"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda")):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, b=backend: b)
        assert build_groups(mesh, 0).device_type == device


def _device_mesh_on_rank():
    import torch.distributed as dist
    g = SPGroups(choose_mesh(Topology(1, 1), 1), 0)
    dm = g.device_mesh
    return (dm.mesh_dim_names, dm.mesh.tolist(), g.device_mesh is dm,
            SPGroups(g.mesh, 0).device_mesh is dm,
            [dist.get_process_group_ranks(g.ulysses_group()) for _ in range(2)],  # flattened once
            dist.get_process_group_ranks(g.ring_group()))


def test_device_mesh_of_one_process():
    """A one-rank gloo world (an emulated rank: a gloo world in the pytest process would leave
    its threads behind for every later fork): the device mesh names its dimensions, is built
    once, and its Ulysses and ring groups hold this rank."""
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    ((names, mesh, once, same, ulysses, ring),) = run_emulated(_device_mesh_on_rank, "1x1",
                                                               timeout_s=60)
    assert names == ("torus", "ulysses", "ring") and mesh == [[[0]]]
    assert once and same
    assert ulysses == [[0], [0]] and ring == [0]
