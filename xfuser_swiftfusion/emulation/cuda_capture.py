"""CPU stand-in of CUDA stream capture: plans "captured" and "replayed" on CPU tensors under
CUDA's rules of capture, so a test without a GPU fails where a GPU would.

``install()`` replaces, in this process, ``torch.cuda.Stream / current_stream / stream /
Event / CUDAGraph / graph / synchronize`` with the fakes below, lets ``PlanCache`` capture
plans on CPU tensors (``planned.graph_device``), and puts the two-sided communicator on the
code path it takes over NCCL (side streams, a watchdog polling each work's ``is_completed``,
waits that order streams) with gloo underneath. ``uninstall()`` undoes it. With
``limited_mpg=True`` the ``shm`` heap also behaves as NVSHMEM's limited multi-process mode
(``LimitedBarriers``).

The rules, read from the sources (CUDA runtime documentation of stream capture, PyTorch's
``torch/cuda/graphs.py`` and ``ProcessGroupNCCL.cpp``, NVSHMEM's
``src/host/coll/barrier/barrier_on_stream.cpp``):

- an event last recorded in a capturing stream cannot be queried, synchronized or waited on
  outside that capture (``cudaErrorCapturedEvent``, 907), from any thread, also after the
  capture ended; NCCL's ``WorkNCCL::isCompleted`` queries its end event, so a work issued
  while capturing cannot be polled (``StandInWork``);
- a capturing stream may not wait on an event recorded outside the capture
  (``cudaErrorStreamCaptureIsolation``, 905); a stream that waits on an event of the capture
  joins it, and every stream that joined must be joined back into the origin stream before
  ``capture_end`` (``cudaErrorStreamCaptureUnjoined``, 904);
- the capturing thread may not synchronize with the host (``torch.cuda.synchronize``,
  ``Event.synchronize``, ``Stream.synchronize``, ``.item()``, a ``Work.wait`` with a timeout,
  which blocks the host in ``ProcessGroupNCCL``) (``cudaErrorStreamCaptureUnsupported``, 900);
- an illegal call invalidates the capture: ``capture_end`` then raises
  (``cudaErrorStreamCaptureInvalidated``, 901). ``graph.__exit__`` calls ``capture_end``
  before it leaves its stream context, as torch's does, so a failed capture leaves the thread
  on the capture stream; a failed capture also leaves that stream marked as capturing for the
  allocator (``allocator_capturing``: torch 2.9-2.11 keep their capture state);
- a graph reads and writes the memory its capture used: a tensor allocated before the capture
  and freed before a replay is an error at that replay (the graph's own allocations live in its
  private pool).

What runs: a capture runs the plan's steps once (a CPU cannot defer them; every rank captures
at the same call, so transfers still match) and records the plans (``Plan.run_steps``) it ran;
``replay`` runs those steps again as the GPU would run the graph: without the host-side effects
a replay does not have (byte counters, ``attend_calls``, the communicators' integer
attributes such as ``copies``, and watchdog registrations stay as they are: the plan cache adds
what the capture counted).
A step that fails during a replay (a peer died) leaves the device stuck, as a kernel waiting on
a dead peer: events recorded after it never complete and later replays do nothing, and the
watchdog of the event recorded behind the replay reports it. ``STATS`` counts captures and
replays.

Not modelled (only a GPU shows them): kernels' own legality under capture (a triton or cuDNN
launch that cannot be captured), the memory pools themselves, NCCL's and NVSHMEM's device-side
behaviour in a graph, timing.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CAPTURED_EVENT = ("CUDA error: operation not permitted on an event last recorded in a capturing "
                  "stream (cudaErrorCapturedEvent, 907)")
UNSUPPORTED = ("CUDA error: operation not permitted when stream is capturing "
               "(cudaErrorStreamCaptureUnsupported, 900)")
INVALIDATED = ("CUDA error: operation failed due to a previous error during capture "
               "(cudaErrorStreamCaptureInvalidated, 901)")
UNJOINED = "CUDA error: capturing stream has unjoined work (cudaErrorStreamCaptureUnjoined, 904)"
ISOLATION = ("CUDA error: dependency created on uncaptured work in another stream "
             "(cudaErrorStreamCaptureIsolation, 905)")
FREED = ("CUDA graph replay: memory the capture used was freed since (a tensor allocated before "
         "the capture and released before the graph's replays)")


class CaptureRuleError(RuntimeError):
    """What CUDA would raise (the message names the CUDA error)."""


@dataclass
class Stats:
    captures: int = 0
    failed_captures: int = 0
    replays: int = 0
    violations: list = None  # messages of the rules broken, in order

    def __post_init__(self) -> None:
        self.violations = []


STATS = Stats()
_local = threading.local()
_lock = threading.Lock()
_device = {"stuck": None}  # the exception a replay's step raised: the device never finishes


def _violate(message: str, capture: "_Capture | None" = None) -> CaptureRuleError:
    STATS.violations.append(message)
    if capture is not None and capture.invalid is None:
        capture.invalid = message
    return CaptureRuleError(message)


class _Capture:
    def __init__(self, graph: "StandInGraph", origin: "StandInStream", mode: str) -> None:
        self.graph, self.origin, self.mode = graph, origin, mode
        self.thread = threading.get_ident()
        self.invalid: str | None = None
        self.active = True
        self.joined: dict[int, int] = {}  # stream id -> its work joined into the origin
        self.streams: dict[int, StandInStream] = {id(origin): origin}


class StandInStream:
    """A CUDA stream: ``capture`` (the capture it belongs to), ``work`` (ops issued on it)."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")
        self.capture: _Capture | None = None
        self.work = 0
        self.cuda_stream = id(self)

    def wait_event(self, event: "StandInEvent") -> None:
        capture = event.capture
        if capture is not None:
            if not capture.active:
                raise _violate(CAPTURED_EVENT)
            if self.capture is None:  # fork: the stream joins the capture
                self.capture = capture
                capture.streams[id(self)] = self
                capture.joined[id(self)] = self.work
            elif self.capture is not capture:
                raise _violate(ISOLATION, self.capture)
            if event.stream is not None and self is capture.origin:
                key = id(event.stream)
                capture.joined[key] = max(capture.joined.get(key, 0), event.seq)
        elif self.capture is not None and event.recorded:
            # a capturing stream waits on work recorded outside the capture (an IPC event, an
            # event of earlier work): CUDA needs cudaEventWaitExternal for that
            raise _violate(ISOLATION, self.capture)

    def wait_stream(self, other: "StandInStream") -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: "StandInEvent | None" = None) -> "StandInEvent":
        event = event or StandInEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        if self.capture is not None:
            raise _violate(UNSUPPORTED, self.capture)
        return _device["stuck"] is None

    def synchronize(self) -> None:
        _host_sync()
        if self.capture is not None:
            raise _violate(UNSUPPORTED, self.capture)

    def __enter__(self):  # torch.cuda.Stream is also a context manager
        self._ctx = StreamContext(self)
        return self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


_default = StandInStream()


def current_stream(device: Any = None) -> StandInStream:
    return getattr(_local, "stream", _default)


def set_stream(stream: StandInStream) -> None:
    _local.stream = stream


class StreamContext:
    """``torch.cuda.stream(s)``: current stream ``s`` inside, the previous one restored at
    exit (torch's ``StreamContext``)."""

    def __init__(self, stream: StandInStream | None) -> None:
        self.stream, self.prev = stream, None

    def __enter__(self) -> StandInStream | None:
        if self.stream is None:
            return None
        self.prev = current_stream()
        set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            set_stream(self.prev)


class StandInEvent:
    """A CUDA event: ``capture`` (the capture it was last recorded in), ``stuck`` (recorded
    behind work that never completes)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.capture: _Capture | None = None
        self.stream: StandInStream | None = None
        self.recorded, self.seq, self.stuck = False, 0, False

    def record(self, stream: StandInStream | None = None) -> None:
        stream = stream or current_stream()
        self.recorded, self.stream, self.seq = True, stream, stream.work
        self.capture = stream.capture
        self.stuck = _device["stuck"] is not None

    def query(self) -> bool:
        if self.capture is not None:
            raise _violate(CAPTURED_EVENT, self.capture if self.capture.active else None)
        return not self.stuck

    def synchronize(self) -> None:
        if self.capture is not None:
            raise _violate(CAPTURED_EVENT, self.capture if self.capture.active else None)
        _host_sync()
        if self.stuck:
            raise CaptureRuleError("stand-in: Event.synchronize on work that never completes "
                                   "(a replay is stuck on a peer): a GPU would block forever")

    def wait(self, stream: StandInStream | None = None) -> None:
        (stream or current_stream()).wait_event(self)


def _thread_capture() -> _Capture | None:
    """The capture under way that this thread may not break (its own; any in global mode)."""
    capture = current_stream().capture
    if capture is not None and capture.active:
        return capture
    return getattr(_local, "capture", None)


def _host_sync() -> None:
    capture = _thread_capture()
    if capture is not None and capture.active:
        raise _violate(UNSUPPORTED, capture)


def synchronize(device: Any = None) -> None:
    _host_sync()


class _CaptureMode(TorchDispatchMode):
    """During a capture: ops count as work of the current stream; ``.item()`` is a host
    synchronisation; storages the capture uses that it did not allocate are remembered."""

    def __init__(self, graph: "StandInGraph") -> None:
        super().__init__()
        self.graph = graph
        self.own: set[int] = set()  # storages allocated during the capture (the graph's pool)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = current_stream()
        if func is torch.ops.aten._local_scalar_dense.default:
            raise _violate(UNSUPPORTED, stream.capture)
        flat, _ = tree_flatten((args, kwargs or {}))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.own and key not in self.graph._seen:
                    self.graph._seen.add(key)
                    self.graph._used.append(StorageWeakRef(storage))
        stream.work += 1
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                key = t.untyped_storage().data_ptr()
                if key not in self.graph._seen:
                    self.own.add(key)
        return out


class StandInGraph:
    """``torch.cuda.CUDAGraph``: ``capture_begin`` / ``capture_end`` on the current stream,
    ``replay`` (module docstring)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.plans: list = []
        self.replays = 0
        self._capture: _Capture | None = None
        self._mode: _CaptureMode | None = None
        self._used: list[StorageWeakRef] = []
        self._seen: set[int] = set()
        self.captured = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **_: Any) -> None:
        stream = current_stream()
        if stream is _default:
            raise CaptureRuleError("CUDA error: operation not supported on the legacy default "
                                   "stream (capture on a side stream)")
        if stream.capture is not None:
            raise _violate(UNSUPPORTED, stream.capture)
        capture = self._capture = _Capture(self, stream, capture_error_mode)
        stream.capture = capture
        if capture_error_mode == "global":
            _local.capture = capture
        allocator_capturing.add(id(stream))
        self._mode = _CaptureMode(self)
        self._mode.__enter__()
        _local.graphs = getattr(_local, "graphs", []) + [self]

    def capture_end(self) -> None:
        capture = self._capture
        if capture is None:
            raise RuntimeError("capture_end without capture_begin")
        self._mode.__exit__(None, None, None)
        _local.graphs = [g for g in getattr(_local, "graphs", []) if g is not self]
        _local.capture = None
        capture.active = False
        unjoined = [s for k, s in capture.streams.items()
                    if s is not capture.origin and s.work > capture.joined.get(k, 0)]
        for s in capture.streams.values():
            s.capture = None
        if capture.invalid is None and current_stream() is not capture.origin:
            capture.invalid = "CUDA error: capture_end on a stream other than the capturing one"
        if capture.invalid is None and unjoined:
            capture.invalid = _violate(UNJOINED).args[0]
        if capture.invalid is not None:
            STATS.failed_captures += 1
            # torch 2.9-2.11: the allocator still routes the stream's allocations to the capture
            raise CaptureRuleError(INVALIDATED if capture.invalid != UNJOINED else UNJOINED)
        allocator_capturing.discard(id(capture.origin))
        self.captured = True
        STATS.captures += 1

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("CUDA graph replay before a successful capture")
        _host_sync_free_check = _thread_capture()
        if _host_sync_free_check is not None:
            raise _violate(UNSUPPORTED, _host_sync_free_check)
        if any(ref.expired() for ref in self._used):
            raise CaptureRuleError(FREED)
        self.replays += 1
        STATS.replays += 1
        if _device["stuck"] is not None:
            return  # queued behind work that never completes
        with replaying():
            try:
                for p in self.plans:
                    p.run_steps()
            except BaseException as exc:  # noqa: BLE001  (a kernel waiting on a dead peer)
                _device["stuck"] = exc

    def reset(self) -> None:
        self.plans, self.captured = [], False

    def pool(self) -> tuple:
        return (id(self),)


allocator_capturing: set[int] = set()
"""Streams the allocator believes capture (a failed capture leaves its stream here)."""


class graph:  # noqa: N801  (torch.cuda.graph's name)
    """``torch.cuda.graph``, as torch's: ``__enter__`` synchronizes, enters the capture
    stream's context, then ``capture_begin``; ``__exit__`` calls ``capture_end`` and only then
    leaves the stream context (so a failing ``capture_end`` leaves the thread on it)."""

    default_capture_stream: StandInStream | None = None

    def __init__(self, cuda_graph: StandInGraph, pool: Any = None, stream: StandInStream | None = None,
                 capture_error_mode: str = "global", **_: Any) -> None:
        if stream is None and self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = StandInStream()
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.stream_ctx = StreamContext(self.capture_stream)
        self.cuda_graph, self.capture_error_mode = cuda_graph, capture_error_mode

    def __enter__(self) -> None:
        synchronize()
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(capture_error_mode=self.capture_error_mode)

    def __exit__(self, *args: object) -> None:
        self.cuda_graph.capture_end()
        self.stream_ctx.__exit__(*args)


def capturing_graph() -> StandInGraph | None:
    """The graph this thread is capturing, if any."""
    graphs = getattr(_local, "graphs", [])
    return graphs[-1] if graphs else None


def is_replaying() -> bool:
    return getattr(_local, "replaying", False)


@contextlib.contextmanager
def replaying():
    """A replay runs: the host-side effects of the steps' Python are not a replay's."""
    from ..kernels import dispatch
    _local.replaying = True
    calls = dispatch.attend_calls()
    try:
        yield
    finally:
        _local.replaying = False
        dispatch.add_attend_calls(calls - dispatch.attend_calls())


class StandInWork:
    """A two-sided work as ``ProcessGroupNCCL``'s: its end event recorded on the issuing
    stream; ``is_completed`` queries that event (907 for a work issued while capturing);
    ``wait()`` orders the current stream after it (and, on CPU, waits for gloo's work);
    ``wait(timeout)`` blocks the host (illegal while capturing)."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.end = StandInEvent()
        self.end.record()

    def is_completed(self) -> bool:
        if not self.end.query():
            return False
        return self.work.is_completed()

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            _host_sync()
            if self.end.capture is not None:
                raise _violate(CAPTURED_EVENT)
        current_stream().wait_event(self.end)
        if _device["stuck"] is not None and not is_replaying():
            return True  # the device never gets there; the host does not wait
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class LimitedBarriers:
    """The ``shm`` heap's barriers as NVSHMEM's ``barrier_all_on_stream`` in its limited
    multi-process mode: a host barrier, then the stream waits on the other PEs' IPC events
    (recorded outside any capture), so a capture of it breaks the isolation rule."""

    @staticmethod
    def wrap(prepare_barrier):
        def prepare(self, ranks=None, *, what, quiet=True):
            barrier = prepare_barrier(self, ranks, what=what, quiet=quiet)

            def limited() -> None:
                barrier()  # the host barrier
                ipc = StandInEvent()
                with StreamContext(_default):
                    ipc.record()  # another process's event: not part of this capture
                current_stream().wait_event(ipc)
            return limited
        return prepare


_saved: list[tuple[object, str, object]] = []


def _patch(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def installed() -> bool:
    return bool(_saved)


def install(limited_mpg: bool = False) -> None:
    """Install the stand-in in this process (module docstring); idempotent. ``limited_mpg``:
    the ``shm`` heap also acts as NVSHMEM's limited multi-process mode."""
    if _saved:
        return
    import torch.distributed as dist

    from .. import plan
    from ..comm import base, p2p, watchdog
    from ..comm.nvshmem import LIMITED_MODE
    from ..strategies import planned
    from . import shm

    cuda = torch.cuda
    for name, value in (("Stream", StandInStream), ("Event", StandInEvent),
                        ("CUDAGraph", StandInGraph), ("graph", graph),
                        ("synchronize", synchronize), ("current_stream", current_stream),
                        ("set_stream", set_stream), ("stream", StreamContext)):
        _patch(cuda, name, value)
    if hasattr(planned, "graph_device"):
        _patch(planned, "graph_device", lambda device: True)
    else:  # a plan cache without graph_device (older code): CPU tensors as CUDA ones
        _patch(planned.PlanCache, "_graphs_on", lambda self, device: self.graphs is not False)
    _patch(p2p, "uses_cuda_streams", lambda: True)
    _patch(p2p, "_nccl_device", lambda: torch.device("cpu"))
    batch = dist.batch_isend_irecv
    _patch(dist, "batch_isend_irecv", lambda ops: [StandInWork(w) for w in batch(ops)])

    run_steps = plan.Plan.run_steps

    def run_steps_recorded(self) -> None:
        g = capturing_graph()
        if g is not None and not is_replaying():
            g.plans.append(self)
        run_steps(self)
    _patch(plan.Plan, "run_steps", run_steps_recorded)

    watch = watchdog.Watchdog.watch

    def watch_unless_replaying(self, done, doing, what) -> None:
        if not is_replaying():
            watch(self, done, doing, what)
    _patch(watchdog.Watchdog, "watch", watch_unless_replaying)

    counter_setattr = base.ByteCounter.__setattr__

    def counted(self, name: str, value: object) -> None:
        if not is_replaying():
            counter_setattr(self, name, value)
    _patch(base.ByteCounter, "__setattr__", counted)
    comm_setattr = base.Communicator.__setattr__

    def comm_counted(self, name: str, value: object) -> None:
        # a GPU replay runs no Python: the host-side counts of a communicator (``copies`` of
        # the replay stage's) stay as they are unless the plan cache adds them
        if not (is_replaying() and type(value) is int):
            comm_setattr(self, name, value)
    _patch(base.Communicator, "__setattr__", comm_counted)

    if limited_mpg:
        _patch(shm.ShmCommunicator, "capture_refused", LIMITED_MODE)
        _patch(shm.ShmCommunicator, "prepare_barrier",
               LimitedBarriers.wrap(shm.ShmCommunicator.prepare_barrier))


@contextlib.contextmanager
def active(limited_mpg: bool = False):
    """The stand-in installed for the body (left as it was found after)."""
    mine = not installed()
    if mine:
        install(limited_mpg)
    try:
        yield
    finally:
        if mine:
            uninstall()


def uninstall() -> None:
    """Undo ``install`` and reset the device, captures and counts."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
    reset()


def reset() -> None:
    """A fresh device: nothing stuck, no capture state, counts at 0."""
    _device["stuck"] = None
    allocator_capturing.clear()
    graph.default_capture_stream = None
    STATS.captures = STATS.failed_captures = STATS.replays = 0
    STATS.violations = []
    _local.__dict__.clear()


__all__ = ["CAPTURED_EVENT", "active", "CaptureRuleError", "FREED", "INVALIDATED", "ISOLATION",
           "LimitedBarriers", "STATS", "StandInEvent", "StandInGraph", "StandInStream",
           "StandInWork", "UNJOINED", "UNSUPPORTED", "allocator_capturing", "current_stream",
           "graph", "install", "installed", "is_replaying", "reset", "uninstall"]
