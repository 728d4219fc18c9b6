"""``swiftfusion``: the Torus schedule over one-sided put/get (paper Algorithm 1).

Symmetric buffers on every rank: staging ``Qb, Kb, Vb`` ``[T, U, B, h, S, D]``, pulled
``Q, K, V`` ``[T-1, U, B, h, S, D]``, outputs ``O`` and ``Ob`` ``[T, U, B, h, S + Tj, D]``.
Slot ``[t, :]`` of ``Qb/Kb/Vb`` is the local working slot (it is only written by the
intra-machine scatter); pulled blocks are stored by stage, machine ``(t - k) % T`` in slot
``k - 1`` (the same slot on every ring peer, which shares ``t``). So Q, K and V each have
(T-1)/T of an extra copy besides their staging buffer, O one. Pulled K/V are symmetric
because ring peers read them; pulled Q (a get's destination) and O (a put's source) because
NVSHMEM's inter-machine transports need the local side of a transfer registered too.

Synchronisation: one ``barrier_all`` after the intra-machine scatter, one at the end of the
layer, and a ring-group sync (no quiet) per Pull-KV stage. Why that is enough:
- ``Qb/Kb/Vb[a != t]`` (read by other machines' gets) are rewritten at the start of the next
  layer, after every get of this layer completed (end barrier: ranks quiet before it);
- ``Qb/Kb/Vb[t]`` is written only by the scatter's puts, after the previous end barrier;
- ``K/V[t']`` is pulled into (and waited for) before ring peers read it; the Pull-KV ring
  sync orders that without draining the later stages' pulls still in flight;
- ``Ob`` is copied out before this rank enters the next layer's first barrier, which every
  peer must pass before it pushes into ``Ob`` again.
"""
from __future__ import annotations

import torch

from ..comm.base import Handle, OneSided
from ..topology import Mesh
from .layout import split_heads
from .ring import PullRing


class OneSidedTorusIO:
    """Torus transport over a symmetric heap (NVSHMEM on GPU, shared memory on CPU)."""

    def __init__(self, mesh: Mesh, comm: OneSided, rank: int) -> None:
        self.mesh, self.comm, self.rank = mesh, comm, rank
        self.t, self.u, self.r = mesh.coords(rank)
        self.ring_ranks = mesh.ring_groups[self.t * mesh.ulysses_intra + self.u]
        self._ring = PullRing(comm, self.ring_ranks, self.r)
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}

    def _peer(self, a: int, b: int) -> int:
        return self.mesh.rank_of(a, b, self.r)

    def _put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, what: str) -> None:
        if peer == self.rank:
            dst.copy_(src)
        else:
            self.comm.put(dst, src, peer, queue="other", what=what)

    def _alloc(self, q: torch.Tensor, out_len: int) -> dict[str, torch.Tensor]:
        """Collective on first use of a shape: every rank allocates the same buffers in order."""
        T, U = self.mesh.torus, self.mesh.ulysses_intra
        B, H, S, D = q.shape
        key = (tuple(q.shape), q.dtype, out_len)
        if key not in self._buffers:
            shape = lambda m, n: (m, U, B, H // (T * U), n, D)  # noqa: E731
            pulled = ("Q", "K", "V") if T > 1 else ()  # one machine: nothing to pull
            buf = {n: self.comm.symmetric_empty(shape(T, S), q.dtype) for n in ("Qb", "Kb", "Vb")}
            buf |= {n: self.comm.symmetric_empty(shape(T - 1, S), q.dtype) for n in pulled}
            buf |= {n: self.comm.symmetric_empty(shape(T, out_len), q.dtype) for n in ("O", "Ob")}
            self._buffers[key] = buf
        return self._buffers[key]

    def stage_in(self, q, k, v, out_len):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        self.buf = self._alloc(q, out_len)
        self.O, self.Ob = self.buf["O"], self.buf["Ob"]
        for n, x in (("Qb", q), ("Kb", k), ("Vb", v)):
            src = split_heads(x, T, U)  # [B, H, S, D] -> [T, U, B, h, S, D] (view)
            for a in range(T):
                if a != t:  # step 1: slots other machines will pull from me
                    self.buf[n][a].copy_(src[a])
            for b in range(U):  # step 2: ScatterPush my slot [t, b] into GPU (t, b, r)'s [t, u]
                self._put(self.buf[n][t, u], src[t, b], self._peer(t, b), f"Ulysses scatter {n[0]}")
        self.comm.barrier_all(what="barrier 1 (after intra-machine Ulysses scatter)")

    def issue_pulls(self):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        b_ = self.buf

        def gather_pull(names: tuple[str, ...], kk: int, what: str) -> list[Handle]:
            tp = (t - kk) % T
            return [self.comm.get(b_[dst][self._slot(tp), b], b_[src][t, u], self._peer(tp, b),
                                  queue="other", what=f"{what}, {dst} from rank {self._peer(tp, b)}")
                    for dst, src in names for b in range(U)]

        EQ = {kk: gather_pull((("Q", "Qb"),), kk, f"Pull-Q stage {kk + 1}") for kk in range(1, T)}
        EKV = {kk: gather_pull((("K", "Kb"), ("V", "Vb")), kk, f"Pull-KV stage {kk}")
               for kk in range(1, T)}
        return EQ, EKV

    def _slot(self, a: int) -> int:
        """Slot of machine ``a``'s pulled block (stage k = (t - a) % T stores it in k - 1)."""
        return (self.t - a) % self.mesh.torus - 1

    def q_block(self, a):
        return self.buf["Qb"][a] if a == self.t else self.buf["Q"][self._slot(a)]

    def kv_block(self, a):
        if a == self.t:
            return self.buf["Kb"][a], self.buf["Vb"][a]
        return self.buf["K"][self._slot(a)], self.buf["V"][self._slot(a)]

    def ring(self, q_chunks, states, a, *, scale, what):
        self._ring(q_chunks, states, *self.kv_block(a), scale=scale, what=what)

    def barrier_ring(self, *, what):
        if len(self.ring_ranks) > 1:  # ring peers are about to pull my K/V[t'], which I waited
            # for; a sync, not a barrier: a barrier's quiet would drain the later stages' pulls
            self.comm.sync(self.ring_ranks, what=f"{what} ring-group sync")

    def push_o(self, kk):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        tp = (t - kk) % T
        for b in range(U):  # ScatterPush O[t', b] into GPU (t', b, r)'s Ob[t, u]
            self._put(self.Ob[t, u], self.O[tp, b], self._peer(tp, b), f"Push-O to machine {tp}")

    def stage_out(self):
        self.comm.barrier_all(what="barrier 2 (after Push-O)")
        return self.Ob

    def heap_bytes(self) -> int:
        return self.comm.symmetric_heap_bytes()
