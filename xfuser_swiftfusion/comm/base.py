"""The communicator contract every strategy is written against.

Two families share one byte accounting:

- ``OneSided`` (``shm`` on CPU, ``nvshmem`` on GPU): symmetric buffers allocated
  collectively (same shape/dtype/order on every rank of the communicator), ``put`` of a
  local tensor into a peer's copy of a symmetric buffer, ``get`` of a peer's copy into a
  local tensor (across machines the local tensor must be symmetric too: NVSHMEM's
  InfiniBand/EFA transports need registered memory), both asynchronous on a named queue
  (``"ring"`` or ``"other"``; a small pool of CUDA streams on GPU, a copy thread on CPU) and completed by
  ``Handle.wait``. ``barrier_all`` and ``barrier(ranks)`` also complete every transfer the
  caller issued before them (quiet), so data put before a barrier is visible to its target
  after the barrier; ``sync(ranks)`` is the rendezvous alone (NVSHMEM's team sync):
  transfers still in flight stay in flight, so a pipeline of gets is not drained by it.
- ``TwoSided`` (``p2p``): ``exchange`` of tensors with matching sends/receives, and
  ``all_to_all``, over torch.distributed (NCCL on GPU, gloo on CPU), on the same named queues
  (one process group each). An exchange posts all its sends and receives as one grouped
  operation: NCCL blocks a send until its receive is posted, so a rank's send to and receive
  from one peer must progress together.

Every wait takes ``what`` (a stage name such as ``"Pull-KV stage 2"``) and raises
``CommTimeout`` naming this rank, the peer(s) and the stage when ``timeout_s`` passes.
Ranks are global ranks of the default process group.

Prepared calls (``plan.py``): each transfer, exchange and barrier is ``prepare...`` (checked
and resolved once: byte runs, peers, streams, process groups) and then issued by calling the
result; ``put``, ``get``, ``exchange``, ``barrier_all``, ``barrier`` and ``sync`` are those two
steps, recorded as a plan's step while a layer compiles. On CUDA, waits order streams and
never block the host; a watchdog thread bounds them (``watchdog.py``). While a CUDA graph is
captured (``capturing()``) nothing captured is watched (an event or NCCL work recorded in a
capture cannot be queried) and each transfer and barrier issued is noted (peers, stage);
``watch(event, what, doing)`` watches one event recorded after a replay instead, and
``check()`` raises what a watchdog found (a replay runs no Python of the communicator that
would). ``capture_refused``: why this communicator's work cannot be captured (None: it can).
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch

from .. import plan
from .errors import CommTimeout, PeerFailure

QUEUES = ("ring", "other")


@dataclass
class ByteCounter:
    """Payload bytes of the transfers this rank initiated, split by machine of the peer.

    Two-sided: bytes this rank sent. One-sided: bytes of this rank's ``put`` (me -> peer)
    and ``get`` (peer -> me), counted once, by the initiator, when the transfer is issued.
    For the symmetric schedules of the strategies (every rank pulls/pushes what its peers
    pull/push) this equals each rank's outgoing volume.
    """

    node_of: list[int]
    rank: int
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    messages: int = 0         # transfers with other ranks: puts, gets, sends
    grouped_calls: int = 0    # two-sided: grouped exchanges posted (one batch_isend_irecv each)
    barriers: int = 0         # one-sided: barrier_all, barrier and sync calls

    def count(self, peer: int, nbytes: int) -> None:
        if peer == self.rank:
            return
        self.messages += 1
        if self.node_of[peer] == self.node_of[self.rank]:
            self.intra_node_bytes += nbytes
        else:
            self.inter_node_bytes += nbytes

    def reset(self) -> None:
        self.intra_node_bytes = self.inter_node_bytes = self.messages = 0
        self.grouped_calls = self.barriers = 0


class Handle(abc.ABC):
    """Completion of one asynchronous transfer (or a batch of them)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until complete; raise ``CommTimeout``/``PeerFailure`` with context."""


@dataclass
class Communicator(abc.ABC):
    """State common to all backends: who we are, where peers live, timeouts, counters."""

    rank: int
    world_size: int
    node_of: list[int]
    timeout_s: float
    counter: ByteCounter = field(init=False)

    def __post_init__(self) -> None:
        self.counter = ByteCounter(self.node_of, self.rank)

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource (idempotent; also called on errors)."""

    _capturing = False  # a CUDA graph capture is under way (``capturing``)
    _watchdog = None    # the watchdog thread of a backend that bounds GPU work (watchdog.py)
    _captured = None  # list: what was issued during the capture under way (``note_captured``)
    _replay_watchdog = None  # a backend without a watchdog of its own: the one watching replays
    _replay_failure = None  # what that one found
    # (class attributes, not dataclass fields) why this communicator's work cannot be captured
    # in a CUDA graph (None: it can); the int attributes a replay advances (``planned.py``)
    capture_refused: ClassVar[str | None] = None
    replay_counts: ClassVar[tuple[str, ...]] = ()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list]:
        """A CUDA graph is being captured on the current stream: issue as usual, watch nothing
        (a captured event cannot be queried). Yields the list of what is issued meanwhile:
        ``(peers or None for all ranks, doing, stage)`` (``note_captured``)."""
        issued: list = []
        self._capturing, self._captured = True, issued
        try:
            yield issued
        finally:
            self._capturing, self._captured = False, None
            self._after_capture()

    def note_captured(self, peers: Sequence[int] | None, doing: str, what: str) -> None:
        """Note a transfer or barrier issued while capturing (what its replays will do)."""
        if self._captured is not None:
            self._captured.append((None if peers is None else tuple(peers), doing, what))

    def _after_capture(self) -> None:
        """Drop what a capture left behind (a backend's own state)."""

    def watch(self, event: Any, what: str,
              doing: str = "a CUDA graph replay (its transfers and barriers)") -> None:
        """Bound ``event`` (recorded after a CUDA graph replay holding this communicator's
        work) by ``timeout_s``, as the transfers it stands for: ``doing`` names their peers
        and stages, ``what`` the layer. A backend without a watchdog of its own (its waits
        block the host) gets one for replays: a replay's waits are on the device."""
        dog = self._watchdog if self._watchdog is not None else self._replays_watched()
        dog.watch(event.query, doing, what)

    def _replays_watched(self):
        if self._replay_watchdog is None:
            from ..log import get_logger
            from .watchdog import Watchdog, abort_process  # (watchdog needs only .errors)

            def fail(exc: BaseException) -> None:
                self._replay_failure = exc
            self._replay_watchdog = Watchdog(
                f"swiftfusion-replay-watchdog-r{self.rank}", rank=self.rank,
                timeout_s=self.timeout_s, device=None,
                stuck="the replay's kernels wait on it and cannot be cancelled", fail=fail,
                abort_after_s=lambda: self.timeout_s, abort=abort_process,
                log=get_logger("xfuser_swiftfusion.comm"))
        return self._replay_watchdog

    def stop_watching(self) -> None:
        """Stop the replays' watchdog, if any (close calls it)."""
        if self._replay_watchdog is not None:
            self._replay_watchdog.stop()

    @property
    def failure(self) -> BaseException | None:
        """What a watchdog found (a replay, transfer or barrier past ``timeout_s``), or None."""
        return self._replay_failure

    def check(self) -> None:
        """Raise what a watchdog found, if anything."""
        failure = self.failure
        if failure is not None:
            raise type(failure)(str(failure))

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OneSided(Communicator):
    """Symmetric-heap put/get (NVSHMEM semantics)."""

    _buffers: "SymmetricBuffers"  # every backend registers its symmetric buffers here
    # set by the owner after a failed call: close() then makes no collective call (peers may
    # be mid-layer) and no device synchronize (their kernels may spin forever)
    failed: bool = False

    @abc.abstractmethod
    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Collective: allocate a symmetric buffer; return this rank's copy."""

    @abc.abstractmethod
    def prepare(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str,
                what: str) -> Callable[[], Handle]:
        """A ``put`` (``op="put"``) or ``get``, checked and resolved now; each call of the result
        issues it and returns its handle. ``dst``, ``src`` must outlive every issue."""

    @abc.abstractmethod
    def prepare_barrier(self, ranks: tuple[int, ...] | None, *, what: str,
                        quiet: bool = True) -> Callable[[], None]:
        """``barrier_all`` (``ranks`` None), ``barrier(ranks)`` or, without ``quiet``,
        ``sync(ranks)``, resolved now; each call of the result performs it."""

    def put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        """Copy local ``src`` into ``peer``'s copy of ``dst`` (a view of a symmetric buffer)."""
        with plan.preparing():
            issue = self.prepare("put", dst, src, peer, queue=queue, what=what)
        return plan.issue(issue)

    def get(self, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str, what: str) -> Handle:
        """Copy ``peer``'s copy of ``src`` (a view of a symmetric buffer) into local ``dst``."""
        with plan.preparing():
            issue = self.prepare("get", dst, src, peer, queue=queue, what=what)
        return plan.issue(issue)

    def barrier_all(self, *, what: str) -> None:
        """Quiet my transfers, then wait for every rank."""
        self._barrier(None, what, True)

    def barrier(self, ranks: tuple[int, ...], *, what: str) -> None:
        """Quiet my transfers, then wait for ``ranks`` (which include me)."""
        self._barrier(tuple(ranks), what, True)

    def sync(self, ranks: tuple[int, ...], *, what: str) -> None:
        """Wait for ``ranks`` (which include me) without quieting my transfers: only what I
        completed (``Handle.wait``) before it is visible to them after it."""
        self._barrier(tuple(ranks), what, False)

    def _barrier(self, ranks: tuple[int, ...] | None, what: str, quiet: bool) -> None:
        with plan.preparing():
            step = self.prepare_barrier(ranks, what=what, quiet=quiet)
        plan.call(step)

    @abc.abstractmethod
    def symmetric_heap_bytes(self) -> int:
        """Bytes of symmetric memory this rank holds."""

    def prepare_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Collective over all ranks (same list everywhere): declare every group later passed
        to ``barrier``. Backends needing per-group state (NVSHMEM teams) build it here."""

    def check_transfer(self, sym: torch.Tensor, local: torch.Tensor, peer: int, queue: str) -> None:
        """Validate a put/get before it is queued (shared by every backend). Within a machine
        the local side may be any tensor; across machines it must be symmetric too."""
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}; expected one of {QUEUES}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer {peer} out of range for world size {self.world_size}")
        if sym.shape != local.shape or sym.dtype != local.dtype:
            raise ValueError(f"put/get needs equal shape and dtype, got symmetric "
                             f"{tuple(sym.shape)} {sym.dtype} and local {tuple(local.shape)} {local.dtype}")
        if self.node_of[peer] != self.node_of[self.rank] and not (
                local.is_contiguous() and self._buffers.holds(local)):
            raise ValueError(f"rank {self.rank}: the local side of a put/get with rank {peer} on "
                             "another machine must be a contiguous view of a symmetric buffer: "
                             "NVSHMEM's inter-machine transports (InfiniBand, EFA) need registered "
                             "memory there; allocate it with symmetric_empty")


class SymmetricBuffers:
    """The symmetric buffers of one communicator, keyed by the address of their storage:
    any view (slice, any strides, same storage) of a registered buffer resolves to its entry."""

    def __init__(self) -> None:
        self._entries: dict[int, Any] = {}

    def add(self, buffer: torch.Tensor, entry: Any) -> None:
        self._entries[buffer.untyped_storage().data_ptr()] = entry

    def holds(self, view: torch.Tensor) -> bool:
        return view.untyped_storage().data_ptr() in self._entries

    def lookup(self, view: torch.Tensor) -> Any:
        try:
            return self._entries[view.untyped_storage().data_ptr()]
        except KeyError:
            raise ValueError("tensor is not a view of a symmetric buffer of this communicator "
                             "(allocate it with symmetric_empty)") from None

    def entries(self) -> list[Any]:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()


class TwoSided(Communicator):
    """Matched send/receive over torch.distributed."""

    @abc.abstractmethod
    def prepare_exchange(self, sends: list[tuple[torch.Tensor, int]],
                         recvs: list[tuple[torch.Tensor, int]], *, what: str,
                         queue: str = "other") -> Callable[[], Handle]:
        """``exchange``, checked and resolved now; each call of the result posts it and returns
        its handle. The tensors must outlive every post."""

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                 *, what: str, queue: str = "other") -> Handle:
        """Post all ``(tensor, peer)`` sends and receives in one grouped operation on ``queue``;
        one handle for the batch. Messages with one peer in one direction match in list order;
        pairs with my own rank are local copies (matched in list order)."""
        with plan.preparing():
            post = self.prepare_exchange(sends, recvs, what=what, queue=queue)
        return plan.issue(post)

    @abc.abstractmethod
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], *, what: str,
                   queue: str = "other") -> None:
        """All-to-all of equal chunks along dim 0 of ``inp`` over ``ranks`` (in that order), as
        one ``exchange`` on ``queue``."""
