"""An in-process two-sided communicator (``comm/base.py::TwoSided``): ranks are threads of
one process, one ``InProcComm`` per rank over one ``Fabric``.

It obeys the rules of the real one (``comm/p2p.py`` over gloo or NCCL):
- ``prepare_exchange`` checks the queue (``"ring"``, ``"other"``) and the peers, and each call
  of its result posts the exchange: pairs with my own rank are copied then (their counts must
  match), the rest go on the wires; bytes and grouped calls are counted as ``p2p`` counts them;
- messages from one rank to another on one queue match in list order (the n-th send of the
  pair with the n-th receive), whatever the exchange they belong to;
- a message moves after both its send and its receive are posted and before either side's
  wait returns: at the first wait of either side (``land="wait"``: a receive buffer read
  before its wait still holds what it held, a source changed before the receiver waited sends
  the change) or as soon as both are posted (``land="post"``: a receive buffer still being
  read is overwritten at once);
- sizes (bytes) and dtypes of a send and its receive must match, or the exchange raises
  ``ValueError`` naming both ranks and the stage;
- every wait has a timeout and raises ``CommTimeout`` naming the rank, the peers and the stage;
  it raises at once when every live rank waits (nothing can move any more), and
  ``PeerFailure`` when another rank failed.
``Fabric.log`` keeps every posted exchange: ``(rank, queue, what, sends, recvs)`` with
``(peer, bytes)`` pairs, pairs with myself left out.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xfuser_swiftfusion.comm.base import QUEUES, Handle, TwoSided
from xfuser_swiftfusion.comm.errors import CommTimeout, PeerFailure


class _Message:
    """One send matched with one receive (either side may come first)."""

    def __init__(self) -> None:
        self.src: torch.Tensor | None = None
        self.dst: torch.Tensor | None = None
        self.sender = self.receiver = -1
        self.what = ""
        self.moved = False

    def ready(self) -> bool:
        return self.src is not None and self.dst is not None

    def move(self) -> None:
        """Copy the send into the receive (once), checking sizes and dtypes."""
        if self.moved:
            return
        s, d = self.src, self.dst
        if s.dtype != d.dtype or s.numel() * s.element_size() != d.numel() * d.element_size():
            raise ValueError(f"rank {self.receiver}: {self.what!r}: a receive of {d.numel()} x "
                             f"{d.dtype} matched a send of {s.numel()} x {s.dtype} from rank "
                             f"{self.sender}")
        d.copy_(s.reshape(d.shape))
        self.moved = True


class Fabric:
    """The wires of one in-process world of ``world_size`` ranks (``node_of``: machine of
    each rank, for the byte counters)."""

    def __init__(self, world_size: int, node_of: list[int] | None = None, *,
                 land: str = "wait", timeout_s: float = 30.0) -> None:
        if land not in ("wait", "post"):
            raise ValueError(f"land must be 'wait' or 'post', not {land!r}")
        self.world_size, self.land, self.timeout_s = world_size, land, timeout_s
        self.node_of = list(node_of) if node_of is not None else [0] * world_size
        self.cond = threading.Condition()
        self._wires: dict[tuple[int, int, str], list[_Message]] = defaultdict(list)
        self._posted: dict[tuple[int, int, str, str], int] = defaultdict(int)  # sends/recvs posted
        self._version = 0
        self._blocked: dict[int, int] = {}  # rank -> version at which it found nothing to do
        self.alive: set[int] = set()
        self.failed: dict[int, BaseException] = {}
        self.log: list[tuple[int, str, str, tuple, tuple]] = []

    def comm(self, rank: int) -> "InProcComm":
        return InProcComm(rank, self.world_size, self.node_of, self.timeout_s, fabric=self)

    def _message(self, src: int, dst: int, queue: str, side: str) -> _Message:
        """The next message of wire (src -> dst, queue) for a send or a receive (``side``)."""
        key = (src, dst, queue)
        n = self._posted[(*key, side)]
        self._posted[(*key, side)] = n + 1
        wire = self._wires[key]
        while len(wire) <= n:
            wire.append(_Message())
        return wire[n]

    def changed(self) -> None:
        self._version += 1
        self.cond.notify_all()

    def block(self, rank: int, deadline: float, doing: str) -> None:
        """Wait (holding ``cond``) for a change; raise if nothing can change any more."""
        if self.failed and rank not in self.failed:
            who = ", ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in self.failed.items())
            raise PeerFailure(f"{doing}: a peer failed ({who})")
        self._blocked[rank] = self._version
        if self.alive and all(self._blocked.get(r) == self._version for r in self.alive):
            raise CommTimeout(f"{doing} can never complete: every live rank waits")
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"{doing} did not complete within {self.timeout_s:.1f} s")
        self.cond.wait(min(left, 1.0))

    def run(self, fn: Callable[[int], Any], timeout_s: float | None = None,
            ranks: list[int] | None = None) -> list[Any]:
        """``fn(rank)`` on every rank (or on ``ranks``, the others idle), one thread each; their
        results, by rank. The first error (the cause, not the peers' failures it set off) is
        raised here."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        results: list[Any] = [None] * self.world_size
        with self.cond:
            self.alive = set(ranks)

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
                with self.cond:
                    self.failed[rank] = e
            finally:
                with self.cond:
                    self.alive.discard(rank)
                    self._blocked.pop(rank, None)
                    self.changed()

        threads = [threading.Thread(target=main, args=(r,), daemon=True, name=f"inproc-rank-{r}")
                   for r in ranks]
        for t in threads:
            t.start()
        deadline = time.monotonic() + (timeout_s or 2 * self.timeout_s)
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in threads):
            raise CommTimeout(f"ranks {[r for r, t in zip(ranks, threads) if t.is_alive()]} still run")
        if self.failed:
            causes = [e for e in self.failed.values() if not isinstance(e, PeerFailure)]
            raise (causes or list(self.failed.values()))[0]
        return results


class _Handle(Handle):
    """One posted exchange: its receives (moved at the first wait of either side) and its
    sends (done once their receivers hold them)."""

    def __init__(self, comm: "InProcComm", sends: list[_Message], recvs: list[_Message],
                 doing: str) -> None:
        self.comm, self.sends, self.recvs, self.doing = comm, sends, recvs, doing

    def wait(self) -> None:
        f = self.comm.fabric
        deadline = time.monotonic() + f.timeout_s
        with f.cond:
            try:
                while True:
                    moved = False
                    for m in (*self.recvs, *self.sends):
                        if m.ready() and not m.moved:
                            m.move()
                            moved = True
                    if moved:
                        f.changed()
                    if all(m.moved for m in (*self.recvs, *self.sends)):
                        return
                    f.block(self.comm.rank, deadline, self.doing)
            finally:
                f._blocked.pop(self.comm.rank, None)


@dataclass(eq=False)
class InProcComm(TwoSided):
    """``TwoSided`` of one rank over a ``Fabric`` (module docstring)."""

    fabric: Fabric | None = field(default=None, kw_only=True)

    def prepare_exchange(self, sends, recvs, *, what, queue="other"):
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}; expected one of {QUEUES}")
        for _, p in (*sends, *recvs):
            if not 0 <= p < self.world_size:
                raise ValueError(f"rank {self.rank}: {what!r}: invalid exchange peer {p}")
        own_s = [t for t, p in sends if p == self.rank]
        own_r = [t for t, p in recvs if p == self.rank]
        if len(own_s) != len(own_r):
            raise ValueError(f"rank {self.rank}: {what!r}: {len(own_s)} sends to myself but "
                             f"{len(own_r)} receives from myself")
        sends = [(t, p) for t, p in sends if p != self.rank]
        recvs = [(t, p) for t, p in recvs if p != self.rank]
        peers = sorted({p for _, p in (*sends, *recvs)})
        doing = f"rank {self.rank}: {what!r}: exchange with peers {peers} on queue {queue!r}"
        f, me = self.fabric, self.rank

        def post() -> Handle:
            for d, s in zip(own_r, own_s):
                if s.dtype != d.dtype or s.numel() != d.numel():
                    raise ValueError(f"{doing}: a copy to myself of {s.numel()} x {s.dtype} "
                                     f"into {d.numel()} x {d.dtype}")
                d.copy_(s.reshape(d.shape))
            with f.cond:
                out, into = [], []
                for t, p in sends:
                    m = f._message(me, p, queue, "send")
                    m.src, m.sender, m.what = t, me, what
                    out.append(m)
                for t, p in recvs:
                    m = f._message(p, me, queue, "recv")
                    m.dst, m.receiver = t, me
                    into.append(m)
                if f.land == "post":
                    for m in (*out, *into):
                        if m.ready():
                            m.move()
                f.log.append((me, queue, what, tuple((p, t.numel() * t.element_size()) for t, p in sends),
                              tuple((p, t.numel() * t.element_size()) for t, p in recvs)))
                f.changed()
            if sends or recvs:
                self.counter.grouped_calls += 1
            for t, p in sends:
                self.counter.count(p, t.numel() * t.element_size())
            return _Handle(self, out, into, doing)

        return post

    def all_to_all(self, out, inp, ranks, *, what, queue="other"):
        n = len(ranks)
        if self.rank not in ranks or len(set(ranks)) != n:
            raise ValueError(f"rank {self.rank}: all_to_all group {ranks} must hold distinct ranks including mine")
        if inp.shape != out.shape or inp.shape[0] % n:
            raise ValueError(f"all_to_all over {n} ranks needs equal shapes with dim 0 divisible by {n}")
        self.exchange(list(zip(inp.chunk(n), ranks)), list(zip(out.chunk(n), ranks)),
                      what=what, queue=queue).wait()

    def close(self) -> None:
        self.stop_watching()
