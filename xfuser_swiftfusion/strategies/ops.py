"""What one rank does in one attention layer, as data: the operations its strategy issues, in
order (a rank's *program*), for the cost model's timeline (``timeline.py``).

A strategy's program is built from the step list that the strategy itself executes
(``torus_schedule``, ``ring_schedule``, ``tas_schedule``; usp: the steps of xFuser's USP),
expanded by the transport it runs on into the calls that transport makes: every ``attend``
call, every local copy, every grouped exchange, collective, put and get, every wait and
barrier. Op counts and byte counts of a program equal what ``ctx.stats()`` counts for the
running strategy (tests/test_cost_model.py).

Byte counts are per transfer; ranks are global ranks. A query or K/V chunk is
``[B, h, rows, D]``: an ``Attend`` names the rows of each chunk and ``B*h``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

KINDS = ("exchange", "all_to_all", "all_gather", "get", "put")
"""Transfer kinds: a grouped point-to-point exchange (``TwoSided.exchange``), xFuser's
collectives (``all_to_all_single``, ``all_gather``), one-sided ``get`` / ``put``."""


@dataclass(frozen=True)
class Shape:
    """One rank's layer: ``tokens`` = S image tokens per rank, ``text`` = Tj replicated text
    tokens, ``heads`` = H (the heads it runs on), ``itemsize`` bytes per element."""

    batch: int
    tokens: int
    heads: int
    head_dim: int
    text: int = 0
    itemsize: int = 2

    def nbytes(self, heads: int, rows: int) -> int:
        """Bytes of one ``[B, heads, rows, D]`` tensor."""
        return self.batch * heads * rows * self.head_dim * self.itemsize

    def state_bytes(self, heads: int, rows: int) -> int:
        """Bytes of a running state (fp32 ``acc`` ``[B, h, rows, D]``, ``m``, ``l``)."""
        return 4 * self.batch * heads * rows * (self.head_dim + 2)


@dataclass(frozen=True)
class Attend:
    """One ``attend`` call: query chunks of ``q`` rows each against K/V chunks of ``kv`` rows,
    ``bh`` = B*h rows of heads; ``kv == ()`` with ``finalize``: the division by ``l`` only."""

    q: tuple[int, ...]
    kv: tuple[int, ...]
    bh: int
    finalize: bool = False


@dataclass(frozen=True)
class Copy:
    """A local copy (rearrangement, staging, a transfer to myself) of ``nbytes``."""

    nbytes: int


@dataclass(frozen=True)
class Transfer:
    """One communication call, completed by one handle ``handle`` (unique in a program).

    ``sends``: ``(peer, bytes)`` leaving this rank (exchange and collectives: matched with the
    peer's ``recvs`` in order; put: written into the peer); ``recvs``: ``(peer, bytes)``
    arriving (get: read from the peer, who takes no part). ``queue``: ``"ring"`` or ``"other"``.
    """

    handle: str
    kind: str
    queue: str
    sends: tuple[tuple[int, int], ...] = ()
    recvs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Wait:
    """Block until the transfers ``handles`` completed."""

    handles: tuple[str, ...]


@dataclass(frozen=True)
class Barrier:
    """Every rank of ``ranks`` arrives; ``quiet``: my transfers complete first (``barrier``,
    ``barrier_all``), else the rendezvous alone (``sync``)."""

    ranks: tuple[int, ...]
    quiet: bool = True


Op = Union[Attend, Copy, Transfer, Wait, Barrier]


class Program:
    """A rank's ops under construction; ``transfer`` names handles uniquely."""

    def __init__(self, rank: int) -> None:
        self.rank, self.ops, self._n = rank, [], 0

    def add(self, *ops: Op) -> None:
        self.ops.extend(ops)

    def transfer(self, kind: str, queue: str, sends=(), recvs=()) -> str | None:
        """Append a transfer; pairs with myself become a local ``Copy`` (as the communicators
        do). Its handle, None when nothing is left to move."""
        me, mine, out, into = self.rank, 0, [], []
        for p, b in sends:
            if p == me:
                mine += b
            else:
                out.append((p, b))
        for p, b in recvs:
            if p != me:
                into.append((p, b))
            elif kind in ("get", "put"):  # a one-sided transfer with myself is a copy
                mine += b
        if mine:
            self.ops.append(Copy(mine))
        if not out and not into:
            return None
        sends, recvs = tuple(out), tuple(into)
        self._n += 1
        handle = f"{kind}{self._n}"
        self.ops.append(Transfer(handle, kind, queue, sends, recvs))
        return handle

    def wait(self, *handles: str | None) -> None:
        handles = tuple(h for h in handles if h is not None)
        if handles:
            self.ops.append(Wait(handles))


def counts(ops: list[Op]) -> dict[str, int]:
    """What ``ctx.stats()`` counts for these ops: messages to other ranks (sends, puts and
    gets), grouped exchanges, barriers (barrier_all, barrier, sync) and attend calls."""
    out = {"transfers": 0, "grouped_exchanges": 0, "barriers": 0, "attend_calls": 0}
    for op in ops:
        if isinstance(op, Attend):
            out["attend_calls"] += 1
        elif isinstance(op, Barrier):
            out["barriers"] += 1
        elif isinstance(op, Transfer):
            out["transfers"] += len(op.recvs) if op.kind == "get" else len(op.sends)
            out["grouped_exchanges"] += op.kind == "exchange" and bool(op.sends or op.recvs)
    return out


def sent_bytes(ops: list[Op], peers: set[int] | None = None) -> int:
    """Bytes this rank's transfers move to or from ``peers`` (all: None), counted as the
    communicators count them: sends and puts at the sender, gets at the initiator."""
    n = 0
    for op in ops:
        if isinstance(op, Transfer):
            pairs = op.recvs if op.kind == "get" else op.sends
            n += sum(b for p, b in pairs if peers is None or p in peers)
    return n


__all__ = ["Attend", "Barrier", "Copy", "KINDS", "Op", "Program", "Shape", "Transfer", "Wait",
           "counts", "sent_bytes"]
