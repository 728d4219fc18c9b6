"""Communicators: one-sided (``nvshmem`` on GPUs) and two-sided (``p2p`` over torch.distributed).

One-sided backends form a registry: ``nvshmem`` is built in; others come from the entry-point
group ``xfuser_swiftfusion.one_sided`` (the CPU cluster emulation provides ``shm``, its
shared-memory heap: ``(factory, device type it is the default for)``) or ``register_one_sided``.
Backends are imported on demand, so this package imports without a GPU or nvshmem4py.

SP groups: the factories take this rank, the world size and the machine of every rank of the
default group, and optionally ``members``, the global ranks of this rank's SP group in SP-rank
order (with ``sp_groups``, every SP group, for the one-sided one). The communicator they return
speaks SP ranks: a ``P2PCommunicator`` over the members, or a ``SubgroupOneSided`` view of one
world one-sided communicator (``subgroup.py``).
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .base import (QUEUES, ByteCounter, CommTimeout, Communicator, Handle, OneSided, PeerFailure,
                   SymmetricBuffers, TwoSided)

__all__ = ["QUEUES", "ByteCounter", "CommTimeout", "Communicator", "ENTRY_POINT_GROUP", "Handle",
           "OneSided", "PeerFailure", "SymmetricBuffers", "TwoSided", "make_one_sided",
           "make_two_sided", "one_sided_kinds", "prepare_two_sided", "register_one_sided"]


def _nvshmem(*args) -> OneSided:
    from .nvshmem import NvshmemCommunicator
    return NvshmemCommunicator(*args)


# name -> (factory(rank, world_size, node_of, timeout_s), device type it is the default for)
_ONE_SIDED: dict[str, tuple[Callable[..., OneSided], str]] = {"nvshmem": (_nvshmem, "cuda")}


ENTRY_POINT_GROUP = "xfuser_swiftfusion.one_sided"
_loaded_entry_points = False


def register_one_sided(name: str, factory: Callable[..., OneSided], default_for: str) -> None:
    """Add a one-sided backend: ``factory(rank, world_size, node_of, timeout_s)``, the
    ``comm="auto"`` choice on devices of type ``default_for``."""
    _ONE_SIDED[name] = (factory, default_for)


def _load_entry_points() -> None:
    global _loaded_entry_points
    if not _loaded_entry_points:
        _loaded_entry_points = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in _ONE_SIDED:
                register_one_sided(ep.name, *ep.load())


def one_sided_kinds() -> tuple[str, ...]:
    _load_entry_points()
    return ("auto", *_ONE_SIDED)


def _require_dist(kind: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"the {kind!r} communicator needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) before it is created")


def make_one_sided(kind: str = "auto", *, rank: int, world_size: int, node_of: list[int],
                   timeout_s: float, members: Sequence[int] | None = None,
                   sp_groups: Sequence[Sequence[int]] | None = None) -> OneSided:
    """``auto``: the backend registered for this device type (``nvshmem`` with CUDA); collective
    over the default group. With ``members`` and ``sp_groups`` (several SP groups): the SP
    group's view (``SubgroupOneSided``) of one communicator over the default group."""
    _load_entry_points()
    if kind == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        kinds = [k for k, (_, d) in _ONE_SIDED.items() if d == device]
        if not kinds:
            raise RuntimeError(
                f"no one-sided communicator is registered for {device} tensors (NVSHMEM needs "
                f"GPUs); registered: {', '.join(_ONE_SIDED)}")
        kind = kinds[0]
    if kind not in _ONE_SIDED:
        raise ValueError(f"unknown one-sided communicator {kind!r}; choose from {one_sided_kinds()}")
    _require_dist(kind)
    factory = _ONE_SIDED[kind][0]
    if members is None or sp_groups is None or len(sp_groups) == 1:
        if members is not None and tuple(members) != tuple(range(world_size)):
            raise ValueError(f"a one-sided communicator over the SP group {tuple(members)} needs "
                             "sp_groups, every SP group of the default group")
        return factory(rank, world_size, node_of, timeout_s)
    from .subgroup import make_subgroup_one_sided
    return make_subgroup_one_sided(lambda: factory(rank, world_size, node_of, timeout_s),
                                   rank=rank, members=members, sp_groups=sp_groups,
                                   timeout_s=timeout_s)


def make_two_sided(*, rank: int, world_size: int, node_of: list[int], timeout_s: float,
                   members: Sequence[int] | None = None) -> TwoSided:
    """``isend``/``irecv`` over torch.distributed (NCCL on GPUs, gloo on CPU), over the SP
    group ``members`` (default: the whole default group)."""
    _require_dist("p2p")
    from .p2p import P2PCommunicator
    if members is None:
        return P2PCommunicator(rank, world_size, node_of, timeout_s)
    members = tuple(members)
    if rank not in members:
        raise ValueError(f"rank {rank} is not in its SP group {members}")
    return P2PCommunicator(members.index(rank), len(members), [node_of[x] for x in members],
                           timeout_s, members)


def prepare_two_sided() -> None:
    """Collective over the default group: create the two-sided queue groups now (they are
    otherwise created by the first two-sided communicator)."""
    _require_dist("p2p")
    from .p2p import queue_groups
    queue_groups()
