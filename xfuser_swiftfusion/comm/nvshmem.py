"""NVSHMEM symmetric heap through nvshmem4py (the ``[cu12]`` / ``[cu13]`` extras; GPU only).

One NVSHMEM instance per process (``_Runtime``), shared by every communicator and finalized
once, at exit: the first communicator initialises it (collective: every rank's ``(host, GPU
uuid, device)`` is gathered to refuse two ranks on one GPU, then rank 0's
``nvshmem.core.get_unique_id()``, 128 bytes, is broadcast over torch.distributed and every rank
calls ``nvshmem.core.init(device=, uid=, rank=, nranks=, initializer_method="uid")``; PE ids
equal global ranks; ranks share a GPU only in the GPU suite's test configuration,
``SHARED_GPU_TEST_ENV``); later communicators, also after every earlier one closed, use it as it is
(same rank, world and GPU, or an error: NVSHMEM documents nested init, not init after
finalize). An ``atexit`` handler finalizes it (collective; bounded by ``FINALIZE_TIMEOUT_S``,
then the process ends) unless a failure was recorded. ``finalize`` frees every NVSHMEM buffer
of the process; each communicator frees only its own symmetric tensors and teams at close, in
creation order (both collective).

Available means ``import nvshmem.core`` works (``nvshmem_import_error``): nvshmem4py imports
``cuda.core`` (>= 0.5) and ``cuda.pathfinder``, so a package that is found may still not load.

Device: ``LOCAL_RANK``'s GPU (the only visible one when a process sees one GPU), or the current
device without ``LOCAL_RANK``; a device the caller already chose must be that GPU. Streams are
created on it and every NVSHMEM launch happens inside ``torch.cuda.stream(s)``, which makes
``s``'s device current.

Transfers: a symmetric view is addressed by its local address (symmetric addresses are valid on
every PE) and decomposed into contiguous byte runs. Each queue (``"ring"``, ``"other"``) is a
pool of ``STREAMS_PER_QUEUE`` CUDA streams used in turn, so several transfers are in flight;
transfers of one queue are not ordered among themselves, only after the caller's current stream
at issue. With a peer on my machine each run is ``nvshmemx_{put,get}mem_on_stream`` (a copy
in stream order, no quiet); with a peer on another machine every run is ``..._nbi_on_stream``
and one ``nvshmemx_quiet_on_stream`` completes the transfer (NVSHMEM's quiet is per PE, so a
quiet placed later would also wait for transfers issued after this one). A non-contiguous local
side (only allowed within a machine) is staged through a contiguous buffer on the same stream. A
handle is a CUDA event on that stream: ``wait`` makes the caller's current stream wait on it and
returns without blocking the host. ``prepare`` resolves all of that once (runs, stream, staging
buffer); the issue it returns is what an execution plan's step calls.

Barriers run on their own stream after the caller's current stream and every pool stream used
since the previous barrier (so they quiet first); ``sync`` runs after the current stream only.
Groups are NVSHMEM teams built collectively by ``prepare_groups`` with ``team_split_strided``,
each under a name of its own in nvshmem4py's team registry and destroyed by that name
(``team_destroy(handle)`` unregisters the first registry entry with that value, which can be a
predefined one: ``TEAM_MC_SHARED`` is 6, the first split's handle on one GPU).

CUDA graphs: while a plan is captured (``capturing()``) transfers and barriers are issued as
usual but nothing is watched (a captured event cannot be queried) and every pool stream a
barrier quiets is also joined into the capturing stream directly; each is noted (peers,
stage), and after a replay the plan has one event behind it watched (``watch``), whose timeout
names them. In NVSHMEM's limited multi-process mode (PEs sharing a GPU without MPS) nothing is
captured (``capture_refused``, ``capture_refusal``).

Timeouts: one watchdog thread per communicator (``watchdog.py``) queries the events of transfers and barriers;
one not complete ``timeout_s`` after it was issued fails the communicator: the next call into it
raises ``CommTimeout`` naming rank, peer and stage (into another communicator of the process:
``PeerFailure``). NVSHMEM kernels cannot be cancelled, so a failed process cannot use NVSHMEM
again; if the communicator is not closed within ``abort_after_s`` of the failure (its host
thread may be blocked in a CUDA call behind the stuck kernel, or in a collective teardown a peer
never joins), the watchdog logs the failure and ends the process (exit status 1).

Close: after a failure (``failed`` set, by the watchdog or the caller; or a failure of another
communicator of the process) ``close`` makes no device synchronize and no collective call (free,
team destroy; nor is NVSHMEM finalized at exit): it logs rank and failure and returns. Otherwise it waits (bounded by
``timeout_s``) for its streams and the current stream, then frees its tensors and teams and
releases the instance, under the watchdog.

Over InfiniBand/EFA NVSHMEM needs the local side of an RMA to be registered memory (an
unregistered source fails in the proxy with IBV_WC_LOC_PROT_ERR): ``check_transfer`` refuses
a local side with a peer on another machine unless it is a contiguous symmetric view.

nvshmem4py is imported lazily: this module imports without it and without a GPU.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import QUEUES, CommTimeout, Handle, OneSided, PeerFailure, SymmetricBuffers
from .watchdog import Watchdog, abort_process
from ..log import get_logger, log_once

log = get_logger("xfuser_swiftfusion.comm")

UID_BYTES = 128
STREAMS_PER_QUEUE = 4
_TEAM_NAMES = itertools.count()  # nvshmem4py registry names of this process's teams
FINALIZE_TIMEOUT_S = 60.0  # at exit: a peer that left without finalizing must not hang this one


def nvshmem_modules() -> tuple[ModuleType, ModuleType]:
    """``(nvshmem.core, nvshmem.bindings)``, or an error saying what to install."""
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as exc:
        raise RuntimeError("the nvshmem backend needs nvshmem4py of your CUDA major with "
                           "cuda-core >= 0.5: install xfuser-swiftfusion with its [cu12] or [cu13] "
                           f"extra, docs/install.md (import failed: {exc})") from exc
    return core, bindings


@functools.lru_cache(maxsize=None)
def nvshmem_import_error() -> str | None:
    """Why ``import nvshmem.core`` fails in this process (``ExceptionType: message``), or None
    when it works: the test of nvshmem4py being available (a found package may still fail to
    import, e.g. with ``cuda.core`` older than 0.5 or without ``cuda.pathfinder``)."""
    try:
        nvshmem_modules()
    except Exception as exc:  # noqa: BLE001  (any failure to load means unavailable)
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {cause}"
    return None


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


# -- device of a rank ------------------------------------------------------------------------

def choose_device(rank: int, local_rank: str | None, current: int, count: int,
                  chosen: bool) -> tuple[int, str | None]:
    """``(device index, error or None)`` of this rank: ``LOCAL_RANK``'s GPU (index 0 when the
    process sees one GPU), else the current device. ``chosen``: CUDA is already initialised in
    this process, so the current device is the caller's choice and must be that GPU."""
    if local_rank in (None, ""):
        return current, None
    local = int(local_rank)
    if count > 1 and not 0 <= local < count:
        return current, (f"rank {rank}: LOCAL_RANK={local} but this process sees {count} GPUs "
                         f"(cuda:0..cuda:{count - 1})")
    want = 0 if count == 1 else local
    if chosen and current != want:
        return current, (f"rank {rank}: the current CUDA device is cuda:{current} but LOCAL_RANK="
                         f"{local} selects cuda:{want}: call torch.cuda.set_device({want}) before "
                         "creating CUDA tensors or process groups")
    return want, None


SHARED_GPU_TEST_ENV = "SWIFTFUSION_TEST_ONLY_PES_SHARE_GPU"
"""``=1`` on every rank: let several ranks (PEs) share one GPU. A test configuration of the GPU
suite's ``pe-strategy`` stage (several PEs on the one GPU of a lent machine), never a user
setting: NVSHMEM then runs in its limited multi-process-per-GPU mode unless under CUDA MPS."""


def device_row(index: int, error: str | None) -> tuple[str, str, int, str | None, bool]:
    """What a rank contributes to the device check: ``(host, GPU uuid, index, error, whether
    $SWIFTFUSION_TEST_ONLY_PES_SHARE_GPU=1 here)``."""
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    return socket.gethostname(), uuid, index, error, os.environ.get(SHARED_GPU_TEST_ENV) == "1"


def check_device_rows(rows: Sequence[tuple[str, str, int, str | None, bool]]) -> None:
    """Raise (on every rank alike) if a rank reported an error or two ranks share one GPU:
    several PEs per GPU put NVSHMEM in a limited mode where team barriers on a stream are
    unsupported. Sharing is let through, logged once, only where every rank set
    ``SHARED_GPU_TEST_ENV`` (the test configuration); set on some ranks only, it is an error."""
    errors = [row[3] for row in rows if row[3]]
    if errors:
        raise RuntimeError("NVSHMEM device check failed: " + "; ".join(errors))
    opted = [r for r, row in enumerate(rows) if row[4]]
    if opted and len(opted) != len(rows):
        raise RuntimeError(f"{SHARED_GPU_TEST_ENV}=1 on ranks {opted} but not on the others: it is "
                           "a test configuration (PEs sharing one GPU) that every rank must set, or none")
    seen: dict[tuple[str, ...], int] = {}
    for r, (host, uuid, index, _, share) in enumerate(rows):
        key = ("uuid", uuid) if uuid else ("host", host, str(index))
        if key in seen and share:
            log_once(log, "nvshmem-shared-gpu-test",
                     f"{SHARED_GPU_TEST_ENV}=1: ranks {seen[key]} and {r} share cuda:{index} on "
                     f"{host}: several NVSHMEM PEs on one GPU, a test configuration (without CUDA "
                     "MPS NVSHMEM runs them in its limited mode); never set it for real runs")
        elif key in seen:
            o = seen[key]
            raise RuntimeError(
                f"ranks {o} and {r} share one GPU (rank {o}: cuda:{rows[o][2]} on {rows[o][0]}, "
                f"rank {r}: cuda:{index} on {host}{', uuid ' + uuid if uuid else ''}): NVSHMEM "
                "needs one GPU per rank (several PEs on one GPU have no team barriers on a "
                "stream); set each rank's device from LOCAL_RANK (torch.cuda.set_device)")
        else:
            seen[key] = r


LIMITED_MODE = ("NVSHMEM runs in its limited multi-process mode (init_status() = "
                "STATUS_LIMITED_MPG: PEs share a GPU without MPS), where barrier_all_on_stream "
                "is a host barrier plus a wait on another process's IPC event, which a CUDA "
                "graph cannot capture (the capture error ends every PE); run the PEs under MPS "
                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE summing to at most 100) or one PE per GPU")


def capture_refusal(core: ModuleType) -> str | None:
    """Why work on this process's NVSHMEM instance cannot be captured in a CUDA graph
    (``LIMITED_MODE``), or None. In the limited multi-process mode (``nvshmemx_init_status()``
    = ``NVSHMEM_STATUS_LIMITED_MPG``) ``nvshmemx_barrier_all_on_stream`` synchronizes on the
    host and makes the stream wait on the other PEs' IPC events
    (``src/host/coll/barrier/barrier_on_stream.cpp``): illegal under capture and fatal there
    (``CUDA_RUNTIME_CHECK``); nvshmem4py's binding of it also holds the GIL while it spins."""
    return LIMITED_MODE if core.init_status() == core.InitStatus.STATUS_LIMITED_MPG else None


def _all_gather_object(obj: Any, world_size: int) -> list[Any]:
    """``dist.all_gather_object`` over the default group."""
    rows: list[Any] = [None] * world_size
    dist.all_gather_object(rows, obj)
    return rows


def _cuda_core_device(index: int) -> Any:
    """``cuda.core.Device(index)``, made current (nvshmem4py binds the PE to it)."""
    from cuda.core import Device

    device = Device(index)
    device.set_current()
    return device


def _abort(message: str) -> None:
    """End the process: its NVSHMEM kernels cannot be cancelled and its host thread does not
    come back to see the failure."""
    abort_process(message)


# -- the process's NVSHMEM instance ------------------------------------------------------------

@dataclass
class _Runtime:
    """The process's NVSHMEM instance. ``users`` communicators hold it; initialised by the first
    and kept, as it is, for later ones (same rank, world size and GPU) until the process exits,
    when ``finalize_at_exit`` finalizes it unless a failure was recorded (then never: its
    collectives would wait on kernels that never finish; later communicators are refused)."""

    users: int = 0
    rank: int | None = None
    world_size: int | None = None
    device: int | None = None
    core: ModuleType | None = None  # the nvshmem.core that initialised it (None: not initialised)
    finalized: bool = False
    failure: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def acquire(self, comm: "NvshmemCommunicator", core: ModuleType, error: str | None) -> None:
        """Collective the first time (every rank alike): check the devices of all ranks, then
        initialise NVSHMEM on ``comm.device``. Later: join the instance, which must be this
        communicator's rank, world size and GPU."""
        index = comm.device.index
        with self.lock:
            if self.failure is not None:
                raise PeerFailure(f"rank {comm.rank}: NVSHMEM failed earlier in this process "
                                  f"({self.failure}); it cannot be used again: restart the process")
            if self.finalized:
                raise RuntimeError(f"rank {comm.rank}: NVSHMEM was finalized at exit; it cannot be "
                                   "initialised again in this process")
            if self.core is not None:
                if error:
                    raise RuntimeError(error)
                if (self.rank, self.world_size, self.device) != (comm.rank, comm.world_size, index):
                    raise ValueError(
                        f"rank {comm.rank}: NVSHMEM is initialised in this process as PE "
                        f"{self.rank} of {self.world_size} on cuda:{self.device}; a communicator "
                        f"for rank {comm.rank} of {comm.world_size} on cuda:{index} cannot share it "
                        "(one NVSHMEM instance per process, finalized at exit: NVSHMEM cannot be "
                        "initialised again after a finalize); restart the process")
                self.users += 1
                return
            check_device_rows(_all_gather_object(device_row(index, error), comm.world_size))
            uid = broadcast_unique_id(comm.rank)
            core.init(device=_cuda_core_device(index), uid=uid, rank=comm.rank,
                      nranks=comm.world_size, initializer_method="uid")
            self.users, self.rank, self.world_size, self.device = 1, comm.rank, comm.world_size, index
            self.core = core
        _register_exit_handler()
        log.info("rank %d: NVSHMEM %s initialised on cuda:%d", comm.rank,
                 core.get_version().libnvshmem_version, index)

    def release(self, failure: BaseException | None) -> None:
        """One communicator leaves (the instance stays until exit)."""
        with self.lock:
            self.users -= 1
            if failure is not None:
                self.fail(failure)

    def fail(self, failure: BaseException) -> None:
        """Record the first failure (any thread, without the lock)."""
        if self.failure is None:
            self.failure = failure

    def finalize_at_exit(self, timeout_s: float = FINALIZE_TIMEOUT_S) -> bool:
        """Finalize the instance (collective: every PE at its exit), at most once, unless it was
        never initialised or a failure was recorded; a finalize that does not return within
        ``timeout_s`` ends the process. Returns whether it finalized."""
        with self.lock:
            core = self.core
            if core is None or self.finalized or self.failure is not None:
                return False
            self.finalized = True
        if self.users:
            log.info("rank %s: %d NVSHMEM communicator(s) not closed at exit; finalize frees "
                     "their buffers", self.rank, self.users)
        done = threading.Event()

        def guard() -> None:
            if not done.wait(timeout_s):
                _abort(f"xfuser_swiftfusion: rank {self.rank}: nvshmem finalize at exit did not "
                       f"return within {timeout_s:.0f} s (a PE left without finalizing): ending "
                       "the process")

        threading.Thread(target=guard, daemon=True, name="swiftfusion-nvshmem-finalize").start()
        try:
            core.finalize()
        finally:
            done.set()
        return True


_RUNTIME = _Runtime()
_exit_handler = False


def _finalize_at_exit() -> None:
    """The ``atexit`` handler: finalize the process's NVSHMEM instance (``_Runtime``)."""
    _RUNTIME.finalize_at_exit()


def _register_exit_handler() -> None:
    global _exit_handler
    if not _exit_handler:
        _exit_handler = True
        atexit.register(_finalize_at_exit)


# -- the communicator ----------------------------------------------------------------------------

class _EventHandle(Handle):
    """Completion of one transfer: a CUDA event on its stream."""

    __slots__ = ("_comm", "_event")

    def __init__(self, comm: "NvshmemCommunicator", event: Any) -> None:
        self._comm, self._event = comm, event

    def wait(self) -> None:
        """Order the caller's current stream after the transfer (the host does not block; the
        watchdog bounds it)."""
        self._comm._check()
        self._comm._current_stream().wait_event(self._event)
        self._comm._waited.append(self._event)  # what the next sync orders


def _record_stream(t: torch.Tensor, stream: Any) -> None:
    """The caching allocator must not reuse ``t`` before ``stream`` is done with it."""
    if t.is_cuda:
        t.record_stream(stream)


@dataclass(eq=False)
class NvshmemCommunicator(OneSided):
    """One-sided communicator over NVSHMEM on this rank's GPU (``device``)."""

    _buffers: SymmetricBuffers = field(init=False, repr=False)
    failed: bool = field(default=False, init=False)  # the caller's call failed: close skips collectives
    abort_after_s: float | None = field(default=None, init=False)  # None: timeout_s

    def __post_init__(self) -> None:
        super().__post_init__()
        self._open = False
        if not torch.cuda.is_available():
            raise RuntimeError("the nvshmem backend needs a CUDA GPU (torch.cuda.is_available() "
                               "is False); use the 'shm' backend on CPU")
        if not dist.is_initialized():
            raise RuntimeError("NvshmemCommunicator needs torch.distributed initialised")
        core, self._bindings = nvshmem_modules()
        self._core = core
        index, error = choose_device(self.rank, os.environ.get("LOCAL_RANK"),
                                     torch.cuda.current_device(), torch.cuda.device_count(),
                                     torch.cuda.is_initialized())
        if error is None:
            torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        _RUNTIME.acquire(self, core, error)
        try:
            self._buffers = SymmetricBuffers()
            self._heap_bytes = 0
            self._teams: dict[tuple[int, ...], tuple[str, int] | None] = {}  # (name, handle)
            self._pools = {q: [torch.cuda.Stream(device=self.device)
                               for _ in range(STREAMS_PER_QUEUE)] for q in QUEUES}
            self._turn = dict.fromkeys(QUEUES, 0)
            self._used: dict[int, Any] = {}  # pool streams used since the last barrier, by id
            self._waited: list[Any] = []  # events of transfers waited for since the last sync
            self._barrier_stream = torch.cuda.Stream(device=self.device)
            self._failure: BaseException | None = None
            self._failure_seen = False  # raised to the caller at least once
            self._capturing = False  # a CUDA graph capture is under way: watch nothing
            self._watchdog = Watchdog(
                f"swiftfusion-nvshmem-watchdog-r{self.rank}", rank=self.rank,
                timeout_s=self.timeout_s, device=index,
                stuck=f"NVSHMEM kernels on cuda:{index} cannot be cancelled", fail=self._fail,
                abort_after_s=lambda: (self.abort_after_s if self.abort_after_s is not None
                                       else self.timeout_s),
                abort=lambda message: _abort(message), log=log)
        except BaseException as exc:
            _RUNTIME.release(exc)
            raise
        self._open = True
        self.capture_refused = capture_refusal(core)

    # -- state ---------------------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """What the watchdog found (a transfer, barrier or teardown past ``timeout_s``), or None."""
        return self._failure

    def _fail(self, exc: BaseException) -> None:
        """Record a failure (any thread): every later call raises it; close skips collectives."""
        self._failure = exc
        _RUNTIME.fail(exc)

    def _check(self) -> None:
        """Raise if closed or if this communicator (or another one of the process) failed."""
        if not self._open:
            raise RuntimeError(f"rank {self.rank}: this NVSHMEM communicator is closed")
        if self._failure is not None:
            self._failure_seen = True
            raise type(self._failure)(str(self._failure))
        if _RUNTIME.failure is not None:
            raise PeerFailure(f"rank {self.rank}: NVSHMEM failed in this process: {_RUNTIME.failure}")

    def check(self) -> None:
        self._check()

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    # -- buffers and transfers ---------------------------------------------------------------------

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._check()
        with torch.cuda.device(self.device):
            t = self._core.tensor(tuple(shape), dtype=dtype)
        self._buffers.add(t, t)
        self._heap_bytes += t.numel() * t.element_size()
        return t

    def symmetric_heap_bytes(self) -> int:
        return self._heap_bytes

    def prepare(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str,
                what: str) -> Callable[[], Handle]:
        self._check()
        sym, local = (dst, src) if op == "put" else (src, dst)
        self.check_transfer(sym, local, peer, queue)
        self._buffers.lookup(sym)
        if local.device != sym.device:
            raise ValueError(f"rank {self.rank}: {what!r}: the local side of a {op} is on "
                             f"{local.device}, the communicator's buffers on {sym.device}")
        remote = self.node_of[peer] != self.node_of[self.rank]
        b = self._bindings
        rma = ((b.putmem_nbi_on_stream if op == "put" else b.getmem_nbi_on_stream) if remote
               else (b.putmem_on_stream if op == "put" else b.getmem_on_stream))
        pool = self._pools[queue]
        stream = pool[self._turn[queue]]  # the same stream at every issue of this transfer
        self._turn[queue] = (self._turn[queue] + 1) % len(pool)
        # a non-contiguous local side (only within a machine) goes through a staging buffer
        staged = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype,
                                                                 device=local.device)
        runs, pos = [], 0  # (destination, source, bytes) of each contiguous byte run
        for off, n in contiguous_runs(sym):
            far, near = sym.data_ptr() + off, staged.data_ptr() + pos
            runs.append((far, near, n) if op == "put" else (near, far, n))
            pos += n
        nbytes = sym.numel() * sym.element_size()
        doing = f"{op} with peer {peer} on queue {queue!r}"
        raw, key, used = stream.cuda_stream, id(stream), self._used
        stage_in = staged is not local and op == "put"
        stage_out = staged is not local and op == "get"

        def issue() -> Handle:
            self._check()
            used[key] = stream
            stream.wait_stream(self._current_stream())
            with torch.cuda.stream(stream):
                if stage_in:
                    staged.copy_(local)
                for to, frm, n in runs:
                    rma(to, frm, n, peer, raw)
                if remote:  # nvshmemx_*_nbi_on_stream complete at the next quiet
                    b.quiet_on_stream(raw)
                if stage_out:
                    local.copy_(staged)
                event = torch.cuda.Event()
                event.record(stream)
            self.counter.count(peer, nbytes)
            if self._capturing:  # (a captured plan's tensors outlive its replays)
                self.note_captured((peer,), doing, what)
            else:
                _record_stream(local, stream)
                self._watchdog.watch(event.query, doing, what)
            return _EventHandle(self, event)

        return issue

    # -- barriers ----------------------------------------------------------------------------------

    def prepare_barrier(self, ranks: tuple[int, ...] | None, *, what: str,
                        quiet: bool = True) -> Callable[[], None]:
        """``barrier_all`` / ``barrier`` (``quiet``) or ``sync`` on the barrier stream; the
        current stream then waits for it. A barrier follows the current stream and every pool
        stream used since the previous one; a sync follows only the transfers the caller waited
        for since the last sync or barrier (what it orders), not the compute queued on the
        current stream."""
        self._check()
        b = self._bindings
        if ranks is None:
            doing, nvshmem_call = "barrier over all ranks", b.barrier_all_on_stream
        else:
            team = self._team(ranks)
            doing = f"{'barrier' if quiet else 'sync'} over ranks {ranks}"
            call = b.barrier_on_stream if quiet else b.team_sync_on_stream
            nvshmem_call = functools.partial(call, team)
        stream, raw = self._barrier_stream, self._barrier_stream.cuda_stream

        def barrier() -> None:
            self._check()
            self.counter.barriers += 1
            caller, joined = self._current_stream(), ()
            if quiet:
                joined = tuple(self._used.values())
                for s in joined:
                    stream.wait_stream(s)
                self._used.clear()
                stream.wait_stream(caller)
            else:
                for event in self._waited:
                    stream.wait_event(event)
            self._waited.clear()
            with torch.cuda.stream(stream):
                status = nvshmem_call(raw)
                event = torch.cuda.Event()
                event.record(stream)
            if status:  # nvshmemx_team_sync_on_stream returns a status
                raise RuntimeError(f"rank {self.rank}: {what!r}: {doing} failed with NVSHMEM "
                                   f"status {status}")
            caller.wait_event(event)
            if self._capturing:  # a CUDA graph joins every forked stream into the capturing one
                for s in joined:
                    caller.wait_stream(s)
                self.note_captured(ranks, doing, what)
            else:
                self._watchdog.watch(event.query, doing, what)

        return barrier

    def _after_capture(self) -> None:
        self._waited.clear()  # events of a capture (one that failed mid-layer leaves some)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Collective: one NVSHMEM team per distinct group (``None`` on non-members)."""
        self._check()
        for key in dict.fromkeys(tuple(sorted(g)) for g in groups):
            if key in self._teams:
                continue
            start, stride, size = team_split_args(key)
            name = f"SWIFTFUSION_{next(_TEAM_NAMES)}"
            with torch.cuda.device(self.device):
                team = self._core.team_split_strided(self._core.Teams.TEAM_WORLD, start, stride,
                                                     size, self._core.TeamConfig(), 0,
                                                     new_team_name=name)
            self._teams[key] = None if team is None else (name, int(team))

    def _team(self, ranks: tuple[int, ...]) -> int:
        key = tuple(sorted(ranks))
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not in group {ranks}")
        if key not in self._teams:
            raise ValueError(f"group {ranks} has no NVSHMEM team: declare it with prepare_groups "
                             "(collective) before the first barrier")
        return self._teams[key][1]

    # -- close -------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Wait on the host, at most ``timeout_s``, for every stream of this communicator and the
        caller's current stream."""
        events = []
        for s in (*itertools.chain(*self._pools.values()), self._barrier_stream,
                  self._current_stream()):
            e = torch.cuda.Event()
            e.record(s)
            events.append(e)
        deadline = time.monotonic() + self.timeout_s
        for e in events:
            while not e.query():
                if self._failure is not None:
                    self._failure_seen = True
                    raise type(self._failure)(str(self._failure))
                if time.monotonic() > deadline:
                    late = self._watchdog.oldest_pending()
                    stage = f" (oldest unfinished: {late.what!r}: {late.doing})" if late else ""
                    raise CommTimeout(f"rank {self.rank}: 'close': the NVSHMEM streams on cuda:"
                                      f"{self.device.index} did not drain within "
                                      f"{self.timeout_s:.1f} s{stage}")
                time.sleep(1e-3)

    def _abandon(self, reason: BaseException | str) -> None:
        """Leave after a failure: no device synchronize, no collective call."""
        log.error("rank %d: closing the NVSHMEM communicator on cuda:%d after a failure (%s): "
                  "no device synchronize; symmetric buffers (%d) and teams (%d) are not freed and "
                  "NVSHMEM is not finalized (collective calls would wait on stuck kernels); this "
                  "process cannot use NVSHMEM again", self.rank, self.device.index, reason,
                  len(self._buffers.entries()), sum(t is not None for t in self._teams.values()))
        self._buffers.clear()
        self._teams.clear()
        _RUNTIME.release(reason if isinstance(reason, BaseException)
                         else PeerFailure(f"rank {self.rank}: {reason}"))

    def close(self, failed: bool = False) -> None:
        """Release this communicator (idempotent). After a failure (``failed`` or ``self.failed``:
        the caller's; ``failure``: the watchdog's; or one of another communicator of the process)
        return without device synchronize or collective call; a watchdog failure that neither the
        caller reported nor a call raised is raised after that. Else collective: free tensors and
        teams in creation order (NVSHMEM itself is finalized at exit)."""
        if not getattr(self, "_open", False):
            return
        self._open = False
        self.failed = self.failed or failed
        if self.failed or self._failure is not None or _RUNTIME.failure is not None:
            self._watchdog.stop()
            unseen = None if self._failure_seen or self.failed else self._failure
            self._abandon(self._failure or _RUNTIME.failure or "the caller reported a failed call")
            if unseen is not None:
                raise type(unseen)(str(unseen))
            return
        try:
            self._drain()
        except (CommTimeout, PeerFailure) as exc:
            self._watchdog.stop()
            self._abandon(exc)
            raise
        # the watchdog bounds the collective teardown too: a peer that left meanwhile never
        # joins the barriers inside free, and this thread cannot leave them
        finished = threading.Event()
        self._watchdog.watch(finished.is_set, "collective teardown (free, team destroy) with "
                             "every rank", "close")
        ok = False
        try:
            torch.cuda.synchronize(self.device)
            with torch.cuda.device(self.device):
                for t in self._buffers.entries():
                    self._core.free_tensor(t)
                for team in self._teams.values():
                    if team is not None:
                        self._core.team_destroy(team[0])  # by name (module docstring)
            ok = True
        finally:
            self._buffers.clear()
            self._teams.clear()
            try:
                _RUNTIME.release(None if ok else PeerFailure(
                    f"rank {self.rank}: freeing NVSHMEM buffers or teams failed"))
            finally:
                finished.set()
                self._watchdog.stop()
