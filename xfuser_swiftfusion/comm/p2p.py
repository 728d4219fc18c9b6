"""Two-sided communicator over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Every transfer is an ``isend``/``irecv`` pair on global ranks, so no subgroup objects are
needed for arbitrary rank sets. Messages between one pair of ranks match in posting order.

``directional=True`` sends rank pairs' traffic on two process groups, one per direction
(lower -> higher rank, higher -> lower): gloo has one socket per rank pair and group, so two
ranks sending to each other at once on one group halve each other's throughput.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .base import CommTimeout, Handle, PeerFailure, TwoSided


class _WorkHandle(Handle):
    """Pending isend/irecv works; on completion, copy staged receives into their targets."""

    def __init__(self, comm: "P2PCommunicator", works: list[Any],
                 unstage: list[tuple[torch.Tensor, torch.Tensor]], peers: list[int], what: str) -> None:
        self._comm, self._works, self._unstage, self._peers, self._what = comm, works, unstage, peers, what

    def wait(self) -> None:
        c = self._comm
        deadline = time.monotonic() + c.timeout_s
        for work in self._works:
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                work.wait(timeout=timedelta(seconds=remaining))
            except RuntimeError as exc:
                doing = f"rank {c.rank}: {self._what!r}: exchange with peers {self._peers}"
                if "timed out" in str(exc).lower():
                    raise CommTimeout(f"{doing} did not complete within {c.timeout_s:.1f} s") from exc
                raise PeerFailure(f"{doing} failed: {exc}") from exc
        for dst, staged in self._unstage:
            dst.copy_(staged)
        self._works, self._unstage = [], []


@dataclass(eq=False)
class P2PCommunicator(TwoSided):
    """``exchange``/``all_to_all`` from isend/irecv; optionally one process group per direction."""

    directional: bool = False
    _groups: tuple[Any, Any] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not dist.is_initialized():
            raise RuntimeError("P2PCommunicator needs torch.distributed initialised")
        if self.directional:  # collective: every rank creates both, in this order
            self._groups = (dist.new_group(list(range(self.world_size))),
                            dist.new_group(list(range(self.world_size))))
        self._stream = torch.cuda.Stream() if dist.get_backend() == "nccl" else None

    def _group(self, src: int, dst: int) -> Any:
        """Process group carrying messages ``src -> dst`` (None: the default group)."""
        if self._groups is None:
            return None
        return self._groups[0] if src < dst else self._groups[1]

    @contextlib.contextmanager
    def _issue_stream(self) -> Iterator[None]:
        """On CUDA, issue on a side stream ordered after the current (compute) stream."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                 *, what: str) -> Handle:
        """Post every receive, then every send; one handle for the batch. Sends and receives
        with the same peer match in list order; those with myself are copied here, now.
        Sources must stay unchanged until waited."""
        own_sends = [t for t, p in sends if p == self.rank]
        own_recvs = [t for t, p in recvs if p == self.rank]
        if len(own_sends) != len(own_recvs):
            raise ValueError(f"rank {self.rank}: {what!r}: {len(own_sends)} sends to myself but "
                             f"{len(own_recvs)} receives from myself")
        for dst, src in zip(own_recvs, own_sends):
            dst.copy_(src)
        sends = [(t, p) for t, p in sends if p != self.rank]
        recvs = [(t, p) for t, p in recvs if p != self.rank]
        peers = sorted({p for _, p in (*sends, *recvs)})
        for p in peers:
            if not 0 <= p < self.world_size:
                raise ValueError(f"rank {self.rank}: {what!r}: invalid exchange peer {p}")
        works, unstage = [], []
        try:
            with self._issue_stream():
                for t, p in recvs:
                    buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    works.append(dist.irecv(buf, src=p, group=self._group(p, self.rank)))
                    if buf is not t:
                        unstage.append((t, buf))
                for t, p in sends:
                    works.append(dist.isend(t.contiguous(), dst=p, group=self._group(self.rank, p)))
                    self.counter.count(p, t.numel() * t.element_size())
        except RuntimeError as exc:  # gloo raises at posting time once a peer's socket closed
            raise PeerFailure(f"rank {self.rank}: {what!r}: posting an exchange with peers {peers} "
                              f"failed: {exc}") from exc
        return _WorkHandle(self, works, unstage, peers, what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], *,
                   what: str) -> None:
        """Chunk ``j`` of ``inp`` (dim 0) goes to ``ranks[j]``; chunk ``j`` of ``out`` comes from it."""
        if self.rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"rank {self.rank}: all_to_all group {ranks} must hold distinct "
                             "ranks including mine")
        n = len(ranks)
        if inp.shape != out.shape or inp.shape[0] % n:
            raise ValueError(f"all_to_all over {n} ranks needs equal shapes with dim 0 divisible "
                             f"by {n}, got out {tuple(out.shape)} and inp {tuple(inp.shape)}")
        self.exchange(list(zip(inp.chunk(n), ranks)), list(zip(out.chunk(n), ranks)),
                      what=what).wait()

    def close(self) -> None:
        """Directional groups are left to ``destroy_process_group`` (destroying one is collective)."""
        self._groups = None
