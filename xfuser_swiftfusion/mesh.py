"""The Ulysses x Ring mesh of a sequence-parallel group on its machines, and the
inter-machine communication volume of that mesh.

Notation (paper / DESIGN.md): ``N`` machines with ``M`` GPUs each, ``H`` heads,
``P_u = gcd(N*M, H)`` Ulysses degree, ``P_r = N*M / P_u`` Ring degree. The Ulysses
group is further split into ``T`` machines (torus degree) x ``U`` GPUs per machine,
so a GPU is ``x = (t, u, r)``.

Placements, over the topology's machine-major slots (slot ``i`` on machine ``i // M``; the
slot is the global rank when ranks are node-major, else ``Topology.rank_at`` maps it):
- ``usp`` (xFuser / yunchang ``use_ulysses_low=True``): Ulysses groups are contiguous
  blocks of ``P_u`` slots, Ring groups are strided by ``P_u``.
- ``tas`` (SwiftFusion): Ring groups are contiguous blocks of ``P_r`` slots (inside a
  machine when ``P_r | M``), Ulysses groups are strided by ``P_r`` (across machines).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from .topology import Topology, TopologyError

PLACEMENTS = ("usp", "tas")


@dataclass(frozen=True)
class Mesh:
    """Ulysses x Ring mesh of one SP group and its (t, u, r) coordinates.

    ``ulysses`` = P_u, ``ring`` = P_r, ``torus`` = T (machines a Ulysses group spans),
    ``ulysses_intra`` = U (Ulysses peers on the same machine). Coordinates:
    ``usp``: slot = r * P_u + g;  ``tas``: slot = g * P_r + r;  with g = t * U + u (rank =
    ``topology.rank_at(slot)``).
    """

    topology: Topology
    ulysses: int
    ring: int
    placement: str

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise TopologyError(f"unknown placement {self.placement!r}; use one of {PLACEMENTS}")
        if self.ulysses * self.ring != self.topology.world_size:
            raise TopologyError(
                f"ulysses degree {self.ulysses} x ring degree {self.ring} = "
                f"{self.ulysses * self.ring} but topology {self.topology} has "
                f"{self.topology.world_size} GPUs; the product must equal the SP world size.")

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def rank_of_g(self, g: int, r: int) -> int:
        """Global rank of Ulysses index ``g`` (= t*U+u) and ring rank ``r``: the rank at the
        topology's machine-major slot ``r * P_u + g`` (usp) or ``g * P_r + r`` (tas)."""
        slot = r * self.ulysses + g if self.placement == "usp" else g * self.ring + r
        return self.topology.rank_at(slot)

    def g_r_of(self, rank: int) -> tuple[int, int]:
        slot = self.topology.slot_of(rank)
        if self.placement == "usp":
            return slot % self.ulysses, slot // self.ulysses
        return slot // self.ring, slot % self.ring

    @cached_property
    def ulysses_groups(self) -> list[tuple[int, ...]]:
        """Ulysses groups, each ordered by Ulysses rank g."""
        return [tuple(self.rank_of_g(g, r) for g in range(self.ulysses)) for r in range(self.ring)]

    @cached_property
    def ring_groups(self) -> list[tuple[int, ...]]:
        """Ring groups, each ordered by ring rank r."""
        return [tuple(self.rank_of_g(g, r) for r in range(self.ring)) for g in range(self.ulysses)]

    @cached_property
    def torus(self) -> int:
        """T: machines spanned by one Ulysses group (its members grouped by machine)."""
        nodes = {self.topology.node_of(x) for x in self.ulysses_groups[0]}
        return len(nodes)

    @cached_property
    def ulysses_intra(self) -> int:
        """U: Ulysses peers on one machine (``P_u / T``)."""
        return self.ulysses // self.torus

    @cached_property
    def torus_ready(self) -> bool:
        """True when the Torus schedule's (t, u, r) factorisation fits the machines.

        That is: every ring group is inside one machine and every Ulysses group holds
        exactly ``U`` consecutive Ulysses ranks on each of ``T`` machines, so that
        ``g = t*U + u`` with ``t`` the machine's position in the group.
        """
        node = self.topology.node_of
        if any(len({node(x) for x in grp}) != 1 for grp in self.ring_groups):
            return False
        U = self.ulysses_intra
        for grp in self.ulysses_groups:
            for g, x in enumerate(grp):
                if node(x) != node(grp[(g // U) * U]):
                    return False
            if len({node(x) for x in grp}) * U != self.ulysses:
                return False
        return True

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(t, u, r) of a global rank (only meaningful when ``torus_ready``)."""
        g, r = self.g_r_of(rank)
        return g // self.ulysses_intra, g % self.ulysses_intra, r

    def rank_of(self, t: int, u: int, r: int) -> int:
        return self.rank_of_g(t * self.ulysses_intra + u, r)

    def describe(self) -> str:
        return f"U{self.ulysses}xR{self.ring} (torus {self.torus} x intra-Ulysses {self.ulysses_intra})"


def choose_mesh(topology: Topology, num_heads: int, placement: str = "tas",
                ulysses_degree: int | None = None, ring_degree: int | None = None) -> Mesh:
    """The mesh for ``placement``: ``P_u = gcd(N*M, H)`` unless degrees are given."""
    W = topology.world_size
    if num_heads < 1:
        raise TopologyError(f"num_heads must be >= 1, got {num_heads}")
    if ulysses_degree is None and ring_degree is None:
        ulysses_degree = math.gcd(W, num_heads)
    if ulysses_degree is None:
        if W % ring_degree:
            raise TopologyError(f"ring degree {ring_degree} does not divide the SP world size {W}")
        ulysses_degree = W // ring_degree
    if ring_degree is None:
        if W % ulysses_degree:
            raise TopologyError(f"ulysses degree {ulysses_degree} does not divide the SP world size {W}")
        ring_degree = W // ulysses_degree
    if num_heads % ulysses_degree:
        raise TopologyError(
            f"{num_heads} heads are not divisible by ulysses degree {ulysses_degree}; choose a "
            f"ulysses degree that divides the head count (gcd({W}, {num_heads}) = "
            f"{math.gcd(W, num_heads)} is the largest that fits this topology).")
    return Mesh(topology, ulysses_degree, ring_degree, placement)


def torus_padding(topology: Topology, num_heads: int, placement: str = "tas") -> int | None:
    """The head count ``H' > H`` to pad ``num_heads`` to so that the Torus schedule runs:
    the smallest ``H' <= 2H`` whose default mesh ``gcd(N*M, H')`` is ``torus_ready``.

    None when the default mesh of ``num_heads`` is torus-ready already (nothing to pad) or no
    such ``H'`` exists. With node-major ranks and the ``tas`` placement a mesh is torus-ready
    exactly when ``N`` divides ``gcd(N*M, H')`` (ring groups of ``N*M / P_u`` contiguous ranks
    then fit a machine), i.e. when ``N`` divides ``H'``; every torus-ready mesh spans all ``N``
    machines (``T = N``), so its inter-machine bytes and its attention FLOPs both grow as
    ``H'``: the smallest ``H'`` is the cheapest.
    """
    if choose_mesh(topology, num_heads, placement).torus_ready:
        return None
    for padded in range(num_heads + 1, 2 * num_heads + 1):
        if choose_mesh(topology, padded, placement).torus_ready:
            return padded
    return None


def torus_mesh(topology: Topology, num_heads: int, placement: str = "tas",
               ulysses_degree: int | None = None, ring_degree: int | None = None,
               pad: bool = True) -> tuple[Mesh, int]:
    """``(mesh, heads)`` a strategy that needs the Torus schedule runs on: the default mesh
    and ``num_heads``, or, when that mesh is not torus-ready, no degree is given and ``pad``,
    the mesh of ``torus_padding``'s ``H'`` and ``H'`` (where there is one)."""
    mesh = choose_mesh(topology, num_heads, placement, ulysses_degree, ring_degree)
    if mesh.torus_ready or not pad or ulysses_degree is not None or ring_degree is not None:
        return mesh, num_heads
    padded = torus_padding(topology, num_heads, placement)
    if padded is None:
        return mesh, num_heads
    return choose_mesh(topology, padded, placement), padded


# ---------------------------------------------------------------------------------------
# Inter-machine volume.

def counted_inter_node_elements(mesh: Mesh, batch: int, seq_len: int, num_heads: int,
                                head_dim: int, ring: str = "pass") -> list[int]:
    """Elements each rank sends to other machines per attention layer, by counting.

    Models exactly what the strategies move: four Ulysses all-to-alls (Q, K, V in; O out)
    over the Ulysses group, then the K/V ring over the Ring group after the all-to-all,
    where each rank holds ``X = B*L*H*D / (N*M)`` elements per tensor.
    ``ring="pass"``: two-sided ring, ``R-1`` steps sending K and V to the next ring rank;
    ``ring="pull"``: one-sided ring, K and V pulled once from every ring peer (counted at
    the sender, like the two-sided case).
    """
    W = mesh.world_size
    if seq_len % W:
        raise TopologyError(f"sequence length {seq_len} is not divisible by the SP degree {W}")
    node = mesh.topology.node_of
    X = batch * (seq_len // W) * num_heads * head_dim
    out = [0] * W
    for grp in mesh.ulysses_groups:
        for x in grp:
            off = sum(node(y) != node(x) for y in grp)
            out[x] += 4 * (X // mesh.ulysses) * off
    for grp in mesh.ring_groups:
        R = len(grp)
        for i, x in enumerate(grp):
            if ring == "pass":
                nxt = grp[(i + 1) % R]
                if R > 1 and node(nxt) != node(x):
                    out[x] += 2 * X * (R - 1)
            else:
                out[x] += 2 * X * sum(node(y) != node(x) for y in grp)
    return out


def paper_inter_node_elements_per_machine(placement: str, nodes: int, gpus_per_node: int,
                                          ulysses: int, batch: int, seq_len: int,
                                          num_heads: int, head_dim: int) -> float:
    """Inter-machine elements per machine per layer: the paper's appendix formulas, by
    ``placement`` (``"usp"``: USP's; ``"tas"``: SwiftFusion's).

    USP: ``2(N-1)/N * BLHD`` when ``P_r >= N``, else
    ``(2(P_r-1) N/P_r + 4 (N/P_r-1)/(N/P_r)) BLHD/N``.
    SwiftFusion/TAS: ``4 (N-1)/N * BLHD/N`` when ``P_u >= N``, else
    ``(2(N/P_u-1) + 4 (P_u-1)/P_u * N/P_u) BLHD/N``.
    """
    N = nodes
    P_u = ulysses
    P_r = N * gpus_per_node // P_u
    BLHD = batch * seq_len * num_heads * head_dim
    if N == 1:
        return 0.0
    if placement == "usp":
        if P_r >= N:
            return 2 * (N - 1) / N * BLHD
        return (2 * (P_r - 1) * N / P_r + 4 * (N / P_r - 1) / (N / P_r)) * BLHD / N
    if P_u >= N:
        return 4 * (N - 1) / N * BLHD / N
    return (2 * (N / P_u - 1) + 4 * (P_u - 1) / P_u * N / P_u) * BLHD / N
