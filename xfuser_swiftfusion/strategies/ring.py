"""Ring attention over the ring group, in two-sided and one-sided form.

Both are ``ring(q_chunks, states, *block, what=)``: every Q chunk (``[B, h, Lq, D]``) attends
to the K/V block of EVERY rank of the ring group; partial results are merged into ``states``
(one per Q chunk) in place. A block is ``(k, v)``, each ``[n, B, h, S, D]`` (``n`` slots of
``[B, h, S, D]``), or one packed ``kv`` ``[n, 2, B, h, S, D]`` that moves in one transfer.

- ``PassRing`` (two-sided, as ring-flash-attention): R steps; at step i the block that
  started on ring rank ``r - i`` is attended while it is passed on to ``r + 1``.
- ``PullRing`` (one-sided, paper Algorithm 1 RingAttn): at step i the block of ring rank
  ``r + i`` is pulled straight from that rank's symmetric buffer while step i-1 computes.
Both keep two receive buffers per shape, reused across calls. K/V may have fewer heads than
the queries (grouped-query attention, ``kernels.attend``). ``masks``, when given, maps the ring
rank a block started on to the key masks of its slots (``[B, S]`` bool each, or None).

The loop is data: ``ring_schedule(R)`` lists the steps both forms execute; ``ring_ops``
expands them into the cost model's ops (``ops.py``) for either form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..comm.base import Handle, OneSided, TwoSided
from ..kernels import AttnState, attend
from .ops import Attend, Program


@dataclass(frozen=True)
class RingStep:
    """Step ``i`` (1..R) of a ring: with ``fetch``, the block of step i + 1 starts to move
    (``_fetch(i)``), then the current block (``origin(i)``) is attended, then the fetch is
    waited for."""

    i: int
    fetch: bool


def ring_schedule(R: int) -> list[RingStep]:
    """The R steps of ring attention over a ring group of R ranks."""
    return [RingStep(i, i < R) for i in range(1, R + 1)]


def slots(*block: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A block -> its ``(K, V)`` chunks ``[B, h, S, D]``: ``(k, v)`` ``[n, B, h, S, D]`` each,
    or ``(kv,)`` ``[n, 2, B, h, S, D]``."""
    if len(block) == 1:
        return [(kv[0], kv[1]) for kv in block[0].unbind(0)]
    k, v = block
    return list(zip(k.unbind(0), v.unbind(0)))


class _Buffers:
    """Two receive buffers per block form (shapes, dtype), allocated once."""

    def __init__(self, alloc) -> None:
        self._alloc = alloc
        self._bufs: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}

    def pair(self, block: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in block)
        if key not in self._bufs:
            self._bufs[key] = [tuple(self._alloc(x) for x in block) for _ in range(2)]
        return self._bufs[key]


class _Ring:
    """The ring loop of RingAttn; subclasses say how the next block arrives."""

    def __init__(self, comm, ranks: Sequence[int], r: int) -> None:
        self.comm, self.ranks, self.r = comm, tuple(ranks), r
        self.bufs = _Buffers(torch.empty_like)

    def __call__(self, q_chunks: list[torch.Tensor], states: list[AttnState],
                 *block: torch.Tensor, scale: float, what: str,
                 masks: Callable[[int], list[torch.Tensor | None]] | None = None) -> None:
        R = len(self.ranks)
        bufs = self.bufs.pair(block) if R > 1 else []
        cur = block
        for s in ring_schedule(R):
            if s.fetch:
                nxt = bufs[s.i % 2]
                handles = self._fetch(s.i, block, cur, nxt, what=f"{what}, ring step {s.i}/{R - 1}")
            key_masks = None if masks is None else masks(self.origin(s.i))
            attend(q_chunks, slots(*cur), states, scale=scale, key_masks=key_masks)
            if s.fetch:
                for h in handles:
                    h.wait()
                cur = nxt

    def _fetch(self, i: int, own, cur, dst, *, what: str) -> list[Handle]:
        raise NotImplementedError

    def origin(self, i: int) -> int:
        """Ring rank whose block is attended at step ``i`` (1..R)."""
        raise NotImplementedError


class PassRing(_Ring):
    """Two-sided: send the current block to ``r + 1`` while receiving from ``r - 1``, one
    exchange per step on the ``"ring"`` queue (with R = 2 both are the same peer)."""

    comm: TwoSided

    def origin(self, i):
        return (self.r - (i - 1)) % len(self.ranks)

    def _fetch(self, i, own, cur, dst, *, what):
        R = len(self.ranks)
        nxt, prv = self.ranks[(self.r + 1) % R], self.ranks[(self.r - 1) % R]
        return [self.comm.exchange([(c, nxt) for c in cur], [(d, prv) for d in dst],
                                   what=what, queue="ring")]

    @staticmethod
    def fetch_ops(prog: Program, ranks: tuple[int, ...], r: int, i: int,
                  tensors: tuple[int, ...]) -> list[str]:
        """``_fetch``'s transfer: one exchange of the block's tensors (bytes each)."""
        R = len(ranks)
        nxt, prv = ranks[(r + 1) % R], ranks[(r - 1) % R]
        return [prog.transfer("exchange", "ring", [(nxt, b) for b in tensors],
                              [(prv, b) for b in tensors])]


class PullRing(_Ring):
    """One-sided: get ring rank ``r + i``'s own block (symmetric views; packed: one get)."""

    comm: OneSided

    def origin(self, i):
        return (self.r + (i - 1)) % len(self.ranks)

    def _fetch(self, i, own, cur, dst, *, what):
        peer = self.ranks[(self.r + i) % len(self.ranks)]
        return [self.comm.get(d, s, peer, queue="ring", what=f"{what} (from rank {peer})")
                for d, s in zip(dst, own)]

    @staticmethod
    def fetch_ops(prog: Program, ranks: tuple[int, ...], r: int, i: int,
                  tensors: tuple[int, ...]) -> list[str]:
        """``_fetch``'s transfers: one get per tensor of the block (bytes each)."""
        peer = ranks[(r + i) % len(ranks)]
        return [prog.transfer("get", "ring", recvs=[(peer, b)]) for b in tensors]


def ring_ops(prog: Program, form: type[_Ring], ranks: tuple[int, ...], r: int,
             q_rows: tuple[int, ...], kv_rows: tuple[int, ...], bh: int,
             tensors: tuple[int, ...]) -> None:
    """Append ring attention of query chunks ``q_rows`` against the blocks of the ring group
    ``ranks`` (I am ring rank ``r``), each block K/V chunks of ``kv_rows`` moving as
    ``tensors`` (bytes each: ``(K, V)``, or one packed K/V), over ``form`` (``PassRing`` or
    ``PullRing``): the steps of ``ring_schedule``."""
    for s in ring_schedule(len(ranks)):
        handles = form.fetch_ops(prog, ranks, r, s.i, tensors) if s.fetch else []
        prog.add(Attend(q_rows, kv_rows, bh))
        prog.wait(*handles)
