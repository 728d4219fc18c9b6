"""CPU symmetric heap: every rank maps the buffers of the ranks on its machine; peers on
other machines are reached through a TCP proxy (``proxy.py``), as NVSHMEM reaches them over
the network. ``cross_node="shm"`` (or ``$SWIFTFUSION_SHM_CROSS_NODE=shm``) maps every rank
of the host instead (faster, but cross-machine bytes then never touch a network; refused
inside an emulated network, see ``netns.py``).

Layout: buffer ``i`` of rank ``r`` is the file ``/dev/shm/sf-<token>-r<r>-b<i>`` (``token``
random per communicator, chosen by rank 0), created ``O_EXCL`` with mode 0600, mapped
``MAP_SHARED`` by all ranks and unlinked by its owner as soon as every rank has mapped it:
nothing is left in /dev/shm once ``symmetric_empty`` returns, even if a rank is SIGKILLed.

Each rank also owns a control buffer of ``1 + world_size`` int64: ``[0]`` its pid (0 once
closed), ``[1 + p]`` how many barriers including rank ``p`` it has entered. Only the owner
writes its control buffer (aligned int64 stores: no atomics needed on x86). A peer on another
machine learns that count from a proxy ``ARRIVE`` message instead, one per machine: the
lowest-numbered rank of the barrier on my machine receives it and writes it into the inbox of
each rank it names, ``[world_size, ranks per machine]`` int64 per rank, column = local index of
the receiving rank (one writer per cell; the count is the row's maximum). A barrier over
``G`` increments my count for every ``p`` in ``G`` and waits until each ``p`` has counted at
least as many barriers including me; since any two ranks enter their common barriers in the
same order (otherwise the program would deadlock on any backend), pairwise counts act as an
epoch per group without having to agree on group ids.

Transfers run on one copy thread per queue (FIFO, like a CUDA stream), local copies and proxy
requests alike; ``copy_`` and socket I/O release the GIL so transfers overlap compute on the
main thread. The thread keeps proxy requests of one kind (all gets or all puts) in flight and
completes them in order, so completion stays FIFO per queue: ``_IN_FLIGHT`` of any size, more
while those in flight carry at most ``_WINDOW_BYTES`` (small transfers go out together, large
ones reach a throttled link in issue order). It starts every request queued that may go, then
sends them (``flush``: one ``sendmsg`` per connection). A local copy or a request of the other
kind first waits for those in flight (a big GET reply and a big PUT payload crossing on one
connection could each fill the socket buffers the other needs). A barrier first quiets both
queues (a proxy ``PUT`` completes once applied); ``sync`` is the same rendezvous without the
quiet.

Failure: waits (barriers and handles) raise ``PeerFailure`` as soon as a rank they wait on has
died or closed its communicator (on another machine: its proxy connection ended without /
with ``BYE``), ``CommTimeout`` after ``timeout_s``. So close only after a
final barrier, as NVSHMEM's collective finalize would require anyway.
"""
from __future__ import annotations

import collections
import functools
import os
import queue as queue_mod
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..comm.base import QUEUES, CommTimeout, Handle, OneSided, PeerFailure, SymmetricBuffers
from ..log import get_logger
from .netns import NETNS_ENV
from .procs import process_alive
from .proxy import PROXY_ADDR_ENV, Proxy, view_key

log = get_logger("xfuser_swiftfusion.comm")

SHM_DIR = "/dev/shm"
PREFIX = "sf-"
_LIVENESS_PERIOD_S = 0.01
_MAX_POLL_S = 1e-3  # a waiting rank sleeps up to 1/10 of the time it has waited, at most this
CROSS_NODE_ENV = "SWIFTFUSION_SHM_CROSS_NODE"
CROSS_NODE_MODES = ("proxy", "shm")
_IN_FLIGHT = 2  # proxy requests per queue sent before the oldest reply is received, any size
_WINDOW_BYTES = 1 << 18  # more requests go while those in flight carry at most this many bytes
_UNKNOWN = 1 << 62  # size of a request that did not say (counts as large)
_STOP = object()  # queued by ``_CopyQueue.stop``: the thread ends after the copies before it


class _Done:
    """A one-shot event (``set`` once; ``wait`` / ``is_set``), lighter than ``threading.Event``."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        self._set = True
        self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._lock.release()
            return True
        return self._set


class _Copy:
    """One queued transfer: ``fn()`` does it, or, for a proxy request (``kind`` "put" or
    "get", ``nbytes`` its payload), starts it and returns the function that completes it;
    ``done`` is set after it completed (``error`` if it raised)."""

    __slots__ = ("fn", "kind", "nbytes", "done", "error")

    def __init__(self, fn: Callable[[], object], kind: str | None, nbytes: int) -> None:
        self.fn, self.kind, self.nbytes = fn, kind, nbytes
        self.done = _Done()
        self.error: BaseException | None = None


class _CopyQueue:
    """A FIFO of copies executed by one daemon thread, completed in submission order.

    ``flush()`` (if given) sends the proxy requests started since the last call; the thread
    calls it before it awaits any of them."""

    def __init__(self, name: str, flush: Callable[[], None] | None = None) -> None:
        self._jobs: queue_mod.SimpleQueue[_Copy | object] = queue_mod.SimpleQueue()
        self._flush = flush
        self.last: _Copy | None = None
        self.error: BaseException | None = None  # the first failed copy, raised by quiet
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], kind: str | None = None,
               nbytes: int = _UNKNOWN) -> _Copy:
        job = self.last = _Copy(fn, kind, nbytes)
        self._jobs.put(job)
        return job

    def _attempt(self, job: _Copy, fn: Callable[[], object]) -> tuple[bool, object]:
        """``(True, fn())``, or ``(False, None)`` with the error recorded on ``job``."""
        try:
            with torch.inference_mode():  # may write into tensors made in inference mode
                return True, fn()
        except BaseException as exc:  # reported by the waiter
            job.error = exc
            self.error = self.error or exc
            return False, None

    @staticmethod
    def _done(job: _Copy) -> None:
        job.done.set()
        job.fn = None  # type: ignore[assignment]

    def _run(self) -> None:
        in_flight: collections.deque[tuple[_Copy, Callable[[], None]]] = collections.deque()
        flight = [0]  # bytes in flight

        def complete_oldest() -> None:
            job, finish = in_flight.popleft()
            flight[0] -= job.nbytes
            self._attempt(job, finish)
            self._done(job)

        def may_start(job: _Copy | object) -> bool:
            """``job`` may go beside the requests in flight (``_STOP`` only once none is)."""
            return not in_flight or (job is not _STOP and job.kind == in_flight[0][0].kind and (
                len(in_flight) < _IN_FLIGHT or flight[0] + job.nbytes <= _WINDOW_BYTES))

        held: _Copy | object | None = None  # taken from the queue, waits for requests in flight
        while True:
            if held is None:
                if in_flight and self._jobs.empty():
                    complete_oldest()
                    continue
                held = self._jobs.get()
            if not may_start(held):
                complete_oldest()
                continue
            job, held = held, None
            if job is _STOP:
                return
            if job.kind is None:  # a local copy (nothing in flight)
                self._attempt(job, job.fn)
                self._done(job)
                continue
            while True:  # start it and every queued request that may go beside it
                ok, finish = self._attempt(job, job.fn)
                if not ok:  # a failed request completes after the ones before it
                    if self._flush is not None:
                        self._flush()
                    while in_flight:
                        complete_oldest()
                    self._done(job)
                    break
                in_flight.append((job, finish))
                flight[0] += job.nbytes
                if self._jobs.empty():
                    break
                job = self._jobs.get()
                if not may_start(job):
                    held = job
                    break
            if self._flush is not None:
                self._flush()

    def stop(self) -> None:
        """Complete every queued copy, then end the thread (waits at most 5 s)."""
        self._jobs.put(_STOP)
        self._thread.join(timeout=5.0)


def _record_arrival(inboxes: list[np.ndarray | None], me: int, slot: int, sender: int, rank: int,
                    count: int) -> None:
    """Proxy handler of rank ``me`` (column ``slot``): ``sender`` entered ``count`` barriers
    including ``rank`` (a rank of my machine)."""
    inbox = inboxes[rank]
    if inbox is None:
        raise ValueError(f"rank {sender} sent rank {me} the arrival of rank {rank}, which is on "
                         "another machine")
    inbox[sender, slot] = count


def _record_bye(inbox: np.ndarray, sender: int) -> None:
    """Proxy handler: ``sender`` closed (every arrival it sent me before is written)."""
    inbox[sender, -1] = 1


def _shutdown(queues: dict[str, _CopyQueue], control: np.ndarray, proxy: Proxy | None) -> None:
    for q in queues.values():
        q.stop()
    if proxy is not None:
        proxy.close()
    control[0] = 0  # tell waiting peers I am gone


class _CopyHandle(Handle):
    def __init__(self, comm: "ShmCommunicator", job: _Copy, peer: int, doing: str,
                 what: str) -> None:
        self._comm, self._job, self._peer, self._doing, self._what = comm, job, peer, doing, what

    def wait(self) -> None:
        c, job, doing = self._comm, self._job, self._doing
        deadline = time.monotonic() + c.timeout_s
        while not job.done.wait(_LIVENESS_PERIOD_S):
            c._check_alive(self._peer, self._what, doing)
            if time.monotonic() > deadline:
                raise CommTimeout(f"rank {c.rank}: {self._what!r}: {doing} did not complete "
                                  f"within {c.timeout_s:.1f} s")
        if job.error is not None:
            c._check_alive(self._peer, self._what, doing)  # a dead peer is named as such
            kind = (type(job.error) if isinstance(job.error, (PeerFailure, CommTimeout)) else
                    PeerFailure if isinstance(job.error, OSError) else RuntimeError)
            raise kind(f"rank {c.rank}: {self._what!r}: {doing} failed: {job.error}") from job.error


@dataclass(eq=False)
class ShmCommunicator(OneSided):
    """One-sided communicator over a /dev/shm symmetric heap within a machine and a TCP proxy
    across machines (``cross_node="proxy"``, the default), or /dev/shm for every rank of the
    host (``cross_node="shm"``)."""

    cross_node: str = field(default_factory=lambda: os.environ.get(CROSS_NODE_ENV, "proxy"))
    _buffers: SymmetricBuffers = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not dist.is_initialized():
            raise RuntimeError("ShmCommunicator needs torch.distributed initialised")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise ValueError(f"rank {self.rank}/{self.world_size} does not match torch.distributed "
                             f"({dist.get_rank()}/{dist.get_world_size()})")
        if self.cross_node not in CROSS_NODE_MODES:
            raise ValueError(f"cross_node must be one of {CROSS_NODE_MODES}, got {self.cross_node!r}")
        if self.cross_node == "shm" and os.environ.get(NETNS_ENV) and len(set(self.node_of)) > 1:
            raise RuntimeError(f"{CROSS_NODE_ENV}=shm would move inter-machine bytes through "
                               "/dev/shm, bypassing the emulated network's links; use 'proxy'")
        hosts: list[tuple[str, str]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(hosts, (socket.gethostname(), secrets.token_hex(8)))
        me = self.node_of[self.rank]
        # ranks whose buffers I map (the others are reached through the proxy)
        self._mapped = {r for r in range(self.world_size)
                        if self.cross_node == "shm" or self.node_of[r] == me}
        names = sorted({hosts[r][0] for r in self._mapped})
        if len(names) != 1:
            raise RuntimeError(f"the shm backend needs the ranks it maps on one host, got {names}")
        self.prefix = f"{PREFIX}{hosts[0][1]}"
        self._buffers = SymmetricBuffers()
        self._storages: dict[int, torch.UntypedStorage] = {}  # mine by buffer id (for the proxy)
        self._count = 0
        self._heap_bytes = 0
        # [pid, barriers entered with rank 0, 1, ...] per rank; numpy views (they keep the
        # mapping alive): a barrier polls them, and torch indexing costs ~30x as much
        self._control = [c.numpy() if c is not None else None
                         for c in self._map_all((1 + self.world_size,), torch.int64)]
        self._control[self.rank][0] = os.getpid()
        self._proxy = self._start_proxy(hosts)
        dist.barrier()  # every pid is written before anyone can wait on a peer
        self._queues = {q: _CopyQueue(f"sf-shm-r{self.rank}-{q}", None if self._proxy is None
                                      else functools.partial(self._proxy.flush, q)) for q in QUEUES}
        self._finalizer = weakref.finalize(self, _shutdown, self._queues, self._control[self.rank],
                                           self._proxy)
        log.debug("rank %d: shm communicator %s ready", self.rank, self.prefix)

    def _start_proxy(self, hosts: list[tuple[str, str]]) -> Proxy | None:
        """Collective: a proxy server per rank, connected to every peer I do not map."""
        remote = [r for r in range(self.world_size) if r not in self._mapped]
        if not remote:  # the same on every rank: one machine, or cross_node="shm"
            return None
        machines = collections.Counter(self.node_of)
        local = sorted(self._mapped)
        self._slot = local.index(self.rank)  # my column in the inboxes of my machine
        # [sender, receiving rank's local index]: barriers including me the sender entered;
        # [sender, -1]: 1 once my proxy got the sender's BYE (after all it relayed from it)
        self._inbox = [c.numpy() if c is not None else None
                       for c in self._map_all((self.world_size, max(machines.values()) + 1),
                                              torch.int64)]
        addr = os.environ.get(PROXY_ADDR_ENV)
        if not addr:
            if len({h for h, _ in hosts}) != 1:
                raise RuntimeError(f"ranks run on several hosts: set {PROXY_ADDR_ENV} to an "
                                   "address of this host that the other machines reach")
            addr = "127.0.0.1"
        # the proxy's callbacks hold the inboxes, not me (I stay collectable)
        proxy = Proxy(self.rank, list(self.node_of), addr, self._storages.__getitem__,
                      functools.partial(_record_arrival, self._inbox, self.rank, self._slot),
                      functools.partial(_record_bye, self._inbox[self.rank]), self.timeout_s)
        addresses: list[tuple[str, int]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(addresses, proxy.address)
        proxy.connect(addresses)
        return proxy

    # -- symmetric heap -------------------------------------------------------------------

    def _map_all(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Collective: create my segment, map the segments of the ranks I map, unlink mine;
        return the views by rank (None for ranks reached through the proxy)."""
        numel = 1
        for n in shape:
            numel *= n
        size = max(numel, 1)  # an empty mapping is not allowed
        nbytes = size * torch.empty((), dtype=dtype).element_size()
        name = f"{self.prefix}-r{{}}-b{self._count}"
        index, self._count = self._count, self._count + 1
        mine = os.path.join(SHM_DIR, name.format(self.rank))
        fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            specs: list[tuple] = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(specs, (tuple(shape), str(dtype)))  # also: all files exist
            if len(set(specs)) != 1:
                raise ValueError(f"symmetric_empty called with different shapes/dtypes: {specs}")
            views = [torch.from_file(os.path.join(SHM_DIR, name.format(r)), shared=True,
                                     size=size, dtype=dtype)[:numel].view(shape)
                     if r in self._mapped else None for r in range(self.world_size)]
            self._storages[index] = views[self.rank].untyped_storage()
            dist.barrier()  # every rank mapped its segments and can serve its proxy
        finally:
            os.unlink(mine)
        return views

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer_id = self._count
        views = self._map_all(tuple(shape), dtype)
        mine = views[self.rank]
        self._buffers.add(mine, (buffer_id, [v if v is None else v.untyped_storage() for v in views]))
        self._heap_bytes += mine.numel() * mine.element_size()
        log.debug("rank %d: symmetric buffer %s %s, heap now %d bytes", self.rank, tuple(shape),
                  dtype, self._heap_bytes)
        return mine

    def symmetric_heap_bytes(self) -> int:
        return self._heap_bytes

    def _peer_view(self, view: torch.Tensor, peer: int) -> torch.Tensor:
        """``peer``'s copy of ``view``: same storage offset, sizes and strides in its mapping."""
        storage = self._buffers.lookup(view)[1][peer]
        return torch.empty(0, dtype=view.dtype).set_(storage, view.storage_offset(), view.size(),
                                                     view.stride())

    # -- transfers ------------------------------------------------------------------------

    def prepare(self, op: str, dst: torch.Tensor, src: torch.Tensor, peer: int, *, queue: str,
                what: str) -> Callable[[], Handle]:
        """Queue ``dst.copy_(src)`` where the symmetric side is ``peer``'s copy (``put``: ``src``
        must stay unchanged until waited)."""
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: {what!r}: {op} on a closed communicator")
        sym, local = (dst, src) if op == "put" else (src, dst)
        self.check_transfer(sym, local, peer, queue)
        buffer_id, storages = self._buffers.lookup(sym)
        nbytes = sym.numel() * sym.element_size()
        if storages[peer] is None:  # another machine: through the proxy, like NVSHMEM over EFA
            mem = self._proxy.local_bytes(self._buffers.lookup(local)[0], local)
            fn = functools.partial(self._proxy.start, op, queue, peer, view_key(buffer_id, sym), mem)
            kind, size = op, len(mem)
        else:
            remote = self._peer_view(sym, peer)
            fn = functools.partial(remote.copy_, src) if op == "put" else functools.partial(dst.copy_, remote)
            kind, size = None, _UNKNOWN
        copies, doing, finalizer = self._queues[queue], f"{op} with peer {peer} on queue {queue!r}", self._finalizer

        def issue() -> Handle:
            if not finalizer.alive:
                raise RuntimeError(f"rank {self.rank}: {what!r}: {op} on a closed communicator")
            self.counter.count(peer, nbytes)
            if self._capturing:
                self.note_captured((peer,), doing, what)
            return _CopyHandle(self, copies.submit(fn, kind, size), peer, doing, what)

        return issue

    # -- synchronisation ------------------------------------------------------------------

    def _check_alive(self, peer: int, what: str, doing: str) -> None:
        if peer == self.rank:
            return
        if self._control[peer] is not None:
            pid = int(self._control[peer][0])
            state = "closed" if pid == 0 else "open" if process_alive(pid) else "died"
        else:  # another machine: what its proxy connection says
            state, pid = self._proxy.peer_state(peer)
        if state == "closed":
            raise PeerFailure(f"rank {self.rank}: {what!r}: peer rank {peer} closed its "
                              f"communicator while {doing}")
        if state == "died":
            raise PeerFailure(f"rank {self.rank}: {what!r}: peer rank {peer} (pid {pid}) died "
                              f"while {doing}")

    def _quiet(self, what: str) -> None:
        for name, q in self._queues.items():
            if q.last is not None:
                _CopyHandle(self, q.last, self.rank, f"quiet of queue {name!r}", what).wait()
            if q.error is not None:  # a broken proxy connection is a peer failure
                kind = (type(q.error) if isinstance(q.error, (PeerFailure, CommTimeout)) else
                        PeerFailure if isinstance(q.error, OSError) else RuntimeError)
                raise kind(f"rank {self.rank}: {what!r}: a transfer on queue {name!r} "
                           f"failed: {q.error}") from q.error

    def prepare_barrier(self, ranks: tuple[int, ...] | None, *, what: str,
                        quiet: bool = True) -> Callable[[], None]:
        ranks = tuple(range(self.world_size)) if ranks is None else tuple(ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in {'barrier' if quiet else 'sync'} "
                             f"group {ranks}")
        return functools.partial(self._barrier_now, ranks, what, quiet)

    def _barrier_now(self, ranks: tuple[int, ...], what: str, quiet: bool) -> None:
        if self._capturing:
            self.note_captured(None if len(ranks) == self.world_size else ranks,
                               f"barrier over ranks {tuple(ranks)}", what)
        if quiet:
            self._quiet(what)
        self.counter.barriers += 1
        mine = self._control[self.rank]
        peers = sorted(set(ranks) - {self.rank})
        for p in peers:
            mine[1 + p] += 1
        need = {p: int(mine[1 + p]) for p in peers}
        doing = f"in barrier over ranks {tuple(ranks)}"
        remote = {p: need[p] for p in peers if self._control[p] is None}
        relay = self.rank  # receives the remote ranks' arrivals for my machine
        if remote:
            relay = min(r for r in ranks if self._control[r] is not None)
            try:
                self._proxy.arrive(remote)
            except PeerFailure as exc:
                for p in remote:
                    self._check_alive(p, what, doing)
                raise PeerFailure(f"rank {self.rank}: {what!r}: {exc} {doing}") from exc
        start = time.monotonic()
        next_check, missing = 0.0, peers
        while True:
            missing = [p for p in missing if self._arrived(p) < need[p]]
            if not missing:
                return
            now = time.monotonic()
            if now >= next_check:
                for p in missing:
                    try:
                        if p in remote:  # its arrival comes through the relay of my machine
                            if self._proxy.peer_state(p)[0] == "died":  # the cause, named first:
                                self._check_alive(p, what, doing)     # the relay may close on it
                            self._check_alive(relay, what, f"{doing} (relaying rank {p}'s arrival)")
                            if (relay != self.rank and self._proxy.peer_state(p)[0] == "closed"
                                    and not self._inbox[relay][p, -1]):
                                continue  # its last arrivals may still be on their way through the relay
                        self._check_alive(p, what, doing)
                    except PeerFailure:  # p (or its relay, which writes first) may have closed
                        if self._arrived(p) < need[p]:  # after p arrived, since `missing`
                            raise
                next_check = now + _LIVENESS_PERIOD_S
            if now > start + self.timeout_s:
                raise CommTimeout(f"rank {self.rank}: {what!r}: barrier over ranks {tuple(ranks)} "
                                  f"timed out after {self.timeout_s:.1f} s; ranks that did not "
                                  f"arrive: {missing}")
            # poll at ~10 % of the time waited so far (a barrier ends at most ~10 % late): on
            # a shared host the waiting ranks leave the cores to the computing ones
            time.sleep(min(_MAX_POLL_S, (now - start) / 10))

    def _arrived(self, peer: int) -> int:
        """How many barriers including me ``peer`` has entered."""
        if self._control[peer] is None:
            return int(self._inbox[self.rank][peer, :-1].max())
        return int(self._control[peer][1 + self.rank])

    def close(self) -> None:
        """Stop the copy threads and mark me closed; the mappings go with the last tensor."""
        self.stop_watching()
        self._finalizer()
        self._buffers.clear()


# entry point xfuser_swiftfusion.one_sided:shm -> (factory, device type it is the default for)
BACKEND = (ShmCommunicator, "cpu")
