"""Machines x GPUs of a sequence-parallel group: parsing, detection from the launcher.

Global ranks are node-major (torchrun's default): rank ``i`` lives on machine ``i // M``
(``N`` machines with ``M`` GPUs each), unless the topology carries an ``order``: the ranks
listed machine by machine (machine ``j`` holds ``order[j*M:(j+1)*M]``), as when the "machines"
are islands of GPUs inside one host (``hwtopo.py``) whose ranks are not contiguous. A mesh
places its coordinates on machine-major *slots* ``0..N*M-1``; ``rank_at(slot)`` is the rank
there (``slot`` itself without an ``order``).
"""
from __future__ import annotations

import logging
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
    """``nodes`` machines x ``gpus_per_node`` GPUs; ranks node-major, or machine by machine
    as ``order`` lists them (a permutation of ``0..N*M-1``; the identity is stored as None)."""

    nodes: int
    gpus_per_node: int
    order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise TopologyError(f"topology needs at least 1 machine and 1 GPU, got {self}")
        if self.order is not None:
            order = tuple(int(x) for x in self.order)
            if sorted(order) != list(range(self.nodes * self.gpus_per_node)):
                raise TopologyError(
                    f"rank order {order} of topology {self.nodes}x{self.gpus_per_node} must list "
                    f"every rank 0..{self.nodes * self.gpus_per_node - 1} once")
            object.__setattr__(self, "order", None if order == tuple(range(len(order))) else order)

    @classmethod
    def from_machines(cls, machine_of: Sequence[int]) -> "Topology":
        """The topology whose rank ``i`` lives on machine ``machine_of[i]`` (any labels; machines
        numbered by their lowest rank, ranks inside one in rank order). Every machine needs
        the same number of ranks."""
        machines: dict[int, list[int]] = {}
        for rank, m in enumerate(machine_of):
            machines.setdefault(m, []).append(rank)
        sizes = {len(v) for v in machines.values()}
        if not machines or len(sizes) != 1:
            found = ", ".join(f"{len(v)} ranks ({v})" for v in machines.values())
            raise TopologyError(f"unequal GPUs per machine ({found}); every machine needs the same "
                                "number of ranks")
        return cls(len(machines), sizes.pop(), tuple(x for v in machines.values() for x in v))

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
        return self.slot_of(rank) // self.gpus_per_node

    def rank_at(self, slot: int) -> int:
        """The rank at machine-major position ``slot`` (machine ``slot // M``)."""
        return slot if self.order is None else self.order[slot]

    def slot_of(self, rank: int) -> int:
        """``rank_at``'s inverse."""
        return rank if self.order is None else self._slots[rank]

    @property
    def _slots(self) -> dict[int, int]:
        slots = self.__dict__.get("_slot_map")
        if slots is None:
            slots = {x: i for i, x in enumerate(self.order or ())}
            object.__setattr__(self, "_slot_map", slots)
        return slots

    def machines(self) -> list[tuple[int, ...]]:
        """Each machine's ranks, machines in order."""
        M = self.gpus_per_node
        return [tuple(self.rank_at(j * M + i) for i in range(M)) for j in range(self.nodes)]

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
    One host of several ranks (and no ``$LOCAL_WORLD_SIZE`` split) is cut into its islands of
    fast-linked GPUs from NVML (``hwtopo.py``), ranks mapped to islands in any order; without
    NVML it stays one machine. Several hosts stay one machine each; their islands (hosts x
    islands) and a host's finer levels are recorded as competing cuts
    (``hwtopo.last_detection().cuts``) that ``auto`` compares.
    """
    from .hwtopo import forget
    forget()
    source = "argument"
    topo: Topology | None = None
    if override is None and os.environ.get(TOPOLOGY_ENV):
        override, source = os.environ[TOPOLOGY_ENV], f"${TOPOLOGY_ENV}"
    if override is not None:
        topo = override if isinstance(override, Topology) else Topology.parse(override)
    elif dist.is_available() and dist.is_initialized():
        names: list[str | None] = [None] * world_size
        dist.all_gather_object(names, socket.gethostname(), group=group)
        hosts = [str(n) for n in names]
        topo, source = topology_from_hostnames(hosts), "hostnames"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if topo.nodes == 1 and 0 < local < world_size and world_size % local == 0:
            topo, source = Topology(world_size // local, local), "$LOCAL_WORLD_SIZE"
        elif world_size > 1:   # one host: its islands; several: hosts, their islands as cuts
            topo, source = _hardware_topology(world_size, group, hosts, topo)
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
        topo, source = Topology(max(1, world_size // local), min(local, world_size)), "$LOCAL_WORLD_SIZE"
    if topo.world_size != world_size:
        raise TopologyError(
            f"topology {topo} (from {source}) has {topo.world_size} GPUs but the sequence-parallel "
            f"group has {world_size} ranks; use a topology NxM with N*M = {world_size}.")
    return topo


def _hardware_topology(world_size: int, group, hosts: list[str],
                       fallback: Topology) -> tuple[Topology, str]:
    """One host's islands from NVML (``hwtopo.py``; collective) as machines, else
    ``fallback``; what was detected and why is logged once."""
    from .hwtopo import detect_islands
    from .log import get_logger, log_once
    found = detect_islands(world_size, group, hosts)
    if found is None:
        return fallback, "hostnames"
    topo = Topology.from_machines(found.machine_of)
    if fallback.nodes > 1 and topo != fallback:   # hosts as hostnames order them
        return fallback, "hostnames"
    if not dist.is_initialized() or dist.get_rank() == 0:
        log_once(get_logger(__name__), f"hwtopo-{found.description}",
                 f"topology {topo} from the hardware: {found.description}", logging.INFO)
    return topo, "hardware (NVML)"


def subset_topology(topology: Topology, ranks: Sequence[int]) -> Topology:
    """Machines x GPUs of the group ``ranks`` (global ranks of ``topology``, in group order).

    The group needs the same number of members on every machine it spans. Group index ``i``
    lives on the group's machine of ``topology.node_of(ranks[i])`` (machines numbered by
    their first member); where those members are not contiguous in group order the result
    carries the ``order`` that lists them machine by machine.
    """
    ranks = list(ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(
            0 <= x < topology.world_size for x in ranks):
        raise TopologyError(f"group {tuple(ranks)} must hold distinct ranks of topology "
                            f"{topology} (0..{topology.world_size - 1})")
    machine_of = [topology.node_of(x) for x in ranks]
    counts: dict[int, int] = {}
    for m in machine_of:
        counts[m] = counts.get(m, 0) + 1
    if len(set(counts.values())) != 1:
        found = ", ".join(f"machine {m}: {n}" for m, n in counts.items())
        raise TopologyError(
            f"the group of ranks {tuple(ranks)} does not span whole machines evenly on topology "
            f"{topology} ({found}); a group needs the same number of ranks on each of its "
            f"machines: use a group size that is a multiple or a divisor of the "
            f"{topology.gpus_per_node} GPUs per machine")
    return Topology.from_machines(machine_of)
