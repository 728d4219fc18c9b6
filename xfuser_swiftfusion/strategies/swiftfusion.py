"""``swiftfusion``: the Torus schedule over one-sided put/get (paper Algorithm 1).

Symmetric buffers on every rank (``[T, U]`` grids of slots, ``layout.Slots``: image rows
``[B, h, S, D]`` then text rows ``[B, h, Tj, D]``):
- ``QO`` (slots): image rows of slot ``a`` hold the query block of machine ``a`` (``a = t``:
  scattered within my machine; else pulled from machine ``a``), then its output;
- ``QOb`` (slots): slot ``a != t`` first stages my queries for machine ``a`` to pull, then
  receives my tokens' outputs pushed back by that machine (slot ``t``: from my machine);
- ``KVb`` ``[T, U, 2, B, h_kv, S, D]`` (h_kv = H_kv / (T*U) K/V heads, grouped-query
  attention; K and V of a slot adjacent, so they move in one
  transfer): slot ``a != t`` staged for machine ``a``, slot ``t`` my working K/V (written only
  by the intra-machine scatter);
- pulled ``KV`` ``[T-1, U, 2, B, h_kv, S, D]``, machine ``(t - k) % T`` in slot ``k - 1`` (the
  same slot on every ring peer, which shares ``t``: ring peers read them);
- with K/V pieces (option ``kv_pieces`` P > 1, ``torus.py``): ``PKV``, P buffers
  ``[U, 2, B, h_kv, S_p, D]``: piece p of the last stage's block, pulled from rows
  ``[lo, hi)`` of the peers' staged ``KVb`` slots (a strided remote side: 2 B h_kv runs) into a
  contiguous local one, attended and read by the ring peers where it lands; ``KV[T-2]`` stays
  unused.
Per rank that is 2 X' + (2 + 2 (T-1)/T) X (X: one rank's Q, X': with text rows). Pulled Q
and QO/QOb are symmetric although no peer reads them because NVSHMEM's inter-machine
transports need the local side of a transfer registered too.

FP8 communication (option ``fp8_comms``, T > 1): what crosses machines moves as ``fp8.py``
wire slots in symmetric ``uint8`` buffers, one transfer per slot as without it (scales
appended to each slot's bytes): ``Qw`` / ``KVw`` ``[T, U, bytes]`` (slot ``a != t`` staged
for machine ``a``; K/V one slot of two parts, two scales), ``Qr`` ``[T, U, bytes]`` / ``KVr``
``[T-1, U, bytes]`` (pulled, as ``QO.rows`` / ``KV``), ``Ow`` / ``Or`` ``[T, U, bytes]`` (Push-O
sources / destinations, as ``QO`` / ``QOb``). A pulled block is dequantized into ``QO.rows`` /
``KV`` when its stage is waited for, the pushed outputs into ``QOb`` after barrier 2. The
Pull-KV ring synchronisation is then a ring-group ``barrier``, not a ``sync``: the ring peers
read the dequantized ``KV`` slot, which is compute (on GPU: the current stream) that a sync
does not follow; the barrier's quiet also completes the later stages' pulls in flight.

Synchronisation: one ``barrier_all`` after the intra-machine scatter, one at the end of the
layer, and a ring-group sync (no quiet) per Pull-KV stage. Why that is enough:
- staged slots ``[a != t]`` are rewritten at the start of the next layer, after every get of
  this layer completed (end barrier: ranks quiet before it);
- the working slots ``[t]`` are written only by the scatter's puts, after the previous end
  barrier, by which this rank's pushes out of ``QO[t]`` completed;
- ``QOb[a, b]`` is pushed into by GPU ``(a, b, r)`` only after it completed its get of the
  queries staged there (its own program order), and I read it after the end barrier;
- ``K/V[t']`` is pulled into (and waited for) before ring peers read it; the Pull-KV ring
  sync orders that without draining the later stages' pulls still in flight (with pieces:
  a sync per piece, after its wait, before the ring peers read ``PKV[p]``);
- with ``launches="stage"`` a block's ring gather (``ring_all``: gets of the peers' ``KVb[t]``
  after barrier 1, of their ``K/V[t']`` after that stage's ring sync, into the local ``G``)
  reads the same slots the ring's gets read, at the same points, so the same reasoning holds;
- ``QOb`` is copied out before this rank enters the next layer's first barrier, which every
  peer must pass before it pushes into ``QOb`` again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import plan
from ..comm.base import Handle, OneSided
from ..comm.nvshmem import team_split_args
from ..groups import SPGroups
from ..log import get_logger, log_once
from . import fp8
from .layout import Slots, split_heads
from .ops import Barrier, Copy
from .registry import NATIVE, BuildArgs, StrategySpec, get, register
from .ring import PullRing, ring_ops, slots
from .torus import (TorusAttention, TorusOps, check_whole_block, kv_key, kv_pieces_option, piece_bounds,
                    ring_peers, staged_pieces, torus_ops)

logger = get_logger(__name__)


def machine_order(u: int, U: int) -> list[int]:
    """The order in which GPU ``u`` of a machine addresses the ``U`` GPUs of a machine: its own
    index first, then the next ones, wrapping (``[u, u+1, ..., U-1, 0, ..., u-1]``). Transfers
    on one queue run in issue order, so with this order the ``U`` GPUs of a machine reach ``U``
    different GPUs at every position of their queues instead of all queueing on GPU 0's
    memory and NIC first."""
    return [(u + j) % U for j in range(U)]


class OneSidedTorusIO:
    """Torus transport over a symmetric heap (NVSHMEM on GPU, shared memory on CPU); K/V
    pieces (``stage_in(..., pieces=P)``) as the module docstring says, not with ``fp8_comms``."""

    def __init__(self, groups: SPGroups, comm: OneSided, rank: int, fp8_comms: bool = False) -> None:
        self.mesh = mesh = groups.mesh
        self.comm, self.rank, self.fp8 = comm, rank, fp8_comms and mesh.torus > 1
        self.t, self.u, self.r = mesh.coords(rank)
        self.ring_ranks = groups.ring_ranks
        self._ring = PullRing(comm, self.ring_ranks, self.r)
        self._buffers: dict[tuple, dict[str, torch.Tensor | Slots]] = {}

    def _peer(self, a: int, b: int) -> int:
        return self.mesh.rank_of(a, b, self.r)

    def _put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, what: str) -> None:
        if peer == self.rank:
            plan.call(lambda: dst.copy_(src))
        else:
            self.comm.put(dst, src, peer, queue="other", what=what)

    def _alloc(self, q: torch.Tensor, heads_kv: int, text_len: int) -> dict[str, torch.Tensor | Slots]:
        """Collective on first use of a shape: every rank allocates the same buffers in order
        (``heads_kv``: K/V heads, a multiple of T*U)."""
        key = (tuple(q.shape), heads_kv, q.dtype, text_len, self.pieces)
        if key in self._buffers:
            return self._buffers[key]
        T, U = self.mesh.torus, self.mesh.ulysses_intra
        B, H, S, D = q.shape
        h, h_kv = H // (T * U), heads_kv // (T * U)
        with plan.preparing():
            sym = lambda shape: self.comm.symmetric_empty(shape, q.dtype)  # noqa: E731
            slots = lambda: Slots.alloc(sym, (T, U), B, h, S, text_len, D)  # noqa: E731
            kv = lambda m: sym((m, U, 2, B, h_kv, S, D))  # noqa: E731
            buf = {"QO": slots(), "QOb": slots(), "KVb": kv(T)}
            if T > 1:  # one machine: nothing to pull
                buf["KV"] = kv(T - 1)
            if self.pieces > 1:  # the last stage's pieces, each where it lands
                buf["PKV"] = [sym((U, 2, B, h_kv, hi - lo, D)) for lo, hi in self.bounds]
            if self.fp8:  # wire slots (uint8) of what crosses machines
                nq, nkv = B * h * S * D, B * h_kv * S * D
                no = Slots.numel(B, h, S, text_len, D)
                def wire(lead: tuple[int, ...], m: int, parts: int = 1) -> torch.Tensor:
                    return fp8.wire_empty(self.comm.symmetric_empty, lead, m, parts)
                buf |= {"Qw": wire((T, U), nq), "Qr": wire((T, U), nq),
                        "KVw": wire((T, U), nkv, 2), "KVr": wire((T - 1, U), nkv, 2),
                        "Ow": wire((T, U), no), "Or": wire((T, U), no)}
        self._buffers[key] = buf
        return buf

    def stage_in(self, q, k, v, text_len, pieces: int = 1):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        self.pieces = staged_pieces(T, pieces, self.fp8)
        self.bounds = piece_bounds(q.shape[2], self.pieces)
        self.buf = self._alloc(q, k.shape[1], text_len)
        self.O, self.Ob = self.buf["QO"], self.buf["QOb"]
        self._gathered: dict[int, list] = {}
        KVb = self.buf["KVb"]  # [T, U, 2, B, h_kv, S, D]
        staged = {"Q": self.Ob.rows, "K": KVb[:, :, 0], "V": KVb[:, :, 1]}  # [T, U, B, h(_kv), S, D]
        working = {n: x[t] for n, x in staged.items()} | {"Q": self.O.rows[t]}  # [U, B, h(_kv), S, D]
        # [B, H(_kv), S, D] -> [T, U, B, h(_kv), S, D] (views)
        srcs = {n: split_heads(x, T, U) for n, x in (("Q", q), ("K", k), ("V", v))}
        for a in range(T):  # step 1: slots other machines will pull from me
            if a == t:
                continue
            if self.fp8:  # [U, B, h(_kv), S, D] -> wire [U, bytes] (K and V: one slot)
                qw, kvw, sq, sk, sv = (self.buf["Qw"][a], self.buf["KVw"][a], srcs["Q"][a],
                                       srcs["K"][a], srcs["V"][a])
                plan.call(lambda qw=qw, kvw=kvw, sq=sq, sk=sk, sv=sv: (
                    fp8.quantize_(qw, sq), fp8.quantize_(kvw, sk, sv)))
            else:
                for n, src in srcs.items():
                    dst, src_a = staged[n][a], src[a]
                    plan.call(lambda dst=dst, src_a=src_a: dst.copy_(src_a))
        for n, src in srcs.items():
            for b in machine_order(u, U):  # step 2: ScatterPush my slot [t, b] into GPU (t, b, r)'s [t, u]
                self._put(working[n][u], src[t, b], self._peer(t, b), f"Ulysses scatter {n}")
        self.comm.barrier_all(what="barrier 1 (after intra-machine Ulysses scatter)")

    def issue_pulls(self):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        b_ = self.buf

        def pull(kk: int, blocks: list[tuple[str, torch.Tensor, torch.Tensor]], what: str) -> list[Handle]:
            """Stage kk: from GPU (t', b, r), t' = t - kk, its staged slot [t, u] of each
            ``(name, my [U, ...] destination, staged [T, U, ...])`` into my destination [b]."""
            tp = (t - kk) % T
            return [self.comm.get(dst[b], staged[t, u], self._peer(tp, b), queue="other",
                                  what=f"{what}, {n} from rank {self._peer(tp, b)}")
                    for n, dst, staged in blocks for b in machine_order(u, U)]

        if self.fp8:  # wire slots, dequantized when the stage is waited for
            rows = self.O.rows
            EQ = {kk: [fp8.Arrival(pull(kk, [("Q", b_["Qr"][(t - kk) % T], b_["Qw"])],
                                        f"Pull-Q stage {kk + 1} (fp8)"),
                                   lambda a=(t - kk) % T: fp8.dequantize_(b_["Qr"][a], rows[a]))]
                  for kk in range(1, T)}
            EKV = {kk: [fp8.Arrival(pull(kk, [("K/V", b_["KVr"][kk - 1], b_["KVw"])],
                                         f"Pull-KV stage {kk} (fp8)"),
                                    lambda i=kk - 1: fp8.dequantize_(b_["KVr"][i], b_["KV"][i][:, 0],
                                                                     b_["KV"][i][:, 1]))]
                   for kk in range(1, T)}
            return EQ, EKV
        EQ = {kk: pull(kk, [("Q", self.O.rows[(t - kk) % T], self.Ob.rows)], f"Pull-Q stage {kk + 1}")
              for kk in range(1, T)}
        P = self.pieces
        EKV = {kk: pull(kk, [("K/V", b_["KV"][kk - 1], b_["KVb"])], f"Pull-KV stage {kk}")
               for kk in range(1, T - 1 if P > 1 else T)}
        for p, (lo, hi) in enumerate(self.bounds if P > 1 else []):  # rows [lo, hi) of the staged slots
            EKV[kv_key(T - 1, p)] = pull(T - 1, [("K/V", b_["PKV"][p], b_["KVb"][..., lo:hi, :])],
                                         f"Pull-KV stage {T - 1}, piece {p + 1}/{P}")
        return EQ, EKV

    def _slot(self, a: int) -> int:
        """Slot of machine ``a``'s pulled block (stage k = (t - a) % T stores it in k - 1)."""
        return (self.t - a) % self.mesh.torus - 1

    def q_block(self, a):
        return self.O.rows[a]

    def _kv(self, a: int, piece: int | None = None) -> torch.Tensor:
        """``[U, 2, B, h_kv, S, D]``: K/V of machine ``a``'s tokens, my head group (``piece``:
        that piece of the last stage's block, ``[U, 2, B, h_kv, S_p, D]``)."""
        if piece is not None:
            return self.buf["PKV"][piece]
        check_whole_block(a, self.t, self.mesh.torus, self.pieces)
        return self.buf["KVb"][a] if a == self.t else self.buf["KV"][self._slot(a)]

    def kv_block(self, a, piece: int | None = None):
        kv = self._kv(a, piece)
        return kv[:, 0], kv[:, 1]

    def ring(self, q_chunks, states, a, *, scale, what, masks=None, piece=None):
        self._ring(q_chunks, states, self._kv(a, piece), scale=scale, what=what,
                   masks=masks)  # packed: one get a step

    def ring_all(self, a, *, what, piece=None):
        """Gets of block ``a`` (``piece``: that piece of it) from every ring peer's symmetric
        buffer (the ``"ring"`` queue) into ``G`` (``[T, R-1, U, 2, B, h_kv, S, D]``, slot
        ``i - 1`` = ring rank ``r + i``; a piece: ``GP[piece]``, ``[R-1, U, 2, B, h_kv, S_p,
        D]``), each peer's block one transfer."""
        key = a if piece is None else ("piece", piece)
        if key not in self._gathered:
            R, r, own = len(self.ring_ranks), self.r, self._kv(a, piece)  # [U, 2, B, h_kv, S(_p), D]
            blocks = {r: own}
            if R > 1:
                if piece is None and "G" not in self.buf:
                    self.buf["G"] = torch.empty((self.mesh.torus, R - 1, *own.shape), dtype=own.dtype,
                                                device=own.device)
                if piece is not None and piece not in self.buf.setdefault("GP", {}):
                    self.buf["GP"][piece] = torch.empty((R - 1, *own.shape), dtype=own.dtype,
                                                        device=own.device)
                handles = []
                for i, (r2, p) in enumerate(ring_peers(self.ring_ranks, r)):
                    dst = self.buf["G"][a, i] if piece is None else self.buf["GP"][piece][i]
                    handles.append(self.comm.get(dst, own, p, queue="ring",
                                                 what=f"{what}, ring gather of block {a} from rank {p}"))
                    blocks[r2] = dst
                for h in handles:
                    h.wait()
            self._gathered[key] = [(r2, slots(blocks[r2])) for r2 in range(R)]
        return self._gathered[key]

    def barrier_ring(self, *, what):
        if len(self.ring_ranks) > 1 and self.fp8:  # ring peers are about to pull my K/V[t'],
            # dequantized after its get: a barrier follows that compute, a sync would not
            self.comm.barrier(self.ring_ranks, what=f"{what} ring-group barrier (fp8)")
        elif len(self.ring_ranks) > 1:  # ring peers are about to pull my K/V[t'], which I waited
            # for; a sync, not a barrier: a barrier's quiet would drain the later stages' pulls
            self.comm.sync(self.ring_ranks, what=f"{what} ring-group sync")

    def push_o(self, kk):
        T, U, t, u = self.mesh.torus, self.mesh.ulysses_intra, self.t, self.u
        tp = (t - kk) % T
        if self.fp8 and kk:  # across machines: wire slots, into GPU (t', b, r)'s Or[t, u]
            Ow, flat = self.buf["Ow"][tp], self.O.flat[tp]
            plan.call(lambda: fp8.quantize_(Ow, flat))  # [U, slot] -> [U, bytes]
            for b in machine_order(u, U):
                self._put(self.buf["Or"][t, u], Ow[b], self._peer(tp, b), f"Push-O to machine {tp} (fp8)")
            return
        for b in machine_order(u, U):  # ScatterPush O[t', b] into GPU (t', b, r)'s Ob[t, u]
            self._put(self.Ob.flat[t, u], self.O.flat[tp, b], self._peer(tp, b), f"Push-O to machine {tp}")

    def stage_out(self):
        self.comm.barrier_all(what="barrier 2 (after Push-O)")
        if self.fp8:  # the outputs pushed from the other machines: Or[a] -> Ob[a]
            for a in range(self.mesh.torus):
                if a != self.t:
                    wire, flat = self.buf["Or"][a], self.Ob.flat[a]
                    plan.call(lambda wire=wire, flat=flat: fp8.dequantize_(wire, flat))
        return self.Ob


class OneSidedTorusOps(TorusOps):
    """``OneSidedTorusIO``'s calls: puts and gets of single slots (K/V packed), ``PullRing``,
    a barrier after the scatter and at the end, a ring-group sync per Pull-KV stage; every
    loop over a machine's GPUs in ``machine_order``."""

    def peers(self, a: int, nbytes: int) -> list[tuple[int, int]]:
        return [(self.peer(a, b), nbytes) for b in machine_order(self.u, self.U)]

    def _everyone(self) -> tuple[int, ...]:
        return tuple(range(self.mesh.world_size))

    def stage_in(self) -> None:
        T, U = self.T, self.U
        self.prog.add(Copy(3 * (T - 1) * U * self.slot))  # slots other machines pull from me
        for _ in "QKV":
            for p, n in self.peers(self.t, self.slot):
                self.prog.transfer("put", "other", sends=[(p, n)])
        self.prog.add(Barrier(self._everyone()))

    def _gets(self, kk: int, nbytes: int) -> list[str | None]:
        return [self.prog.transfer("get", "other", recvs=[pn])
                for pn in self.peers((self.t - kk) % self.T, nbytes)]

    def issue_pulls(self) -> tuple[dict, dict]:
        T, P = self.T, self.pieces
        EQ = {kk: self._gets(kk, self.slot) for kk in range(1, T)}
        EKV = {kk: self._gets(kk, 2 * self.slot) for kk in range(1, T - 1 if P > 1 else T)}
        for p in range(P if P > 1 else 0):  # the last stage's pieces: K/V rows of each slot
            EKV[kv_key(T - 1, p)] = self._gets(T - 1, 2 * self.shape.nbytes(self.h, self.piece_rows[p]))
        return EQ, EKV

    def ring(self, q_rows: tuple[int, ...], piece: int | None = None) -> None:
        U, S = self.U, self.rows_of(piece)
        ring_ops(self.prog, PullRing, self.ring_ranks, self.r, q_rows, (S,) * U,
                 self.shape.batch * self.h, (2 * U * self.shape.nbytes(self.h, S),))

    def ring_all(self, piece: int | None = None) -> None:
        """``OneSidedTorusIO.ring_all``'s gets: one packed K/V block (piece) from every ring
        peer."""
        n = 2 * self.U * self.shape.nbytes(self.h, self.rows_of(piece))
        self.prog.wait(*(self.prog.transfer("get", "ring", recvs=[(p, n)])
                         for _, p in ring_peers(self.ring_ranks, self.r)))

    def barrier_ring(self) -> None:
        if len(self.ring_ranks) > 1:
            self.prog.add(Barrier(self.ring_ranks, quiet=False))

    def push_o(self, kk: int) -> None:
        for p, n in self.peers((self.t - kk) % self.T, self.oslot):
            self.prog.transfer("put", "other", sends=[(p, n)])

    def stage_out(self) -> None:
        self.prog.add(Barrier(self._everyone()))


def _nvshmem_missing_anywhere() -> list[int]:
    """Ranks where ``import nvshmem.core`` fails (decided together: one rank alone falling back
    would hang)."""
    from ..comm.nvshmem import nvshmem_import_error
    missing = [None] * dist.get_world_size()
    dist.all_gather_object(missing, nvshmem_import_error() is not None)
    return [r for r, m in enumerate(missing) if m]


def _strided(ranks: tuple[int, ...]) -> bool:
    """Whether ``ranks`` (sorted) are evenly strided, as ``team_split_strided`` needs."""
    try:
        team_split_args(ranks)
    except ValueError:
        return False
    return True


def build_swiftfusion(a: BuildArgs) -> TorusAttention:
    """The Torus schedule over the one-sided communicator; on GPUs where nvshmem4py is missing
    on some rank (and no backend was named), the two-sided ``torus`` instead, logged once."""
    if a.options.get("comm", "auto") == "auto" and torch.cuda.is_available():
        missing = _nvshmem_missing_anywhere()
        if missing:
            log_once(logger, "fallback-swiftfusion-nvshmem",
                     "swiftfusion: comm='auto' needs NVSHMEM on GPUs but `import nvshmem.core` "
                     f"fails on ranks {missing} (install xfuser-swiftfusion with the extra of your CUDA "
                     "major, [cu12] or [cu13], which brings nvshmem4py and cuda-core >= 0.5; "
                     "docs/install.md); running 'torus' (two-sided) instead")
            return get("torus").build(a)
    uneven = [grp for sp in a.groups.all_sp_groups for grp in
              (tuple(sp[x] for x in g) for g in a.groups.ring_groups) if not _strided(grp)]
    if uneven:
        log_once(logger, f"fallback-swiftfusion-strides-{uneven[0]}",
                 f"swiftfusion: NVSHMEM teams need evenly strided ranks, but ring group "
                 f"{uneven[0]} (global ranks) is not (islands whose ranks interleave unevenly); "
                 "running 'torus' (two-sided) instead")
        return get("torus").build(a)
    kv_pieces_option(a.options)  # checked before any communicator is made
    one = a.one_sided()
    one.prepare_groups(a.groups.ring_groups)
    io = OneSidedTorusIO(a.groups, one, a.rank, fp8.enabled(a.options))
    return TorusAttention(SPEC, a.mesh, io, a.rank, [one], a.options)


SPEC = register(StrategySpec(
    "swiftfusion", "tas", "as torus, over one-sided put/get with the fused multi-chunk kernel",
    build=build_swiftfusion,
    program=lambda mesh, rank, shape, launches="ring", kv_pieces=1: torus_ops(
        OneSidedTorusOps(mesh, rank, shape, kv_pieces), launches), ring="pull",
    one_sided=True, needs_torus=True,
    fallback="tas", order=3, native=NATIVE, launch_modes=("ring", "stage"),
    program_options=("kv_pieces",)))
