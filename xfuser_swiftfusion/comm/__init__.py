"""Communicators: one-sided (``shm`` on CPU, ``nvshmem`` on GPU) and two-sided (``p2p``).

Backends are imported on demand, so this package imports without a GPU or nvshmem4py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import (QUEUES, ByteCounter, CommTimeout, Communicator, DoneHandle, Handle, OneSided,
                   PeerFailure, SymmetricBuffers, TwoSided)

__all__ = ["QUEUES", "ByteCounter", "CommTimeout", "Communicator", "DoneHandle", "Handle",
           "OneSided", "PeerFailure", "SymmetricBuffers", "TwoSided", "make_one_sided",
           "make_two_sided", "ONE_SIDED_KINDS", "TWO_SIDED_KINDS"]

ONE_SIDED_KINDS = ("auto", "shm", "nvshmem")
TWO_SIDED_KINDS = ("auto", "p2p")


def _require_dist(kind: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"the {kind!r} communicator needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) before it is created")


def make_one_sided(kind: str = "auto", *, rank: int, world_size: int, node_of: list[int],
                   timeout_s: float) -> OneSided:
    """``auto``: ``nvshmem`` when CUDA is available, else ``shm`` (collective)."""
    if kind not in ONE_SIDED_KINDS:
        raise ValueError(f"unknown one-sided communicator {kind!r}; choose from {ONE_SIDED_KINDS}")
    if kind == "auto":
        kind = "nvshmem" if torch.cuda.is_available() else "shm"
    _require_dist(kind)
    if kind == "shm":
        from .shm import ShmCommunicator as cls
    else:
        from .nvshmem import NvshmemCommunicator as cls
    return cls(rank, world_size, node_of, timeout_s)


def make_two_sided(kind: str = "auto", *, rank: int, world_size: int, node_of: list[int],
                   timeout_s: float, directional: bool = False) -> TwoSided:
    """``p2p`` over torch.distributed (the only two-sided backend; ``auto`` picks it)."""
    if kind not in TWO_SIDED_KINDS:
        raise ValueError(f"unknown two-sided communicator {kind!r}; choose from {TWO_SIDED_KINDS}")
    _require_dist("p2p")
    from .p2p import P2PCommunicator

    return P2PCommunicator(rank, world_size, node_of, timeout_s, directional=directional)
