"""Two-sided communicator over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Every ``exchange`` is ONE ``dist.batch_isend_irecv`` call holding all its sends and receives.
On NCCL that call is one NCCL group on the process group's communicator: a send to and a
receive from the same peer progress together, where separate ``isend``/``irecv`` calls would
share a lazily created 2-rank communicator and stream and block until matched, so two ranks
that both post their receive first deadlock (NVIDIA/nccl#479, pytorch#132852). On gloo the call
posts the same operations one by one, without blocking. Within a batch, messages between one
pair of ranks in one direction match in list order.

Each queue (``"ring"``, ``"other"``) has its own process group over all ranks, so ring traffic
and everything else run on two NCCL communicators (one stream each) and overlap. The groups are
created once per default process group, collectively, in ``QUEUES`` order, by the first
communicator; on NCCL their communicators are initialised right then (``device_id`` and a
one-element all-reduce), never lazily by a first batch. Concurrent NCCL communicators need
every rank to issue their operations in one global order: the strategies do (every rank runs
the same schedule).

Waits: on NCCL a handle's ``wait`` orders the current stream after the batch (``Work.wait()``
without a timeout: ``ProcessGroupNCCL`` blocks the host thread whenever a timeout is given) and
returns; a watchdog thread (``watchdog.py``) polls each batch's ``is_completed`` and fails the
communicator when one is not done ``timeout_s`` after it was posted: the next call raises
``CommTimeout`` naming rank, peers and stage. On gloo (CPU tensors) the host is the device, and
``wait`` blocks for at most ``timeout_s``.

Ranks: the communicator's ranks are SP ranks; ``members`` maps them to global ranks (None:
SP rank = global rank). With several SP groups (CFG parallelism) each group's communicator
addresses only its own members on the shared queue groups: point-to-point operations involve
only their two ranks, so the groups never wait on each other.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..log import get_logger
from .base import QUEUES, CommTimeout, Handle, PeerFailure, TwoSided
from .watchdog import Watchdog, abort_process

log = get_logger("xfuser_swiftfusion.comm")

_queue_groups: tuple[Any, dict[str, Any]] | None = None
"""(default process group, queue -> process group over all its ranks) of the current world."""


@atexit.register
def release_queue_groups() -> None:
    """Drops every reference to the queue groups (the holders share one dict). At exit this
    runs before the interpreter's teardown, so groups that ``destroy_process_group`` already
    removed from torch's registry free their threads now: a gloo group still referenced by a
    module when the interpreter tears down can abort the rank ("terminate called without an
    active exception"), after its work is done, failing its torchrun job."""
    global _queue_groups
    if _queue_groups is not None:
        _queue_groups[1].clear()
        _queue_groups = None


def _nccl_device() -> torch.device:
    """The CUDA device the default group is bound to, else the current one."""
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def uses_cuda_streams() -> bool:
    """Whether the default group's point-to-point work runs on CUDA streams (NCCL): then waits
    order streams and a watchdog bounds them; else (gloo) waits block the host."""
    return "nccl" in str(dist.get_backend())


def queue_groups() -> dict[str, Any]:
    """Collective on first use in a world: one process group over all ranks per queue."""
    global _queue_groups
    world = dist.group.WORLD
    if _queue_groups is None or _queue_groups[0] is not world:
        if "nccl" in str(dist.get_backend()):
            device = _nccl_device()
            has_device_id = "device_id" in inspect.signature(dist.new_group).parameters
            eager = {"device_id": device} if has_device_id else {}
            groups = {}
            for q in QUEUES:
                groups[q] = dist.new_group(**eager)
                # creates the group's communicator now on every torch/NCCL version (eager init
                # depends on NCCL's comm split); batches reuse it
                dist.all_reduce(torch.zeros(1, device=device), group=groups[q])
        else:
            groups = {q: dist.new_group() for q in QUEUES}
        _queue_groups = (world, groups)
    return _queue_groups[1]


class _WorkHandle(Handle):
    """Pending works of one batch; on completion, copy staged receives into their targets."""

    __slots__ = ("_comm", "_works", "_unstage", "_peers", "_what", "_stream")

    def __init__(self, comm: "P2PCommunicator", works: list[Any],
                 unstage: list[tuple[torch.Tensor, torch.Tensor]], peers: list[int], what: str,
                 stream: Any = None) -> None:
        self._comm, self._works, self._unstage, self._peers, self._what = comm, works, unstage, peers, what
        self._stream = stream  # the side stream it was issued on (CUDA)

    def wait(self) -> None:
        c = self._comm
        c._check()
        if c._watchdog is not None:  # CUDA: order the current stream, never block the host
            for work in self._works:
                work.wait()
            if c._capturing and self._stream is not None:  # a CUDA graph joins every forked stream
                torch.cuda.current_stream().wait_stream(self._stream)
        else:
            deadline = time.monotonic() + c.timeout_s
            for work in self._works:
                remaining = max(deadline - time.monotonic(), 1e-3)
                try:
                    work.wait(timeout=timedelta(seconds=remaining))
                except RuntimeError as exc:
                    doing = f"{c.who}: {self._what!r}: exchange with peers {self._peers}"
                    if "timed out" in str(exc).lower():
                        raise CommTimeout(f"{doing} did not complete within {c.timeout_s:.1f} s") from exc
                    raise PeerFailure(f"{doing} failed: {exc}") from exc
        for dst, staged in self._unstage:
            dst.copy_(staged)
        self._works, self._unstage = [], []


@dataclass(eq=False)
class P2PCommunicator(TwoSided):
    """``exchange``/``all_to_all`` as one ``batch_isend_irecv`` each, on the queue's group
    (a batch runs on one process group, so both directions between two ranks share it).
    ``members``: global rank of each of its ``world_size`` ranks (None: the default group)."""

    members: tuple[int, ...] | None = None
    _groups: dict[str, Any] = field(init=False, default_factory=dict, repr=False)
    abort_after_s: float | None = field(default=None, init=False)  # None: timeout_s

    def __post_init__(self) -> None:
        super().__post_init__()
        if not dist.is_initialized():
            raise RuntimeError("P2PCommunicator needs torch.distributed initialised")
        members = tuple(self.members) if self.members is not None else tuple(range(self.world_size))
        if len(members) != self.world_size or not 0 <= self.rank < self.world_size \
                or members[self.rank] != dist.get_rank():
            raise ValueError(f"P2PCommunicator: rank {self.rank} of {self.world_size} with members "
                             f"{members} is not global rank {dist.get_rank()}")
        self.members = members
        self.who = (f"rank {self.rank}" if members == tuple(range(dist.get_world_size()))
                    else f"rank {members[self.rank]} (SP rank {self.rank})")
        self._groups = queue_groups()
        self._failure: BaseException | None = None
        self._capturing = False
        self._watchdog: Watchdog | None = None
        self._streams: dict[str, Any] = {}
        if uses_cuda_streams():
            device = _nccl_device()
            self._streams = {q: torch.cuda.Stream(device=device) for q in QUEUES}
            self._watchdog = Watchdog(
                f"swiftfusion-p2p-watchdog-r{dist.get_rank()}", rank=members[self.rank],
                timeout_s=self.timeout_s, device=device.index,
                stuck=f"NCCL kernels on cuda:{device.index} do not return without their peers",
                fail=self._fail, abort_after_s=lambda: (self.abort_after_s if self.abort_after_s
                                                        is not None else self.timeout_s),
                abort=abort_process, log=log)

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc

    def _check(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        super().check()

    @property
    def failure(self) -> BaseException | None:
        return self._failure or self._replay_failure

    def check(self) -> None:
        self._check()

    @contextlib.contextmanager
    def _issue_stream(self, queue: str) -> Iterator[None]:
        """On CUDA, issue on the queue's side stream, ordered after the current (compute) one."""
        stream = self._streams.get(queue)
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    def prepare_exchange(self, sends: list[tuple[torch.Tensor, int]],
                         recvs: list[tuple[torch.Tensor, int]], *, what: str,
                         queue: str = "other") -> Callable[[], Handle]:
        """Every send and receive in one batch on ``queue``'s group; one handle for it. Sends
        and receives with the same peer match in list order; those with myself are copied at
        each post. Sources must stay unchanged until waited."""
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}; expected one of {QUEUES}")
        self._check()
        own_sends = [t for t, p in sends if p == self.rank]
        own_recvs = [t for t, p in recvs if p == self.rank]
        if len(own_sends) != len(own_recvs):
            raise ValueError(f"{self.who}: {what!r}: {len(own_sends)} sends to myself but "
                             f"{len(own_recvs)} receives from myself")
        own = list(zip(own_recvs, own_sends))
        sends = [(t, p) for t, p in sends if p != self.rank]
        recvs = [(t, p) for t, p in recvs if p != self.rank]
        peers = sorted({p for _, p in (*sends, *recvs)})
        for p in peers:
            if not 0 <= p < self.world_size:
                raise ValueError(f"{self.who}: {what!r}: invalid exchange peer {p}")
        group = self._groups[queue]
        ops: list[dist.P2POp] = []
        unstage: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, staging buffer)
        stage: list[tuple[torch.Tensor, torch.Tensor]] = []    # (staging buffer, source)
        for t, p in recvs:
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            ops.append(dist.P2POp(dist.irecv, buf, self.members[p], group))
            if buf is not t:
                unstage.append((t, buf))
        for t, p in sends:
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            ops.append(dist.P2POp(dist.isend, buf, self.members[p], group))
            if buf is not t:
                stage.append((buf, t))
        counts = [(p, t.numel() * t.element_size()) for t, p in sends]
        doing = f"exchange with peers {peers} on queue {queue!r}"

        def post() -> Handle:
            self._check()
            for dst, src in own:
                dst.copy_(src)
            works: list[Any] = []
            with self._issue_stream(queue):
                for buf, src in stage:
                    buf.copy_(src)
                if ops:
                    self.counter.grouped_calls += 1
                    try:
                        works = dist.batch_isend_irecv(ops)
                    except RuntimeError as exc:  # gloo raises at posting time once a peer's socket closed
                        raise PeerFailure(f"{self.who}: {what!r}: posting an exchange with peers "
                                          f"{peers} failed: {exc}") from exc
            for p, n in counts:
                self.counter.count(p, n)
            if self._capturing:  # a captured work cannot be queried: its replays are watched
                self.note_captured(peers, doing, what)
            elif self._watchdog is not None:
                for work in works:
                    self._watchdog.watch(work.is_completed, doing, what)
            return _WorkHandle(self, works, unstage, peers, what, self._streams.get(queue))

        return post


    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], *,
                   what: str, queue: str = "other") -> None:
        """Chunk ``j`` of ``inp`` (dim 0) goes to ``ranks[j]``; chunk ``j`` of ``out`` comes from it."""
        if self.rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"{self.who}: all_to_all group {ranks} must hold distinct "
                             "ranks including mine")
        n = len(ranks)
        if inp.shape != out.shape or inp.shape[0] % n:
            raise ValueError(f"all_to_all over {n} ranks needs equal shapes with dim 0 divisible "
                             f"by {n}, got out {tuple(out.shape)} and inp {tuple(inp.shape)}")
        self.exchange(list(zip(inp.chunk(n), ranks)), list(zip(out.chunk(n), ranks)),
                      what=what, queue=queue).wait()

    def close(self) -> None:
        """Stop the watchdog. The queue groups serve every communicator of this world until
        ``destroy_process_group`` (destroying one is collective); their last references go at
        exit (``release_queue_groups``)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self.stop_watching()
