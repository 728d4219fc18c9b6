"""Topology detection, mesh choice and the inter-machine volume model, against hand-computed values."""
import json

import pytest

from xfuser_swiftfusion.tools.cli import main as cli_main
from xfuser_swiftfusion.tools.cli import plan
from xfuser_swiftfusion.mesh import (choose_mesh, counted_inter_node_elements,
                                     paper_inter_node_elements_per_machine, torus_mesh,
                                     torus_padding)
from xfuser_swiftfusion.topology import (Topology, TopologyError, detect_topology,
                                         topology_from_hostnames)


def test_parse_and_errors():
    assert Topology.parse("2x4") == Topology(2, 4)
    assert Topology.parse(" 3X2 ").world_size == 6
    with pytest.raises(TopologyError, match="NxM"):
        Topology.parse("8")
    with pytest.raises(TopologyError, match="at least 1"):
        Topology(0, 4)


def test_hostnames_node_major_and_equal():
    assert topology_from_hostnames(["a", "a", "b", "b"]) == Topology(2, 2)
    with pytest.raises(TopologyError, match="node-major"):
        topology_from_hostnames(["a", "b", "a", "b"])
    with pytest.raises(TopologyError, match="unequal GPUs per machine.*a: 3, b: 1"):
        topology_from_hostnames(["a", "a", "a", "b"])


def test_override_must_match_world(monkeypatch):
    monkeypatch.delenv("SWIFTFUSION_TOPOLOGY", raising=False)
    assert detect_topology(8, "2x4") == Topology(2, 4)
    with pytest.raises(TopologyError, match="has 6 GPUs but the sequence-parallel group has 8"):
        detect_topology(8, "3x2")
    monkeypatch.setenv("SWIFTFUSION_TOPOLOGY", "4x2")
    assert detect_topology(8) == Topology(4, 2)
    with pytest.raises(TopologyError, match=r"from \$SWIFTFUSION_TOPOLOGY"):
        detect_topology(4)


def test_mesh_4x8_24_heads():
    topo = Topology(4, 8)
    tas = choose_mesh(topo, 24, "tas")
    assert (tas.ulysses, tas.ring, tas.torus, tas.ulysses_intra) == (8, 4, 4, 2)
    assert tas.torus_ready
    # ring groups contiguous inside a machine, Ulysses strided by the ring degree
    assert tas.ring_groups[0] == (0, 1, 2, 3)
    assert tas.ulysses_groups[0] == (0, 4, 8, 12, 16, 20, 24, 28)
    usp = choose_mesh(topo, 24, "usp")
    assert usp.ulysses_groups[0] == tuple(range(8)) and usp.ring_groups[0] == (0, 8, 16, 24)
    assert (usp.torus, usp.ulysses_intra) == (1, 8)


@pytest.mark.parametrize("topo,heads", [("2x4", 8), ("4x2", 24), ("3x2", 6), ("2x2", 4), ("1x4", 2)])
def test_coordinates_roundtrip(topo, heads):
    mesh = choose_mesh(Topology.parse(topo), heads, "tas")
    assert mesh.torus_ready
    seen = set()
    for x in range(mesh.world_size):
        t, u, r = mesh.coords(x)
        assert mesh.rank_of(t, u, r) == x
        assert mesh.topology.node_of(x) == mesh.topology.node_of(mesh.rank_of(t, 0, 0))
        seen.add((t, u, r))
    assert len(seen) == mesh.world_size


def test_gcd_limits_ulysses_and_torus_readiness():
    m = choose_mesh(Topology(2, 4), 6, "tas")          # gcd(8, 6) = 2
    assert (m.ulysses, m.ring, m.torus, m.ulysses_intra) == (2, 4, 2, 1) and m.torus_ready
    m = choose_mesh(Topology(3, 2), 4, "tas")          # P_u = 2 < N = 3: ring crosses machines
    assert (m.ulysses, m.ring) == (2, 3) and not m.torus_ready
    with pytest.raises(TopologyError, match="not divisible by ulysses degree 4"):
        choose_mesh(Topology(2, 2), 6, "tas", ulysses_degree=4)
    with pytest.raises(TopologyError, match="must equal the SP world size"):
        choose_mesh(Topology(2, 2), 8, "tas", ulysses_degree=2, ring_degree=4)


def test_ring_degree_alone_sets_the_ulysses_degree():
    """A ring degree given without a Ulysses degree: P_u = W / P_r, groups drawn by hand
    (2 x 4 GPUs, 8 heads); a ring degree that does not divide W = 8 is refused."""
    topo = Topology(2, 4)
    for ring, ulysses in ((1, 8), (2, 4), (4, 2), (8, 1)):
        m = choose_mesh(topo, 8, "tas", ring_degree=ring)
        assert (m.ulysses, m.ring) == (ulysses, ring), ring
    m = choose_mesh(topo, 8, "tas", ring_degree=2)
    assert m.ring_groups == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.ulysses_groups == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert (m.torus, m.ulysses_intra) == (2, 2) and m.torus_ready
    for ring in (3, 5, 16):
        with pytest.raises(TopologyError, match=f"ring degree {ring} does not divide the SP world size 8"):
            choose_mesh(topo, 8, "tas", ring_degree=ring)


def _torus_ready_by_hand(nodes: int, gpus: int, ulysses: int, placement: str) -> bool:
    """torus_ready from its contract, over machine-major slots (machine = slot // M): every
    ring group on one machine, every Ulysses group U consecutive members on each of T
    machines. Slot grids: ``tas`` rows of P_r slots are ring groups (columns Ulysses
    groups); ``usp`` rows of P_u slots are Ulysses groups (columns ring groups)."""
    ring = nodes * gpus // ulysses
    if placement == "tas":
        grid = [[g * ring + r for r in range(ring)] for g in range(ulysses)]
        rings, ulys = grid, [list(c) for c in zip(*grid)]
    else:
        grid = [[r * ulysses + g for g in range(ulysses)] for r in range(ring)]
        ulys, rings = grid, [list(c) for c in zip(*grid)]
    if any(len({s // gpus for s in grp}) != 1 for grp in rings):
        return False
    for grp in ulys:
        runs = [[grp[0] // gpus]]  # machines of consecutive members, run by run
        for s in grp[1:]:
            if s // gpus == runs[-1][0]:
                runs[-1].append(s // gpus)
            else:
                runs.append([s // gpus])
        if len({r[0] for r in runs}) != len(runs) or len({len(r) for r in runs}) != 1:
            return False
    return True


def test_torus_ready_against_its_contract():
    """torus_ready on every mesh of every N x M <= 24 GPUs (both placements, every Ulysses
    degree dividing W, node-major and interleaved rank orders) equals the contract computed
    by hand over slots, and its closed form: N = 1, or ``tas`` with P_r | M, or ``usp`` with
    P_r = 1. (Once the ring groups fit machines the Ulysses groups always fit the contract.)"""
    from xfuser_swiftfusion.mesh import Mesh
    seen = {True: 0, False: 0}
    for n in range(1, 7):
        for g in range(1, 7):
            w = n * g
            if w > 24:
                continue
            interleaved = Topology.from_machines([i % n for i in range(w)])  # rank i on machine i % N
            for topo in (Topology(n, g), interleaved):
                for pu in (d for d in range(1, w + 1) if w % d == 0):
                    pr = w // pu
                    for placement in ("tas", "usp"):
                        mesh = Mesh(topo, pu, pr, placement)
                        want = _torus_ready_by_hand(n, g, pu, placement)
                        closed = n == 1 or (placement == "tas" and g % pr == 0) or \
                            (placement == "usp" and pr == 1)
                        assert want == closed, (n, g, pu, placement)
                        assert mesh.torus_ready == want, (topo, topo.order, pu, placement)
                        seen[want] += 1
    assert seen[True] > 50 and seen[False] > 50
    # by hand: 2 x 4, usp, P_u = 4: ring group (0, 4) spans both machines
    assert not Mesh(Topology(2, 4), 4, 2, "usp").torus_ready
    assert Mesh(Topology(2, 4), 4, 2, "tas").torus_ready


def test_volume_hand_computed_4x8():
    # 4 x 8 GPUs, 24 heads: X = BLHD/32 per GPU; TAS sends 6/8 of Q, K, V, O off-machine = 3X,
    # USP's ring crosses machines every step: 2X * (R - 1) = 6X.
    B, L, H, D = 1, 32 * 64, 24, 8
    X = B * L * H * D // 32
    tas = counted_inter_node_elements(choose_mesh(Topology(4, 8), H, "tas"), B, L, H, D)
    usp = counted_inter_node_elements(choose_mesh(Topology(4, 8), H, "usp"), B, L, H, D)
    assert set(tas) == {3 * X} and set(usp) == {6 * X}
    # the paper: per machine 4 (N-1) BLHD / N^2 and 2 (N-1) BLHD / N
    assert paper_inter_node_elements_per_machine("tas", 4, 8, 8, B, L, H, D) == 0.75 * B * L * H * D
    assert paper_inter_node_elements_per_machine("usp", 4, 8, 8, B, L, H, D) == 1.5 * B * L * H * D


@pytest.mark.parametrize("n,m,h", [(2, 2, 24), (3, 2, 24), (4, 2, 24), (2, 4, 8), (4, 8, 24), (4, 4, 32)])
def test_counted_equals_paper_when_ulysses_spans_all_machines(n, m, h):
    B, L, D = 2, n * m * 12, 16
    mesh = choose_mesh(Topology(n, m), h, "tas")
    per_rank = counted_inter_node_elements(mesh, B, L, h, D)
    assert len(set(per_rank)) == 1
    assert per_rank[0] * m == paper_inter_node_elements_per_machine("tas", n, m, mesh.ulysses, B, L, h, D)


def test_mixed_case_formulas():
    # USP with P_r < N (4 x 2, H = 4: U4 R2): (2(P_r-1) N/P_r + 4 (N/P_r-1)/(N/P_r)) BLHD/N
    assert paper_inter_node_elements_per_machine("usp", 4, 2, 4, 1, 8, 1, 1) == (2 * 1 * 2 + 4 * 1 / 2) * 8 / 4
    # SFU with P_u < N (4 x 2, H = 2: U2 R4): (2(N/P_u-1) + 4 (P_u-1)/P_u N/P_u) BLHD/N
    assert paper_inter_node_elements_per_machine("tas", 4, 2, 2, 1, 8, 1, 1) == (2 * 1 + 4 * 0.5 * 2) * 8 / 4
    # 8 x 1 (N/P_u = 4, N/P_r = 4): SFU U2 R4: (2 * 3 + 4 * 1/2 * 4) BLHD/8; USP U4 R2:
    # (2 * 1 * 8/2 + 4 * 3/4) BLHD/8
    assert paper_inter_node_elements_per_machine("tas", 8, 1, 2, 1, 8, 1, 1) == pytest.approx(14.0)
    assert paper_inter_node_elements_per_machine("usp", 8, 1, 4, 1, 8, 1, 1) == pytest.approx(11.0)
    # USP U2 R4 on 8 x 1: (2 * 3 * 8/4 + 4 * 1/2) BLHD/8
    assert paper_inter_node_elements_per_machine("usp", 8, 1, 2, 1, 8, 1, 1) == pytest.approx(14.0)
    # one machine: nothing crosses
    assert paper_inter_node_elements_per_machine("usp", 1, 8, 8, 1, 8, 8, 8) == 0


def test_plan_cli_json(capsys):
    assert cli_main(["plan", "--nodes", "4", "--gpus-per-node", "8", "--heads", "24",
                     "--seq-len", "66048", "--head-dim", "128", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["tas"]["ulysses_degree"], p["tas"]["ring_degree"], p["tas"]["torus_degree"]) == (8, 4, 4)
    assert p["usp"]["inter_node_bytes_per_gpu"] == 2 * p["tas"]["inter_node_bytes_per_gpu"]
    # bf16 bytes: 3 * X * 2 with X = B L H D / 32
    assert p["swiftfusion"]["inter_node_bytes_per_gpu"] == 3 * (66048 * 24 * 128 // 32) * 2


def test_plan_reports_padding_and_fallback():
    """3 x 2, 4 heads: U2xR3 puts the ring across machines; torus/swiftfusion run on 6
    zero-padded heads (U6xR1), or fall back to tas with pad_heads=False; 1 head has no
    H' <= 2 that fits 3 machines: tas."""
    p = plan(3, 2, 4, 4608, 64)
    for s in ("torus", "swiftfusion"):
        assert (p[s]["runs_as"], p[s]["heads"], p[s]["ulysses_degree"], p[s]["ring_degree"]) == (s, 6, 6, 1)
    assert (p["tas"]["heads"], p["tas"]["ulysses_degree"]) == (4, 2)
    p = plan(3, 2, 4, 4608, 64, pad_heads=False)
    assert p["torus"]["runs_as"] == "tas" and p["swiftfusion"]["runs_as"] == "tas"
    p = plan(3, 2, 1, 4608, 64)
    assert p["torus"]["runs_as"] == "tas" and p["torus"]["heads"] == 1


def test_plan_cli_bad_input(capsys):
    assert cli_main(["plan", "--nodes", "2", "--gpus-per-node", "2", "--heads", "4",
                     "--seq-len", "1001", "--head-dim", "64"]) == 2
    assert "not divisible by the SP degree 4" in capsys.readouterr().err


def test_subset_topology_of_groups():
    """Machines x GPUs of a group, against the layout drawn by hand; the groups it refuses."""
    from xfuser_swiftfusion.topology import subset_topology
    t = Topology(2, 2)  # machine 0: ranks 0, 1; machine 1: ranks 2, 3
    for ranks, want in (([2, 3], "1x2"), ([1, 2], "2x1"), ([0, 1, 2, 3], "2x2"), ([3], "1x1"),
                        ([2, 3, 0, 1], "2x2"), ([0], "1x1")):
        assert str(subset_topology(t, ranks)) == want, ranks
    # members interleaved across machines: group index i on machine (0, 1, 0, 1)[i]
    inter = subset_topology(t, [0, 2, 1, 3])
    assert str(inter) == "2x2" and [inter.node_of(i) for i in range(4)] == [0, 1, 0, 1]
    for ranks in ([], [0, 0], [-1, 0], [3, 4], [0, 1, 2]):
        with pytest.raises(TopologyError):
            subset_topology(t, ranks)


def test_topology_from_the_local_world_size_without_torch_distributed(monkeypatch):
    monkeypatch.delenv("SWIFTFUSION_TOPOLOGY", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert detect_topology(8) == Topology(1, 8)
    for local, want in (("2", Topology(4, 2)), ("8", Topology(1, 8)), ("16", Topology(1, 8)),
                        ("1", Topology(8, 1)), ("", Topology(1, 8))):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert detect_topology(8) == want, local


def _detected(cases):
    import os
    import socket
    import torch.distributed as dist
    del os.environ["SWIFTFUSION_TOPOLOGY"]  # set by the emulation: the hostnames decide here
    out = []
    for local in cases:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if local is not None:
            os.environ["LOCAL_WORLD_SIZE"] = local
        out.append(str(detect_topology(4)))
    rank = dist.get_rank()
    real, socket.gethostname = socket.gethostname, lambda: f"host{rank // 2}"
    try:  # two hosts of two ranks each: the hostnames decide, whatever $LOCAL_WORLD_SIZE says
        out.append(str(detect_topology(4)))
    finally:
        socket.gethostname = real
    return out


def test_topology_from_hostnames_over_torch_distributed():
    """Four ranks on one host (loopback): one machine, unless $LOCAL_WORLD_SIZE divides the
    world into several; ranks reporting two hostnames: two machines."""
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    cases = ["0", "2", "1", "3", "4", "8", "", None]
    for rows in run_emulated(_detected, "1x4", cases, timeout_s=120):
        assert rows == ["1x4", "2x2", "4x1", "1x4", "1x4", "1x4", "1x4", "1x4", "2x2"]


def test_hostnames_more_layouts():
    for names, want in ((["a"], (1, 1)), (["a", "b"], (2, 1)), (["a", "a", "b", "b", "c", "c"], (3, 2)),
                        (["h"] * 3, (1, 3))):
        assert topology_from_hostnames(names) == Topology(*want), names
    for names in ([], ["a", "b", "b"], ["a", "b", "a"]):
        with pytest.raises(TopologyError):
            topology_from_hostnames(names)
    assert Topology(3, 2).node_of(5) == 2 and Topology(3, 2).node_of(1) == 0
    assert Topology.parse("1x1") == Topology(1, 1) and Topology(1, 1).world_size == 1


def test_topology_is_a_value():
    """Frozen and hashable: usable as a key (equal layouts, one key), never changed in place."""
    import dataclasses
    assert {Topology(2, 2): "a"}[Topology.parse("2x2")] == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        Topology(2, 2).nodes = 3


def test_pass_ring_counts_what_each_rank_sends_to_the_next():
    """USP on 2x2 with one head: one ring (0, 1, 2, 3) over both machines; a rank sends K and V
    (X = B L/W H D elements each) to the next ring rank in each of the R - 1 = 3 steps, so only
    ranks 1 (to 2) and 3 (to 0) send across machines."""
    mesh = choose_mesh(Topology(2, 2), 1, "usp")
    assert mesh.ring_groups == [(0, 1, 2, 3)] and mesh.ulysses == 1
    X = 2 * (8 // 4) * 1 * 4
    assert counted_inter_node_elements(mesh, 2, 8, 1, 4, "pass") == [0, 6 * X, 0, 6 * X]
    # one-sided: each rank's K and V pulled once by each ring peer; 2 of its 3 peers are on the
    # other machine
    assert counted_inter_node_elements(mesh, 2, 8, 1, 4, "pull") == [4 * X] * 4


def test_torus_padding_is_the_smallest_head_count_the_torus_runs():
    """tas, node-major: torus-ready exactly when N divides gcd(N*M, H') (docstring): 2x4, H = 3
    pads to 4 (= H + 1); 4x1, H = 2 pads to 4 (= 2H); 4x1, H = 3: 4; 2x2, H = 2: nothing."""
    assert torus_padding(Topology(2, 4), 3) == 4
    assert torus_padding(Topology(4, 1), 2) == 4
    assert torus_padding(Topology(4, 1), 3) == 4
    assert torus_padding(Topology(2, 2), 2) is None
    mesh, heads = torus_mesh(Topology(4, 1), 2)  # padded by default
    assert heads == 4 and mesh == choose_mesh(Topology(4, 1), 4)
    assert torus_mesh(Topology(4, 1), 2, pad=False) == (choose_mesh(Topology(4, 1), 2), 2)


def test_mesh_is_a_value():
    a, b = choose_mesh(Topology(2, 4), 8), choose_mesh(Topology(2, 4), 8)
    assert a == b and len({a, b}) == 1


def test_machines_from_labels():
    """Rank i on machine machine_of[i]: machines numbered by their lowest rank, ranks in order."""
    topo = Topology.from_machines([5, 7, 5, 7])
    assert (topo.nodes, topo.gpus_per_node) == (2, 2)
    assert topo.machines() == [(0, 2), (1, 3)]
    assert [topo.node_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert Topology.from_machines([0, 0, 1, 1]).machines() == [(0, 1), (2, 3)]
    assert Topology(2, 3).machines() == [(0, 1, 2), (3, 4, 5)]
    for bad in ([0, 0, 1], []):
        with pytest.raises(TopologyError):
            Topology.from_machines(bad)
