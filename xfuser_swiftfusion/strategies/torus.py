"""Torus attention (paper section 4.3, Algorithm 1; DESIGN.md section 2).

GPU ``x = (t, u, r)``: torus (machine) rank t of T, intra-machine Ulysses rank u of U,
ring rank r of R. Heads split into ``T*U`` groups of ``h``; group ``(a, b)`` is owned by
GPU ``(a, b, r)``. Working set per GPU, ``[T, U, B, h, S, D]`` (slot ``[a, b]`` = tokens of
GPU ``(a, b, r)``, head group ``(t, u)``); outputs in ``[T, U]`` slots (``layout.Slots``:
``[B, h, S, D]`` image rows, then ``[B, h, Tj, D]`` text rows). The output of query block
``a`` is written only after the block's last use, so a transport may keep query block ``a``
in the image rows of output slot ``a`` (both transports do: one buffer less).

Two refinements of Algorithm 1, with the same work and bytes:
- the local queries attend to each remote K/V block in the Pull-KV stage that brings it
  (Algorithm 1 defers all of that to Push-O); only the last block's share stays there, to
  overlap the pushes. On a link-bound layer compute idles while a stage's data arrives, and
  the work left after the last arrival shrinks from 2(T-1) query blocks to T;
- the last Pull-KV stage runs one remote query block at a time, so each remote output is
  pushed as soon as it is final instead of all after the stage.

The schedule is written once (``TorusAttention``) over a transport with five operations;
``TwoSidedTorusIO`` (this file, the ``torus`` strategy) implements them with matched
isend/irecv, ``OneSidedTorusIO`` (``swiftfusion.py``) with put/get on a symmetric heap.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..comm.base import Handle, TwoSided
from ..kernels import AttnState, attend, new_state
from ..topology import Mesh
from .layout import Joint, Slots, gather_output, split_heads
from .ring import PassRing


class TorusIO(Protocol):
    """What the schedule needs from communication (all indices are torus ranks)."""

    def stage_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int) -> None:
        """Steps 1-2: intra-machine Ulysses; afterwards ``q_block(t)``/``kv_block(t)`` hold my
        machine's tokens of my head group; ``O``, ``Ob`` are ``[T, U]`` slots of S image rows
        and ``text_len`` text rows."""

    def issue_pulls(self) -> tuple[dict[int, list[Handle]], dict[int, list[Handle]]]:
        """Step 3: every inter-machine Q, then K/V transfer; handles per stage k = 1..T-1."""

    def q_block(self, a: int) -> torch.Tensor:
        """``[U, B, h, S, D]``: queries of machine ``a``'s tokens, my head group (may be
        ``O.rows[a]``: valid until the schedule writes output ``a``)."""
    def kv_block(self, a: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def ring(self, q_chunks: list[torch.Tensor], states: list[AttnState], a: int, *,
             scale: float, what: str) -> None:
        """Ring attention of ``q_chunks`` against K/V block ``a`` over my ring group."""
    def barrier_ring(self, *, what: str) -> None: ...
    def push_o(self, k: int) -> None:
        """Send ``O[(t-k)%T, :]`` to its owners (k = 0: my machine); receive my outputs."""
    def stage_out(self) -> Slots:
        """Complete every push; return ``Ob`` (slot ``[a, b]`` = my tokens, head group (a, b))."""

    O: Slots  # [T, U] outputs computed here, slot [a, b] owned by GPU (a, b, r)


class TorusAttention:
    """Callable ``(q, k, v, joint) -> out`` under the USP contract, running the Torus schedule."""

    def __init__(self, name: str, mesh: Mesh, io: TorusIO, rank: int) -> None:
        self.name, self.mesh, self.io = name, mesh, io
        self.t, self.u, self.r = mesh.coords(rank)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float) -> torch.Tensor:
        self.io.stage_in(q, k, v, joint.length if joint is not None else 0)  # steps 1-2
        self._stages(joint, scale)  # the running states live only in there, so they are
        # freed before the output is allocated and the two don't add up in the peak
        return gather_output(self.io.stage_out(), joint)  # [T, U] slots -> [B, H, S + Tj, D]

    def _stages(self, joint: Joint | None, scale: float) -> None:
        """Steps 3-7: every transfer issued, the Pull-Q, Pull-KV and Push-O stages."""
        io, T, U, t = self.io, self.mesh.torus, self.mesh.ulysses_intra, self.t
        EQ, EKV = io.issue_pulls()                                     # step 3
        Q = {a: list(io.q_block(a).unbind(0)) for a in range(T)}      # U chunks [B, h, S, D] per a
        st = {a: [new_state(c) for c in Q[a]] for a in range(T)}
        text_q, text_st, text_kv = [], [], []
        if joint is not None:
            jq, jk, jv = joint.head_group(t * U + self.u, T * U)
            text_q, text_st, text_kv = [jq], [new_state(jq)], [(jk, jv)]
        others = [a for a in range(T) if a != t]
        remote_q = [c for a in others for c in Q[a]] + text_q
        remote_st = [s for a in others for s in st[a]] + text_st

        # Pull-Q stage 1: local queries (and text queries) against local K/V, text K/V once.
        attend(Q[t] + text_q, text_kv, st[t] + text_st, scale=scale)
        io.ring(Q[t] + text_q, st[t] + text_st, t, scale=scale, what="Pull-Q stage 1")
        # Pull-Q stages 2..T: queries of machine t' against local K/V as they arrive.
        for kk in range(1, T):
            tp = (t - kk) % T
            _wait(EQ[kk])
            attend(Q[tp], text_kv, st[tp], scale=scale)
            io.ring(Q[tp], st[tp], t, scale=scale, what=f"Pull-Q stage {kk + 1}")
        # Pull-KV stages 1..T-1: every query against K/V of machine t' (the local queries
        # too, except against the last block: theirs is the work that hides Push-O).
        for kk in range(1, T):
            tp = (t - kk) % T
            _wait(EKV[kk])
            io.barrier_ring(what=f"Pull-KV stage {kk}")
            if kk < T - 1:
                io.ring(Q[t] + remote_q, st[t] + remote_st, tp, scale=scale,
                        what=f"Pull-KV stage {kk}")
        # ... the last one block by block (text queries with the first): each remote output
        # is final after its block and leaves at once (Push-O) while the next one computes.
        O = io.O  # [T, U] slots; O.rows[a] may hold Q[a] until its output is written

        def finish_text() -> None:
            if joint is not None:
                (txt,) = attend(text_q, [], text_st, scale=scale, finalize=True)
                O.text[:] = txt  # [B, h, Tj, D]: text rows of my head group ride in every slot

        for kk in range(1, T):
            tp = (t - kk) % T
            q_, st_ = (Q[tp] + text_q, st[tp] + text_st) if kk == 1 else (Q[tp], st[tp])
            io.ring(q_, st_, (t + 1) % T, scale=scale,
                    what=f"Pull-KV stage {T - 1}, queries of machine {tp}")
            if kk == 1:
                finish_text()
            attend(Q[tp], [], st[tp], scale=scale, finalize=True, out=list(O.rows[tp].unbind(0)))
            io.push_o(kk)
        if T == 1:
            finish_text()
        # Push-O: local queries against the last K/V block while the remote outputs travel.
        if T > 1:
            io.ring(Q[t], st[t], (t + 1) % T, scale=scale, what="Push-O")
        attend(Q[t], [], st[t], scale=scale, finalize=True, out=list(O.rows[t].unbind(0)))
        io.push_o(0)

    def heap_bytes(self) -> int:
        return self.io.heap_bytes()


def _wait(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


class TwoSidedTorusIO:
    """Torus transport over matched isend/irecv (the ``torus`` strategy).

    The one-sided "pull of slot [t, u] from GPU (t', b, r)" becomes: GPU (t', b, r) sends
    it while I receive it; every rank posts both halves of stage k at once.
    """

    def __init__(self, mesh: Mesh, comm: TwoSided, rank: int) -> None:
        self.mesh, self.comm = mesh, comm
        self.t, self.u, self.r = mesh.coords(rank)
        self.ring_ranks = mesh.ring_groups[self.t * mesh.ulysses_intra + self.u]
        self._ring = PassRing(comm, self.ring_ranks, self.r)
        self._buffers: dict[tuple, dict[str, torch.Tensor | Slots]] = {}
        self._pending: list[Handle] = []

    def _peer(self, a: int, b: int) -> int:
        return self.mesh.rank_of(a, b, self.r)

    def stage_in(self, q, k, v, text_len):
        T, U = self.mesh.torus, self.mesh.ulysses_intra
        B, H, S, D = q.shape
        h = H // (T * U)
        key = (tuple(q.shape), q.dtype, q.device, text_len)
        if key not in self._buffers:
            O, Ob = (Slots.alloc(q.new_empty, (T, U), B, h, S, text_len, D) for _ in range(2))
            self._buffers = {key: {"Q": O.rows,  # the received Q block of machine a lives in O.rows[a]
                                   "K": q.new_empty(T, U, B, h, S, D), "V": q.new_empty(T, U, B, h, S, D),
                                   "O": O, "Ob": Ob}}
        self.buf = self._buffers[key]
        self.O, self.Ob = self.buf["O"], self.buf["Ob"]
        # step 1, [B, H, S, D] -> [T, U, B, h, S, D]: my tokens, every head group (send buffers)
        self.src = {n: split_heads(x, T, U).contiguous() for n, x in (("Q", q), ("K", k), ("V", v))}
        _wait(self._exchange(0, ("Q", "K", "V"), "Ulysses scatter (intra-machine)"))

    def _exchange(self, kk: int, names: tuple[str, ...], what: str) -> list[Handle]:
        """Stage kk: send my slots [t+kk, b] to GPU (t+kk, b, r); receive its slot [t, u]
        into my slot [t-kk, b] (kk = 0: within my machine)."""
        T, U, t = self.mesh.torus, self.mesh.ulysses_intra, self.t
        tn, tp = (t + kk) % T, (t - kk) % T
        return [self.comm.exchange([(self.src[n][tn, b], self._peer(tn, b)) for b in range(U)],
                                   [(self.buf[n][tp, b], self._peer(tp, b)) for b in range(U)],
                                   what=f"{what} {n}") for n in names]

    def issue_pulls(self):
        T = self.mesh.torus
        EQ = {kk: self._exchange(kk, ("Q",), f"Pull-Q stage {kk + 1}") for kk in range(1, T)}
        EKV = {kk: self._exchange(kk, ("K", "V"), f"Pull-KV stage {kk}") for kk in range(1, T)}
        return EQ, EKV

    def q_block(self, a):
        return self.buf["Q"][a]

    def kv_block(self, a):
        return self.buf["K"][a], self.buf["V"][a]

    def ring(self, q_chunks, states, a, *, scale, what):
        self._ring(q_chunks, states, *self.kv_block(a), scale=scale, what=what)

    def barrier_ring(self, *, what):
        """Two-sided rings synchronise through their own sends and receives."""

    def push_o(self, kk):
        # mirrors the pulls: I receive my tokens' outputs for head group (t+kk, b) from its owner
        T, U, t = self.mesh.torus, self.mesh.ulysses_intra, self.t
        tp, tn = (t - kk) % T, (t + kk) % T
        sends = [(self.O.flat[tp, b], self._peer(tp, b)) for b in range(U)]
        recvs = [(self.Ob.flat[tn, b], self._peer(tn, b)) for b in range(U)]
        self._pending.append(self.comm.exchange(sends, recvs, what=f"Push-O to machine {tp}"))

    def stage_out(self):
        pending, self._pending = self._pending, []
        _wait(pending)
        return self.Ob

    def heap_bytes(self) -> int:
        return 0
