"""Machines x GPUs of a sequence-parallel group: parsing, detection from the launcher.

Global ranks are node-major (torchrun's default): rank ``i`` lives on machine ``i // M``
(``N`` machines with ``M`` GPUs each).
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

TOPOLOGY_ENV = "SWIFTFUSION_TOPOLOGY"


class TopologyError(ValueError):
    """The machines x GPUs layout or the mesh requested for it is not valid."""


@dataclass(frozen=True)
class Topology:
    """``nodes`` machines x ``gpus_per_node`` GPUs, ranks node-major."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise TopologyError(f"topology needs at least 1 machine and 1 GPU, got {self}")

    @classmethod
    def parse(cls, text: str) -> "Topology":
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(text))
        if not m:
            raise TopologyError(
                f"topology {text!r} is not of the form NxM (machines x GPUs per machine), e.g. 2x4")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


def topology_from_hostnames(hostnames: list[str]) -> Topology:
    """Machines x GPUs from the hostname of every rank, in rank order.

    Requires node-major order (each machine's ranks contiguous) and equal GPUs per machine.
    """
    if not hostnames:
        raise TopologyError("no ranks to build a topology from")
    blocks: list[tuple[str, int]] = []
    for h in hostnames:
        if blocks and blocks[-1][0] == h:
            blocks[-1] = (h, blocks[-1][1] + 1)
        else:
            blocks.append((h, 1))
    names = [b[0] for b in blocks]
    if len(set(names)) != len(names):
        order = ", ".join(f"{i}:{h}" for i, h in enumerate(hostnames))
        raise TopologyError(
            "ranks are not in node-major order (a machine's ranks must be contiguous, as "
            f"torchrun assigns them); rank:host = {order}. Launch with one torchrun per machine "
            "and --node_rank, or pass topology='NxM' if you know the layout.")
    counts = {b[1] for b in blocks}
    if len(counts) != 1:
        found = ", ".join(f"{h}: {n}" for h, n in blocks)
        raise TopologyError(
            f"unequal GPUs per machine ({found}); sequence parallelism across machines needs the "
            "same number of ranks on every machine. Use equal --nproc_per_node everywhere.")
    return Topology(len(blocks), blocks[0][1])


def detect_topology(world_size: int, override: str | Topology | None = None,
                    group: dist.ProcessGroup | None = None) -> Topology:
    """Topology of a group of ``world_size`` ranks.

    Order of precedence: ``override`` argument, ``$SWIFTFUSION_TOPOLOGY``, hostnames gathered
    over ``group`` (when torch.distributed is initialised), ``$LOCAL_WORLD_SIZE``, one machine.
    """
    source = "argument"
    topo: Topology | None = None
    if override is None and os.environ.get(TOPOLOGY_ENV):
        override, source = os.environ[TOPOLOGY_ENV], f"${TOPOLOGY_ENV}"
    if override is not None:
        topo = override if isinstance(override, Topology) else Topology.parse(override)
    elif dist.is_available() and dist.is_initialized():
        names: list[str | None] = [None] * world_size
        dist.all_gather_object(names, socket.gethostname(), group=group)
        topo, source = topology_from_hostnames([str(n) for n in names]), "hostnames"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if topo.nodes == 1 and 0 < local < world_size and world_size % local == 0:
            topo, source = Topology(world_size // local, local), "$LOCAL_WORLD_SIZE"
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
        topo, source = Topology(max(1, world_size // local), min(local, world_size)), "$LOCAL_WORLD_SIZE"
    if topo.world_size != world_size:
        raise TopologyError(
            f"topology {topo} (from {source}) has {topo.world_size} GPUs but the sequence-parallel "
            f"group has {world_size} ranks; use a topology NxM with N*M = {world_size}.")
    return topo


def subset_topology(topology: Topology, ranks: Sequence[int]) -> Topology:
    """Machines x GPUs of the group ``ranks`` (global ranks of ``topology``, in group order).

    The group must be node-major (each machine's members contiguous in ``ranks``) with the
    same number of members on every machine it spans; group index ``i`` then lives on the
    group's machine ``i // M'`` (``M'``: its GPUs per machine), which is ``topology``'s machine
    ``topology.node_of(ranks[i])``.
    """
    ranks = list(ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(
            0 <= x < topology.world_size for x in ranks):
        raise TopologyError(f"group {tuple(ranks)} must hold distinct ranks of topology "
                            f"{topology} (0..{topology.world_size - 1})")
    blocks: list[list[int]] = []  # [machine, members] in group order
    for x in ranks:
        if blocks and blocks[-1][0] == topology.node_of(x):
            blocks[-1][1] += 1
        else:
            blocks.append([topology.node_of(x), 1])
    machines = [m for m, _ in blocks]
    if len(set(machines)) != len(machines) or len({n for _, n in blocks}) != 1:
        found = ", ".join(f"machine {m}: {n}" for m, n in blocks)
        raise TopologyError(
            f"the group of ranks {tuple(ranks)} does not span whole machines evenly on topology "
            f"{topology} ({found} in group order); a group needs the same number of ranks on "
            f"each of its machines, contiguous: use a group size that is a multiple or a divisor "
            f"of the {topology.gpus_per_node} GPUs per machine")
    return Topology(len(blocks), blocks[0][1])
