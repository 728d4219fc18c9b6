"""NVSHMEM symmetric heap through nvshmem4py (``pip install nvshmem4py-cu13``; GPU only).

Bootstrap: rank 0's ``nvshmem.core.get_unique_id()`` (a 128-byte ``nvshmemx_uniqueid_t``)
is broadcast over torch.distributed, then every rank calls ``nvshmem.core.init(device=,
uid=, rank=, nranks=, initializer_method="uid")``; NVSHMEM PE ids equal global ranks.

Symmetric buffers are ``nvshmem.core.tensor``; a view of one is addressed by its local
address (symmetric addresses are valid on every PE). ``put``/``get`` decompose that view into
contiguous byte runs and issue ``nvshmemx_{put,get}mem_on_stream`` per run on the queue's
CUDA stream (``"ring"`` or ``"other"``), after the current stream; a non-contiguous local side
(only allowed within a machine) is staged through a contiguous temporary on the same stream.
A handle is a CUDA event on that stream: ``wait`` polls it against the timeout, then orders
the current stream after it.
Barriers run on a third stream after both queues and the current stream (NVSHMEM barriers
also complete every transfer this PE issued), a ``sync`` after the current stream only; groups
are NVSHMEM teams built collectively by ``prepare_groups`` with ``team_split_strided``. ``close`` is collective: it frees every
symmetric tensor and team in creation order, then finalizes NVSHMEM.

Over InfiniBand/EFA NVSHMEM needs the local side of an RMA to be registered memory (an
unregistered source fails in the proxy with IBV_WC_LOC_PROT_ERR): ``check_transfer`` refuses
a local side with a peer on another machine unless it is a contiguous symmetric view.

nvshmem4py is imported lazily: this module imports without it and without a GPU.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import QUEUES, CommTimeout, Handle, OneSided, SymmetricBuffers
from ..log import get_logger

log = get_logger("xfuser_swiftfusion.comm")

UID_BYTES = 128


def nvshmem_modules() -> tuple[ModuleType, ModuleType]:
    """``(nvshmem.core, nvshmem.bindings)``, or an error saying what to install."""
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as exc:
        raise RuntimeError("the nvshmem backend needs nvshmem4py: pip install nvshmem4py-cu13 "
                           f"(import failed: {exc})") from exc
    return core, bindings


def uid_to_bytes(uid: Any) -> bytes:
    """The 128 bytes of an ``nvshmem.core.UniqueID``."""
    raw = uid._data.view(np.int8).tobytes()
    if len(raw) != UID_BYTES:
        raise ValueError(f"NVSHMEM unique id has {len(raw)} bytes, expected {UID_BYTES}")
    return raw


def uid_from_bytes(raw: bytes) -> Any:
    """Inverse of ``uid_to_bytes``."""
    if len(raw) != UID_BYTES:
        raise ValueError(f"NVSHMEM unique id needs {UID_BYTES} bytes, got {len(raw)}")
    core, _ = nvshmem_modules()
    uid = core.get_unique_id(empty=True)
    uid._data.view(np.int8)[:] = np.frombuffer(raw, dtype=np.int8)
    return uid


def broadcast_unique_id(rank: int) -> Any:
    """Collective: rank 0 creates the unique id, every rank returns it."""
    core, _ = nvshmem_modules()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    buf = torch.zeros(UID_BYTES, dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(uid_to_bytes(core.get_unique_id())), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return uid_from_bytes(buf.cpu().numpy().tobytes())


def contiguous_runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """``(byte offset from view.data_ptr(), nbytes)`` of the contiguous blocks of ``view`` in
    logical (row-major) order; their concatenation is ``view.contiguous()``."""
    if view.numel() == 0:
        return []
    dims = [(n, s) for n, s in zip(view.shape, view.stride()) if n != 1]
    block, k = 1, len(dims)
    while k and dims[k - 1][1] == block:
        block *= dims[k - 1][0]
        k -= 1
    outer, es = dims[:k], view.element_size()
    return [(sum(i * s for i, (_, s) in zip(idx, outer)) * es, block * es)
            for idx in itertools.product(*(range(n) for n, _ in outer))]


def team_split_args(group: Sequence[int]) -> tuple[int, int, int]:
    """``(start, stride, size)`` of a group for ``team_split_strided``; it must be strided."""
    ranks = sorted(group)
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if stride < 1 or ranks != [ranks[0] + i * stride for i in range(len(ranks))]:
        raise ValueError(f"NVSHMEM teams need evenly strided ranks, got {tuple(group)}")
    return ranks[0], stride, len(ranks)


class _EventHandle(Handle):
    def __init__(self, comm: "NvshmemCommunicator", event: Any, doing: str, what: str) -> None:
        self._comm, self._event, self._doing, self._what = comm, event, doing, what

    def wait(self) -> None:
        self._comm._await(self._event, self._doing, self._what)


@dataclass(eq=False)
class NvshmemCommunicator(OneSided):
    """One-sided communicator over NVSHMEM on the current CUDA device."""

    _buffers: SymmetricBuffers = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not torch.cuda.is_available():
            raise RuntimeError("the nvshmem backend needs a CUDA GPU (torch.cuda.is_available() "
                               "is False); use the 'shm' backend on CPU")
        if not dist.is_initialized():
            raise RuntimeError("NvshmemCommunicator needs torch.distributed initialised")
        core, self._bindings = nvshmem_modules()
        from cuda.core import Device

        device = Device(torch.cuda.current_device())
        device.set_current()
        core.init(device=device, uid=broadcast_unique_id(self.rank), rank=self.rank,
                  nranks=self.world_size, initializer_method="uid")
        self._core = core
        self._buffers = SymmetricBuffers()
        self._heap_bytes = 0
        self._teams: dict[tuple[int, ...], Any] = {}
        self._streams = {q: torch.cuda.Stream() for q in (*QUEUES, "barrier")}
        self._open = True
        log.info("rank %d: NVSHMEM %s initialised on cuda:%d", self.rank,
                 core.get_version().libnvshmem_version, torch.cuda.current_device())

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self._core.tensor(tuple(shape), dtype=dtype)
        self._buffers.add(t, t)
        self._heap_bytes += t.numel() * t.element_size()
        return t

    def symmetric_heap_bytes(self) -> int:
        return self._heap_bytes

    def _transfer(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, queue: str,
                  what: str) -> Handle:
        sym, local = (dst, src) if op == "put" else (src, dst)
        self.check_transfer(sym, local, peer, queue)
        self._buffers.lookup(sym)
        stream = self._streams[queue]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            staged = local if local.is_contiguous() else (
                local.contiguous() if op == "put" else torch.empty(local.shape, dtype=local.dtype,
                                                                   device=local.device))
            issue = self._bindings.putmem_on_stream if op == "put" else self._bindings.getmem_on_stream
            pos = 0
            for off, n in contiguous_runs(sym):
                far, near = sym.data_ptr() + off, staged.data_ptr() + pos
                issue(*((far, near) if op == "put" else (near, far)), n, peer, stream.cuda_stream)
                pos += n
            if staged is not local and op == "get":
                local.copy_(staged)
            event = torch.cuda.Event()
            event.record(stream)
        local.record_stream(stream)  # the allocator must not reuse it before the queue is done
        self.counter.count(peer, sym.numel() * sym.element_size())
        return _EventHandle(self, event, f"{op} with peer {peer} on queue {queue!r}", what)

    def put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        return self._transfer("put", dst, src, peer, queue, what)

    def get(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        return self._transfer("get", dst, src, peer, queue, what)

    def _await(self, event: Any, doing: str, what: str) -> None:
        """Poll ``event`` until done or the timeout, then order the current stream after it."""
        deadline, delay = time.monotonic() + self.timeout_s, 1e-5
        while not event.query():
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {self.rank}: {what!r}: {doing} did not complete within "
                                  f"{self.timeout_s:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        torch.cuda.current_stream().wait_event(event)

    def _barrier(self, issue: Callable[[int], None], doing: str, what: str, quiet: bool = True) -> None:
        stream = self._streams["barrier"]
        after = (self._streams["ring"], self._streams["other"]) if quiet else ()
        for s in (*after, torch.cuda.current_stream()):
            stream.wait_stream(s)
        issue(stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        self._await(event, doing, what)

    def barrier_all(self, *, what: str) -> None:
        self._barrier(self._bindings.barrier_all_on_stream, "barrier over all ranks", what)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Collective: one NVSHMEM team per distinct group (``None`` on non-members)."""
        for key in dict.fromkeys(tuple(sorted(g)) for g in groups):
            if key in self._teams:
                continue
            start, stride, size = team_split_args(key)
            team = self._core.team_split_strided(self._core.Teams.TEAM_WORLD, start, stride, size,
                                                 self._core.TeamConfig(), 0)
            self._teams[key] = team

    def _team(self, ranks: tuple[int, ...]) -> int:
        key = tuple(sorted(ranks))
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not in group {ranks}")
        if key not in self._teams:
            raise ValueError(f"group {ranks} has no NVSHMEM team: declare it with prepare_groups "
                             "(collective) before the first barrier")
        return int(self._teams[key])

    def barrier(self, ranks: tuple[int, ...], *, what: str) -> None:
        team = self._team(ranks)
        self._barrier(lambda s: self._bindings.barrier_on_stream(team, s),
                      f"barrier over ranks {ranks}", what)

    def sync(self, ranks: tuple[int, ...], *, what: str) -> None:
        """Team sync after the current stream only: gets still queued stay in flight."""
        team = self._team(ranks)
        self._barrier(lambda s: self._bindings.team_sync_on_stream(team, s),
                      f"sync over ranks {ranks}", what, quiet=False)

    def close(self) -> None:
        """Collective: free tensors and teams in creation order, then finalize NVSHMEM."""
        if not getattr(self, "_open", False):
            return
        self._open = False
        torch.cuda.synchronize()
        for t in self._buffers.entries():
            self._core.free_tensor(t)
        self._buffers.clear()
        for team in self._teams.values():
            if team is not None:
                self._core.team_destroy(int(team))
        self._teams.clear()
        self._core.finalize()
