"""Torus attention (paper section 4.3, Algorithm 1; DESIGN.md section 2).

GPU ``x = (t, u, r)``: torus (machine) rank t of T, intra-machine Ulysses rank u of U,
ring rank r of R. Heads split into ``T*U`` groups of ``h``; group ``(a, b)`` is owned by
GPU ``(a, b, r)``. Working set per GPU, ``[T, U, B, h, S, D]`` (slot ``[a, b]`` = tokens of
GPU ``(a, b, r)``, head group ``(t, u)``); outputs in ``[T, U]`` slots (``layout.Slots``:
``[B, h, S, D]`` image rows, then ``[B, h, Tj, D]`` text rows). The output of query block
``a`` is written only after the block's last use, so a transport may keep query block ``a``
in the image rows of output slot ``a`` (both transports do: one buffer less).

The schedule is data: ``torus_schedule(T, t, text)`` lists the ``Step``s of machine ``t``,
each tagged with the Algorithm 1 line(s) and DESIGN.md step it implements (lines as the
paper prints them: every line is numbered except the omitted ``end`` lines, so RingAttn is
l.1-7, the issue loop l.18-21, the first Pull-Q stage l.22). Two refinements of Algorithm 1,
with the same work and bytes:
- the local queries attend to each remote K/V block in the Pull-KV stage that brings it
  (Algorithm 1 defers all of that to Push-O, l.34); only the last block's share stays there,
  to overlap the pushes. On a link-bound layer compute idles while a stage's data arrives,
  and the work left after the last arrival shrinks from 2(T-1) query blocks to T;
- the last Pull-KV stage runs one remote query block at a time, so each remote output is
  pushed as soon as it is final instead of all after the stage;
- (option ``kv_pieces`` P, default 1: none of this) the last Pull-KV stage's K/V block moves
  in P pieces along the sequence (``piece_bounds``), each its own transfer; pieces 0..P-2
  are attended by every query entry as each arrives, the last one block by block as above.
  The work left after the last byte of K/V shrinks from C/T^2 to C/(T^2 P) of the layer's
  compute C, for P - 1 more transfers per peer (and, with ``launches="stage"``, P - 1 more
  launches per layer: 10 + P - 1 at T = 4 with text). Both transports move pieces; not with
  ``fp8_comms`` (its wire slots are whole blocks: ``ValueError``).
Text (joint) tokens are one more query entry and one more K/V entry (``TEXT``): the text
queries ride with the local queries, the text K/V (replicated, so attended locally, without a
ring) is attended once by every query entry, in its Pull-Q stage.

Grouped-query attention: K/V move with ``H_kv / (T*U)`` heads per slot (``grouped_kv``).
Key mask: K/V slot ``b`` of machine ``a``'s block on ring rank r' holds the tokens of GPU
``(a, b, r')``; every ring step attends it with those columns of the mask.

FP8 communication (option ``fp8_comms``): what crosses machines (the Q, K, V of Pull-Q and
Pull-KV stages 1..T-1 and the outputs of Push-O to the other machines) travels as ``fp8.py``
wire slots, one slot per transfer with its scale appended (one per slot and tensor), and is
dequantized to the compute dtype when its stage is waited for; the intra-machine scatter,
the ring and the local Push-O stay in the compute dtype. Transfers and grouped operations
are the same as without it.

Launches (option ``launches``): ``"ring"`` (the default on CPU tensors) runs ring attention
step by step, one ``attend`` per ring step, overlapped with the next block's transfer;
``"stage"`` (the default on CUDA tensors) runs one ``attend`` per Torus stage and query entry
over every K/V chunk present (``fused_schedule``): the ring group's chunks of a machine's
block are gathered first (``TorusIO.ring_all``: gets from the ring peers' symmetric buffers,
or one grouped exchange), the text K/V joins the same launch, and the outputs are finalized by
the entry's last launch. Same schedule, same inter-machine transfers, fewer, larger launches:
10 per layer at T = 4 with text instead of 44 (Flux on 4 x 8).

``TorusAttention`` runs the steps over a transport with the operations of ``TorusIO``;
``TwoSidedTorusIO`` (this file, the ``torus`` strategy) implements them with matched
isend/irecv, ``OneSidedTorusIO`` (``swiftfusion.py``) with put/get on a symmetric heap.
``torus_ops`` walks the same ``torus_schedule`` for the cost model, each transport's calls
written as ops beside it (``TwoSidedTorusOps``, ``OneSidedTorusOps``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch

from .. import plan
from ..comm.base import Handle, TwoSided
from ..groups import SPGroups
from ..kernels import AttnState, attend, new_states
from ..log import get_logger, log_once
from ..mesh import Mesh
from . import fp8
from .layout import Joint, KeyMask, Slots, gather_output, grouped_kv, split_heads
from .ops import Attend, Copy, Op, Program, Shape
from .planned import PlanCache
from .registry import NATIVE, StrategySpec, register
from .ring import PassRing, ring_ops

logger = get_logger(__name__)

TEXT = "text"
"""The text entry: queries ``[B, h, Tj, D]`` and K/V ``[B, h, Tj, D]`` of my head group."""

Entry = int | str  # machine a (its U chunks [B, h, S, D] of my head group) or TEXT

Kind = Literal["issue", "init", "wait_q", "wait_kv", "barrier_ring", "attend", "finalize", "push"]


@dataclass(frozen=True)
class Step:
    """One operation of the Torus schedule of a GPU on machine ``t``.

    ``kind``:
    - ``issue``: every inter-machine pull in flight (Q of every stage first, then K/V);
    - ``init``: empty running states for the query entries ``q``;
    - ``wait_q`` / ``wait_kv``: the Q block ``q[0]`` / K/V block ``kv`` of machine
      ``(t - k) % T``, pulled in stage ``k``, has arrived here;
    - ``barrier_ring``: every ring peer holds K/V block ``kv`` too;
    - ``attend``: the query entries ``q`` attend K/V entry ``kv`` (a machine's block: ring
      attention over my ring group; ``TEXT``: locally), states merged in place;
    - ``finalize``: output of query entry ``q[0]`` = acc / l, written into ``O`` (machine
      ``a``: image rows of slots ``[a, :]``; ``TEXT``: text rows of every slot);
    - ``push``: ``O[q[0], :]`` leaves for its owners (transport stage ``k = (t - q[0]) % T``).
    ``what`` names the stage (the transport's ``what=``), ``line`` the Algorithm 1 line(s)
    and DESIGN.md step. ``piece``: for ``wait_kv``, ``barrier_ring`` and ``attend`` of the
    last Pull-KV stage's block with ``kv_pieces`` P > 1, piece ``piece`` of P of its S rows
    (``piece_bounds``); None: the whole block.
    """

    kind: Kind
    what: str
    q: tuple[Entry, ...] = ()
    kv: Entry | None = None
    k: int = 0
    line: str = ""
    piece: int | None = None


def piece_bounds(S: int, P: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of each of the ``P`` pieces of ``S`` rows (``P <= S``): the first
    ``S % P`` pieces one row longer, as ``torch.tensor_split``."""
    n, extra = divmod(S, P)
    bounds, lo = [], 0
    for p in range(P):
        hi = lo + n + (p < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def kv_key(k: int, piece: int | None) -> int | tuple[int, int]:
    """Key of a K/V arrival in ``issue_pulls``' second dict: stage ``k`` (the whole block), or
    ``(k, piece)`` (piece ``piece`` of the last stage's block)."""
    return k if piece is None else (k, piece)


def torus_schedule(T: int, t: int, text: bool, pieces: int = 1) -> list[Step]:
    """Steps 3-7 of the GPUs on machine ``t`` of ``T`` (the same for every u and r).

    ``pieces`` (``kv_pieces`` P): the last Pull-KV stage's block arrives in P pieces along
    the sequence; pieces 0..P-2 are attended by every query entry as each arrives, the last
    piece block by block as the whole block is without pieces (P = 1: exactly that).

    Invariants (tests/test_torus_schedule.py): every (query entry, K/V entry) pair is
    attended exactly once (once per piece); each wait precedes every use of its block (its
    piece), the ring barrier of a remote K/V block (piece) every ring attention over it; each
    output is finalized once, after its last attend, and pushed after its finalization (the
    text output before the first push).
    """
    if pieces < 1:
        raise ValueError(f"kv_pieces must be >= 1, got {pieces}")
    X = (TEXT,) if text else ()  # the text query entry, where there is one
    others = tuple(a for a in range(T) if a != t)
    last = (t + 1) % T  # K/V block of the last Pull-KV stage, k = T - 1
    P = pieces if T > 1 else 1
    tail = None if P == 1 else P - 1  # the piece the block-by-block tail attends
    # every pull in flight before anything else is launched, the running states included
    s = [Step("issue", "issue pulls", line="Alg.1 l.18-21; step 3"),
         Step("init", "running states", (*range(T), *X), line="Alg.1 l.12-14")]
    # Pull-Q stages 1..T: the queries of machine t - k against my K/V, mine (with the text
    # queries) first, the others as they arrive; each entry also meets the text K/V here.
    for k in range(T):
        a, what = (t - k) % T, f"Pull-Q stage {k + 1}"
        q = (a, *X) if k == 0 else (a,)
        if k:
            s.append(Step("wait_q", what, q, k=k, line="Alg.1 l.25; step 5"))
        if text:
            s.append(Step("attend", what, q, TEXT, line="step 4-5: text K/V, once per query entry"))
        s.append(Step("attend", what, q, t, line="Alg.1 l.26; step 5" if k else "Alg.1 l.22; step 4"))
    # Pull-KV stages 1..T-1: every query against K/V of machine t - k as it arrives, my own
    # queries included (their share of l.34, refinement 1); stage T-1 in P pieces, each but
    # the last attended by every query as it arrives (refinement 3), the last block by block.
    for k in range(1, T):
        a, what = (t - k) % T, f"Pull-KV stage {k}"
        for p in (range(P) if k == T - 1 and P > 1 else (None,)):
            w = what if p is None else f"{what}, piece {p + 1}/{P}"
            s += [Step("wait_kv", w, kv=a, k=k, line="Alg.1 l.29; step 6", piece=p),
                  Step("barrier_ring", w, kv=a, line="Alg.1 l.29; step 6", piece=p)]
            if k < T - 1 or (p is not None and p < P - 1):
                s.append(Step("attend", w, (t, *others, *X), a, line="Alg.1 l.30 + l.34; step 6",
                              piece=p))
    # Stage T-1 (its last piece) one query block at a time, each output pushed once final
    # (refinement 2); the last, k = T, is my machine's block, attended while the others
    # travel (Push-O).
    for k in range(1, T + 1):
        a, mine = (t - k) % T, k == T
        q = (a, *X) if k == 1 else (a,)  # the text queries finish with the first block
        what = "Push-O" if mine else f"Pull-KV stage {T - 1}, queries of machine {a}"
        if T > 1:  # one machine: its queries met its only K/V block in Pull-Q stage 1
            s.append(Step("attend", what, q, last,
                          line="Alg.1 l.34; step 7" if mine else "Alg.1 l.30; step 6", piece=tail))
        # text first: its rows ride in every slot, so they are final before the first push
        s += [Step("finalize", what, (e,), line="step 6-7: O = acc / l") for e in (*q[1:], a)]
        s.append(Step("push", "Push-O", (a,), k=k % T,
                      line="Alg.1 l.35; step 7" if mine else "Alg.1 l.33; step 7"))
    return s


@dataclass(frozen=True)
class Launch:
    """One ``attend`` of the fused schedule: query entries ``q`` against every K/V chunk of the
    entries ``kv`` (a machine's block: the chunks of every rank of my ring group; ``TEXT``),
    finalizing every entry of ``q`` when ``finalize`` (``kv`` may then be empty);
    ``finalized``: the schedule's finalize steps it took over; ``pieces``: empty (every
    entry whole) or, per entry of ``kv``, its piece (``Step.piece``)."""

    what: str
    q: tuple[Entry, ...]
    kv: tuple[Entry, ...]
    finalize: bool = False
    finalized: tuple[Entry, ...] = ()
    kind: str = "launch"
    pieces: tuple[int | None, ...] = ()

    def kv_pieces(self) -> list[tuple[Entry, int | None]]:
        """``(entry, piece)`` of each K/V entry (piece None: the whole entry)."""
        return list(zip(self.kv, self.pieces or (None,) * len(self.kv)))


def fused_schedule(T: int, t: int, text: bool, pieces: int = 1) -> list[Step | Launch]:
    """``torus_schedule(T, t, text, pieces)`` with its attends and finalizations merged into
    launches: consecutive attends of the same query entries become one launch over all their
    K/V (pieces are K/V entries of their own), and the finalizations right after an entry's
    last attend join that launch (they must cover all of its query entries). Waits,
    barriers, pushes and the issue stay steps, in order."""
    out: list[Step | Launch] = []
    for s in torus_schedule(T, t, text, *_pieces_arg(pieces)):
        last = out[-1] if out else None
        if s.kind == "attend":
            if isinstance(last, Launch) and last.q == s.q and not last.finalize:
                kvp = [*last.kv_pieces(), (s.kv, s.piece)]
                out[-1] = replace(last, kv=tuple(e for e, _ in kvp),
                                  pieces=tuple(p for _, p in kvp) if any(p is not None for _, p in kvp) else ())
            else:
                out.append(Launch(s.what, s.q, (s.kv,), pieces=() if s.piece is None else (s.piece,)))
        elif s.kind == "finalize":
            if isinstance(last, Launch) and s.q[0] in last.q:
                out[-1] = replace(last, finalize=True, finalized=(*last.finalized, *s.q))
            else:
                out.append(Launch(s.what, s.q, (), finalize=True, finalized=s.q))
        else:
            out.append(s)
    for x in out:
        if isinstance(x, Launch) and x.finalize and set(x.finalized) != set(x.q):
            raise AssertionError(f"{x.what}: the finalizations {x.finalized} do not cover the "
                                 f"launch's query entries {x.q}")
    return out


def schedule_of(launches: str, T: int, t: int, text: bool, pieces: int = 1) -> list[Step | Launch]:
    """The steps machine ``t`` runs with ``launches``: ``fused_schedule`` (``"stage"``) or
    ``torus_schedule`` (``"ring"``), the last Pull-KV stage in ``pieces`` pieces."""
    return (fused_schedule if launches == "stage" else torus_schedule)(T, t, text, *_pieces_arg(pieces))


def _pieces_arg(pieces: int) -> tuple[int, ...]:
    """``pieces`` as the schedule's optional argument: none for 1 (the schedule's default; a
    replaced ``torus_schedule(T, t, text)`` in a test still runs)."""
    return () if pieces == 1 else (pieces,)


def ring_peers(ranks: tuple[int, ...], r: int) -> list[tuple[int, int]]:
    """``(ring rank, global rank)`` of every other rank of the ring group ``ranks`` (I am ring
    rank ``r``), from the next one on: ring rank ``r + i`` at position ``i - 1``."""
    R = len(ranks)
    return [((r + i) % R, ranks[(r + i) % R]) for i in range(1, R)]


class TorusIO(Protocol):
    """What the schedule needs from communication (all indices are torus ranks)."""

    def stage_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int) -> None:
        """Steps 1-2 (``q`` [B, H, S, D], ``k, v`` [B, H_kv, S, D], T*U dividing H_kv):
        intra-machine Ulysses; afterwards ``q_block(t)``/``kv_block(t)`` hold my
        machine's tokens of my head group; ``O``, ``Ob`` are ``[T, U]`` slots of S image rows
        and ``text_len`` text rows. A transport with K/V pieces takes ``pieces=P`` (P > 1):
        the last Pull-KV stage's block then moves in P pieces (``piece_bounds``)."""

    def issue_pulls(self) -> tuple[dict[int, list[Handle]], dict]:
        """Step 3: every inter-machine Q, then K/V transfer; handles per stage k = 1..T-1
        (K/V with pieces: per ``kv_key(T - 1, p)`` for the last stage)."""

    def q_block(self, a: int) -> torch.Tensor:
        """``[U, B, h, S, D]``: queries of machine ``a``'s tokens, my head group (may be
        ``O.rows[a]``: valid until the schedule writes output ``a``)."""
    def kv_block(self, a: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def ring(self, q_chunks: list[torch.Tensor], states: list[AttnState], a: int, *,
             scale: float, what: str, masks=None) -> None:
        """Ring attention of ``q_chunks`` against K/V block ``a`` over my ring group
        (``masks``: ring rank -> key masks of its block's U slots, as ``ring._Ring``); with
        pieces, ``piece=p``: against piece p of the block (``masks``: of its columns)."""
    def ring_all(self, a: int, *, what: str) -> list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """K/V block ``a`` of every rank of my ring group: ``(ring rank, its U (K, V) chunks
        [B, h_kv, S, D])`` in ring-rank order, gathered here at the first call of a layer
        (and only then: the gather is part of that layer's calls); with pieces, ``piece=p``:
        piece p of the block (chunks ``[B, h_kv, S_p, D]``)."""
    def barrier_ring(self, *, what: str) -> None: ...
    def push_o(self, k: int) -> None:
        """Send ``O[(t-k)%T, :]`` to its owners (k = 0: my machine); receive my outputs."""
    def stage_out(self) -> Slots:
        """Complete every push; return ``Ob`` (slot ``[a, b]`` = my tokens, head group (a, b))."""

    O: Slots  # [T, U] outputs computed here, slot [a, b] owned by GPU (a, b, r)


LAUNCHES_OPTION = "launches"
LAUNCHES = ("stage", "ring")


def launches_option(options: dict) -> str | None:
    """Option ``launches`` (``"stage"`` or ``"ring"``, module docstring); None: by device."""
    value = options.get(LAUNCHES_OPTION)
    if value is not None and value not in LAUNCHES:
        raise ValueError(f"option {LAUNCHES_OPTION!r} must be one of {LAUNCHES}, got {value!r}")
    return value


KV_PIECES_OPTION = "kv_pieces"
NO_FP8_PIECES = "kv_pieces > 1 with fp8_comms is not supported; use one or the other"


def kv_pieces_option(options: dict) -> int:
    """Option ``kv_pieces`` (an int >= 1, default 1; module docstring): the pieces of the last
    Pull-KV stage's K/V block. ``ValueError`` for anything else, and for more than one piece
    with ``fp8_comms`` (the FP8 wire slots are whole blocks)."""
    value = options.get(KV_PIECES_OPTION, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"option {KV_PIECES_OPTION!r} must be an int >= 1, got {value!r}")
    if value > 1 and fp8.enabled(options):
        raise ValueError(NO_FP8_PIECES)
    return value


def staged_pieces(T: int, pieces: int, fp8_wire: bool) -> int:
    """The pieces a transport stages the last Pull-KV block in: ``pieces`` where T > 1, else 1.
    ``ValueError`` for more than one with FP8 wire slots (they hold whole blocks)."""
    P = pieces if T > 1 else 1
    if P > 1 and fp8_wire:
        raise ValueError(NO_FP8_PIECES)
    return P


def check_whole_block(a: int, t: int, T: int, pieces: int) -> None:
    """Machine ``t``'s transport holds block ``a`` whole: at P > 1 the last Pull-KV stage's
    block (machine t + 1's) is held only by piece."""
    if pieces > 1 and a == (t + 1) % T:
        raise AssertionError(f"block {a} arrives in {pieces} pieces: ask for a piece")


class TorusAttention:
    """Callable ``(q, k, v, joint) -> out`` under the USP contract, running the Torus schedule
    as execution plans (``planned.py``: one per input signature)."""

    def __init__(self, spec: StrategySpec, mesh: Mesh, io: TorusIO, rank: int, comms: list,
                 options: dict | None = None) -> None:
        self.spec, self.mesh, self.io, self.comms = spec, mesh, io, comms
        self.t, self.u, self.r = mesh.coords(rank)
        options = options or {}
        self.launches = launches_option(options)  # None: by device
        self.kv_pieces = kv_pieces_option(options)
        self.plans = PlanCache.for_strategy(self, options)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        """``q`` ``[B, H, S, D]``, ``k, v`` ``[B, H_kv, S, D]`` -> ``[B, H, S (+ Tj), D]``."""
        return self.plans(q, k, v, joint, scale, key_mask)

    def layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              joint: Joint | None, scale: float, key_mask: KeyMask | None = None) -> torch.Tensor:
        """One layer's calls, steps 1-8 (what a plan records)."""
        T, U = self.mesh.torus, self.mesh.ulysses_intra
        if k.shape[1] != q.shape[1]:  # K/V heads that split into the T*U head groups
            k, v, joint = grouped_kv(k, v, joint, q.shape[1], T * U, self.spec.name)
        launches = self.launches or ("stage" if q.is_cuda else "ring")
        P = self.pieces(q.shape[2]) if T > 1 else 1
        pieces = {"pieces": P} if P > 1 else {}
        self.io.stage_in(q, k, v, joint.length if joint is not None else 0, **pieces)  # steps 1-2
        self._stages(joint, scale, key_mask, launches, P, q.shape[2])
        Ob = self.io.stage_out()
        return plan.output(lambda: gather_output(Ob, joint))  # [T, U] slots -> [B, H, S + Tj, D]

    def pieces(self, S: int) -> int:
        """The pieces of the last Pull-KV stage's block of ``S`` rows: ``kv_pieces``, at most
        ``S`` (one row each; logged once)."""
        if self.kv_pieces > S:
            log_once(logger, f"kv-pieces-{self.spec.name}-{self.kv_pieces}-{S}",
                     f"{self.spec.name}: kv_pieces={self.kv_pieces} exceeds the {S} tokens per GPU; "
                     f"the last Pull-KV stage moves in {S} pieces of one row")
            return S
        return self.kv_pieces

    def _stages(self, joint: Joint | None, scale: float, key_mask: KeyMask | None,
                launches: str, P: int = 1, S: int = 0) -> None:
        """Steps 3-7: run ``torus_schedule`` (``launches="ring"``) or ``fused_schedule``
        (``"stage"``) against the transport, the last Pull-KV stage in ``P`` pieces of the
        ``S`` rows (``piece_bounds``).

        Query entry ``a`` is the U chunks ``[B, h, S, D]`` of ``io.q_block(a)``, ``TEXT`` the
        text queries ``[B, h, Tj, D]`` of my head group; one running state per chunk.
        """
        io, T, U = self.io, self.mesh.torus, self.mesh.ulysses_intra
        jq = jkv = None
        if joint is not None:
            jq, jk, jv = joint.head_group(self.t * U + self.u, T * U)  # [B, h(_kv), Tj, D]
            jkv = [(jk, jv)]
        text_mask = None if key_mask is None else key_mask.text
        masks = {}  # machine a -> (ring rank -> key masks of its U slots)
        if key_mask is not None and key_mask.tokens is not None:
            rank_of = self.mesh.rank_of
            masks = {a: (lambda r, a=a: [key_mask.chunk(rank_of(a, b, r)) for b in range(U)])
                     for a in range(T)}
            bounds = piece_bounds(S, P) if P > 1 else []
            # (a, p) -> ring rank -> the key masks of piece p of its U slots: their columns
            masks |= {(a, p): (lambda r, a=a, lo=lo, hi=hi: [None if m is None else m[:, lo:hi]
                                                              for m in masks[a](r)])
                      for a in range(T) for p, (lo, hi) in enumerate(bounds)}
        chunks: dict[Entry, list[torch.Tensor]] = {}
        states: dict[Entry, list[AttnState]] = {}
        for s in schedule_of(launches, T, self.t, joint is not None, P):
            match s.kind:
                case "issue":
                    EQ, EKV = io.issue_pulls()
                case "init":
                    for e in s.q:
                        chunks[e] = [jq] if e == TEXT else list(io.q_block(e).unbind(0))
                    fresh = iter(new_states([c for e in s.q for c in chunks[e]]))
                    for e in s.q:
                        states[e] = [next(fresh) for _ in chunks[e]]
                case "wait_q":
                    _wait(EQ[s.k])
                case "wait_kv":
                    _wait(EKV[kv_key(s.k, s.piece)])
                case "barrier_ring":
                    io.barrier_ring(what=s.what)
                case "attend":
                    qs = [c for e in s.q for c in chunks[e]]
                    sts = [x for e in s.q for x in states[e]]
                    if s.kv == TEXT:
                        attend(qs, jkv, sts, scale=scale,
                               **({} if text_mask is None else {"key_masks": [text_mask]}))
                    else:
                        mk = s.kv if s.piece is None else (s.kv, s.piece)
                        ring_kw = {"masks": masks[mk]} if mk in masks else {}
                        if s.piece is not None:
                            ring_kw["piece"] = s.piece
                        io.ring(qs, sts, s.kv, scale=scale, what=s.what, **ring_kw)
                case "finalize":
                    (e,) = s.q
                    if e == TEXT:  # [B, h, Tj, D]: the text rows of my head group, in every slot
                        (txt,) = attend(chunks[e], [], states[e], scale=scale, finalize=True)
                        self._text_rows(txt)
                    else:  # O.rows[e] may hold Q[e] until now
                        attend(chunks[e], [], states[e], scale=scale, finalize=True,
                               out=list(io.O.rows[e].unbind(0)))
                case "launch":
                    self._launch(s, chunks, states, jkv, text_mask, masks, scale)
                case "push":
                    io.push_o(s.k)

    def _launch(self, s: Launch, chunks: dict, states: dict, jkv, text_mask, masks: dict,
                scale: float) -> None:
        """One attend of the fused schedule: the query entries' chunks against every chunk of
        its K/V entries (a machine's block gathered over my ring group), finalized into ``O``
        when the launch finalizes (``O.rows[e]`` may hold ``Q[e]`` until then: each query tile
        is read before its output is written)."""
        io = self.io
        kv, kmasks = [], []
        for e, p in s.kv_pieces():
            if e == TEXT:
                kv += jkv
                kmasks.append(text_mask)
            else:
                mk = e if p is None else (e, p)
                for r2, block in io.ring_all(e, what=s.what, **({} if p is None else {"piece": p})):
                    kv += block
                    kmasks += masks[mk](r2) if mk in masks else [None] * len(block)
        out = None
        if s.finalize:  # machine a's outputs into O.rows[a]; the text's into a new tensor
            out = []
            for e in s.q:
                out += [torch.empty_like(chunks[TEXT][0])] if e == TEXT else io.O.rows[e].unbind(0)
        attend([c for e in s.q for c in chunks[e]], kv, [x for e in s.q for x in states[e]],
               scale=scale, finalize=s.finalize, out=out,
               key_masks=kmasks if any(m is not None for m in kmasks) else None)
        if s.finalize and TEXT in s.q:
            at = sum(len(chunks[e]) for e in s.q[:s.q.index(TEXT)])
            self._text_rows(out[at])

    def _text_rows(self, txt: torch.Tensor) -> None:
        """The text output ``[B, h, Tj, D]`` of my head group into the text rows of every slot."""
        text = self.io.O.text
        plan.call(lambda: text.copy_(txt))  # broadcast into [T, U, B, h, Tj, D]

    def close(self, failed: bool) -> None:
        """Nothing besides the communicators."""


def _wait(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


class TwoSidedTorusIO:
    """Torus transport over matched isend/irecv (the ``torus`` strategy).

    The one-sided "pull of slot [t, u] from GPU (t', b, r)" becomes: GPU (t', b, r) sends
    it while I receive it; every rank posts both halves of stage k at once, one exchange (one
    grouped operation) per tensor on the ``"other"`` queue, so with T = 2 the send to and the
    receive from the other machine progress together. Ring attention uses the ``"ring"`` queue.
    ``fp8_comms``: stages k >= 1 move ``fp8.py`` wire slots (``W``: per tensor ``[T, U, bytes]``
    send (``"s"``) and receive (``"r"``) buffers, slot ``[a, b]`` as the tensor's).
    K/V pieces (``stage_in(..., pieces=P)``, P > 1, T > 1, not with ``fp8_comms``): the last
    stage's K and V move as P exchanges, piece p's K and V in one (K's U messages, then V's,
    to each peer in that order). Pieces along S of ``[B, h_kv, S, D]`` are not contiguous, so
    they travel in piece-major buffers, lists of P tensors ``[U, B, h_kv, S_p, D]``: ``PK``,
    ``PV`` received (attended where they land; ``K``/``V[t+1]`` stay unused), ``src["PK"]``,
    ``src["PV"]`` sent (copied from my slots ``[t-1]`` in ``stage_in``).
    """

    def __init__(self, groups: SPGroups, comm: TwoSided, rank: int, fp8_comms: bool = False) -> None:
        self.mesh = mesh = groups.mesh
        self.comm, self.fp8 = comm, fp8_comms and mesh.torus > 1
        self.t, self.u, self.r = mesh.coords(rank)
        self.ring_ranks = groups.ring_ranks
        self._ring = PassRing(comm, self.ring_ranks, self.r)
        self._buffers: dict[tuple, dict[str, torch.Tensor | Slots]] = {}
        self._pending: list[Handle] = []

    def _peer(self, a: int, b: int) -> int:
        return self.mesh.rank_of(a, b, self.r)

    def stage_in(self, q, k, v, text_len, pieces: int = 1):
        T, U = self.mesh.torus, self.mesh.ulysses_intra
        B, H, S, D = q.shape
        h, h_kv = H // (T * U), k.shape[1] // (T * U)
        self.pieces = staged_pieces(T, pieces, self.fp8)
        self.bounds = piece_bounds(S, self.pieces)
        key = (tuple(q.shape), k.shape[1], q.dtype, q.device, text_len, self.pieces)
        if key not in self._buffers:
            O, Ob = (Slots.alloc(q.new_empty, (T, U), B, h, S, text_len, D) for _ in range(2))
            self._buffers = {key: {"Q": O.rows,  # the received Q block of machine a lives in O.rows[a]
                                   "K": q.new_empty(T, U, B, h_kv, S, D),
                                   "V": q.new_empty(T, U, B, h_kv, S, D),
                                   "O": O, "Ob": Ob,
                                   # my tokens, every head group: the send buffers of step 1
                                   "src": {"Q": q.new_empty(T, U, B, h, S, D),
                                           "K": q.new_empty(T, U, B, h_kv, S, D),
                                           "V": q.new_empty(T, U, B, h_kv, S, D)}}}
            if self.fp8:  # wire slots of Q, K, V, O (O: a whole slot, image and text rows)
                empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
                m = {"Q": B * h * S * D, "K": B * h_kv * S * D, "V": B * h_kv * S * D,
                     "O": Slots.numel(B, h, S, text_len, D)}
                self._buffers[key]["W"] = {(n, d): fp8.wire_empty(empty, (T, U), m[n])
                                           for n in m for d in "sr"}
            if self.pieces > 1:  # piece-major K/V of the last stage, sent and received
                bk = self._buffers[key]
                for n in ("PK", "PV"):
                    for d in (bk, bk["src"]):
                        d[n] = [q.new_empty(U, B, h_kv, hi - lo, D) for lo, hi in self.bounds]
        self.buf = self._buffers[key]
        self.O, self.Ob = self.buf["O"], self.buf["Ob"]
        self._gathered: dict[int, list] = {}
        # step 1, [B, H(_kv), S, D] -> [T, U, B, h(_kv), S, D]: my tokens, every head group (send buffers)
        self.src = self.buf["src"]
        for n, x in (("Q", q), ("K", k), ("V", v)):
            dst, src = self.src[n], split_heads(x, T, U)
            plan.call(lambda dst=dst, src=src: dst.copy_(src))
        if self.pieces > 1:  # my slots [t-1] (for machine t-1, the last stage) in pieces
            tn = (self.t - 1) % T
            for n in ("K", "V"):
                for dst, (lo, hi) in zip(self.src["P" + n], self.bounds):
                    src = self.src[n][tn, :, :, :, lo:hi]
                    plan.call(lambda dst=dst, src=src: dst.copy_(src))
        if self.fp8:  # the slots for the other machines, as wire slots
            for n, x in self.src.items():
                for a in range(T):
                    if a != self.t:
                        wire, xa = self.buf["W"][n, "s"][a], x[a]
                        plan.call(lambda wire=wire, xa=xa: fp8.quantize_(wire, xa))  # [U, B, h, S, D] -> [U, bytes]
        _wait(self._exchange(0, ("Q", "K", "V"), "Ulysses scatter (intra-machine)"))

    def _exchange(self, kk: int, names: tuple[str, ...], what: str) -> list[Handle]:
        """Stage kk: send my slots [t+kk, b] to GPU (t+kk, b, r); receive its slot [t, u]
        into my slot [t-kk, b] (kk = 0: within my machine)."""
        T, U, t = self.mesh.torus, self.mesh.ulysses_intra, self.t
        tn, tp = (t + kk) % T, (t - kk) % T
        if self.fp8 and kk:  # across machines: wire slots, dequantized into my slots [t-kk] on wait
            W, buf = self.buf["W"], self.buf
            return [fp8.Arrival([self.comm.exchange(
                [(W[n, "s"][tn, b], self._peer(tn, b)) for b in range(U)],
                [(W[n, "r"][tp, b], self._peer(tp, b)) for b in range(U)],
                what=f"{what} {n} (fp8)", queue="other")],
                lambda n=n: fp8.dequantize_(W[n, "r"][tp], buf[n][tp])) for n in names]
        return [self.comm.exchange([(self.src[n][tn, b], self._peer(tn, b)) for b in range(U)],
                                   [(self.buf[n][tp, b], self._peer(tp, b)) for b in range(U)],
                                   what=f"{what} {n}", queue="other") for n in names]

    def _exchange_piece(self, p: int, what: str) -> Handle:
        """Piece ``p`` of the last stage (kk = T - 1): my ``src["PK"/"PV"][p]`` to GPUs
        (t-1, b, r), theirs into ``PK``/``PV[p]``; K's messages, then V's."""
        T, U, t = self.mesh.torus, self.mesh.ulysses_intra, self.t
        tn, tp = (t - 1) % T, (t + 1) % T
        return self.comm.exchange(
            [(self.src[n][p][b], self._peer(tn, b)) for n in ("PK", "PV") for b in range(U)],
            [(self.buf[n][p][b], self._peer(tp, b)) for n in ("PK", "PV") for b in range(U)],
            what=f"{what} K, V", queue="other")

    def issue_pulls(self):
        T, P = self.mesh.torus, self.pieces
        EQ = {kk: self._exchange(kk, ("Q",), f"Pull-Q stage {kk + 1}") for kk in range(1, T)}
        EKV: dict = {}
        for kk in range(1, T):
            if kk == T - 1 and P > 1:
                for p in range(P):
                    EKV[kv_key(kk, p)] = [self._exchange_piece(p, f"Pull-KV stage {kk}, piece {p + 1}/{P}")]
            else:
                EKV[kk] = self._exchange(kk, ("K", "V"), f"Pull-KV stage {kk}")
        return EQ, EKV

    def q_block(self, a):
        return self.buf["Q"][a]

    def kv_block(self, a, piece: int | None = None):
        """``(K, V)`` ``[U, B, h_kv, S, D]`` of block ``a``; ``piece``: piece ``piece`` of the
        last stage's block, ``[U, B, h_kv, S_p, D]``."""
        if piece is not None:
            return self.buf["PK"][piece], self.buf["PV"][piece]
        check_whole_block(a, self.t, self.mesh.torus, self.pieces)
        return self.buf["K"][a], self.buf["V"][a]

    def ring(self, q_chunks, states, a, *, scale, what, masks=None, piece=None):
        self._ring(q_chunks, states, *self.kv_block(a, piece), scale=scale, what=what, masks=masks)

    def ring_all(self, a, *, what, piece=None):
        """One grouped exchange on the ``"ring"`` queue: my block ``a`` to every ring peer,
        theirs into ``G`` (``[T, R-1, U, B, h_kv, S, D]`` per tensor, slot ``i - 1`` = ring
        rank ``r + i``); a piece: into ``GP[piece]`` (``[R-1, U, B, h_kv, S_p, D]``)."""
        key = a if piece is None else ("piece", piece)
        k, v = self.kv_block(a, piece)
        if key not in self._gathered:
            R, r = len(self.ring_ranks), self.r
            blocks = {r: (k, v)}  # [U, B, h_kv, S(_p), D]
            if R > 1:
                if piece is None:
                    if "G" not in self.buf:
                        self.buf["G"] = {n: torch.empty((self.mesh.torus, R - 1, *k.shape), dtype=k.dtype,
                                                        device=k.device) for n in "KV"}
                    G, of = {n: self.buf["G"][n][a] for n in "KV"}, f"block {a}"
                else:
                    G = self.buf.setdefault("GP", {})
                    if piece not in G:
                        G[piece] = {n: torch.empty((R - 1, *k.shape), dtype=k.dtype, device=k.device)
                                    for n in "KV"}
                    G, of = G[piece], f"piece {piece + 1}"
                sends, recvs = [], []
                for i, (r2, peer) in enumerate(ring_peers(self.ring_ranks, r)):
                    gk, gv = G["K"][i], G["V"][i]
                    sends += [(k, peer), (v, peer)]
                    recvs += [(gk, peer), (gv, peer)]
                    blocks[r2] = (gk, gv)
                self.comm.exchange(sends, recvs, what=f"{what}, ring all-gather of {of}",
                                   queue="ring").wait()
            self._gathered[key] = [(r2, list(zip(blocks[r2][0].unbind(0), blocks[r2][1].unbind(0))))
                                   for r2 in range(R)]
        return self._gathered[key]

    def barrier_ring(self, *, what):
        """Two-sided rings synchronise through their own sends and receives."""

    def push_o(self, kk):
        # mirrors the pulls: I receive my tokens' outputs for head group (t+kk, b) from its owner
        T, U, t = self.mesh.torus, self.mesh.ulysses_intra, self.t
        tp, tn = (t - kk) % T, (t + kk) % T
        if self.fp8 and kk:  # across machines: wire slots, dequantized into Ob[t+kk] in stage_out
            W, flat, flat_b = self.buf["W"], self.O.flat[tp], self.Ob.flat[tn]
            plan.call(lambda: fp8.quantize_(W["O", "s"][tp], flat))  # [U, slot] -> [U, bytes]
            sends = [(W["O", "s"][tp, b], self._peer(tp, b)) for b in range(U)]
            recvs = [(W["O", "r"][tn, b], self._peer(tn, b)) for b in range(U)]
            self._pending.append(fp8.Arrival(
                [self.comm.exchange(sends, recvs, what=f"Push-O to machine {tp} (fp8)", queue="other")],
                lambda: fp8.dequantize_(W["O", "r"][tn], flat_b)))
            return
        sends = [(self.O.flat[tp, b], self._peer(tp, b)) for b in range(U)]
        recvs = [(self.Ob.flat[tn, b], self._peer(tn, b)) for b in range(U)]
        self._pending.append(self.comm.exchange(sends, recvs, what=f"Push-O to machine {tp}",
                                                queue="other"))

    def stage_out(self):
        pending, self._pending = self._pending, []
        _wait(pending)
        return self.Ob


class TorusOps:
    """The calls of a Torus transport as ops (``ops.py``), on GPU ``rank`` = (t, u, r) for a
    layer of ``shape``: what ``torus_ops`` needs of a transport, mirroring ``TorusIO``."""

    def __init__(self, mesh: Mesh, rank: int, shape: Shape, kv_pieces: int = 1) -> None:
        self.mesh, self.shape, self.rank = mesh, shape, rank
        self.prog = Program(rank)
        self.t, self.u, self.r = mesh.coords(rank)
        self.T, self.U = mesh.torus, mesh.ulysses_intra
        self.h = shape.heads // (self.T * self.U)
        self.slot = shape.nbytes(self.h, shape.tokens)                 # [B, h, S, D]
        self.oslot = shape.nbytes(self.h, shape.tokens + shape.text)   # an output slot
        self.ring_ranks = mesh.ring_groups[self.t * self.U + self.u]
        # the last Pull-KV stage's pieces (TorusAttention.pieces: at most S), their rows
        self.pieces = min(kv_pieces, shape.tokens) if self.T > 1 else 1
        self.piece_rows = [hi - lo for lo, hi in piece_bounds(shape.tokens, self.pieces)]

    def rows_of(self, piece: int | None) -> int:
        """Rows of a K/V slot (``piece``: of that piece of it)."""
        return self.shape.tokens if piece is None else self.piece_rows[piece]

    def peer(self, a: int, b: int) -> int:
        return self.mesh.rank_of(a, b, self.r)

    def peers(self, a: int, nbytes: int) -> list[tuple[int, int]]:
        """``nbytes`` with each GPU (a, b, r) of machine ``a``."""
        return [(self.peer(a, b), nbytes) for b in range(self.U)]


class TwoSidedTorusOps(TorusOps):
    """``TwoSidedTorusIO``'s calls: one exchange per tensor and stage (the last stage's K/V
    with pieces: one exchange of K and V per piece), ``PassRing``."""

    def stage_in(self) -> None:
        T, U = self.T, self.U
        self.prog.add(Copy(3 * T * U * self.slot))  # split_heads(...).contiguous() of Q, K, V
        if self.pieces > 1:
            self.prog.add(Copy(2 * U * self.slot))  # my K, V slots [t-1] into the piece buffers
        self.prog.wait(*(self._exchange(0, self.slot) for _ in "QKV"))
        self.pending: list[str | None] = []

    def _exchange(self, kk: int, nbytes: int) -> str | None:
        tn, tp = (self.t + kk) % self.T, (self.t - kk) % self.T
        return self.prog.transfer("exchange", "other", self.peers(tn, nbytes), self.peers(tp, nbytes))

    def issue_pulls(self) -> tuple[dict, dict]:
        T, P = self.T, self.pieces
        EQ = {kk: [self._exchange(kk, self.slot)] for kk in range(1, T)}
        EKV: dict = {}
        for kk in range(1, T):
            if kk == T - 1 and P > 1:  # K's and V's piece p in one exchange
                tn, tp = (self.t + kk) % T, (self.t - kk) % T
                for p in range(P):
                    n = self.shape.nbytes(self.h, self.piece_rows[p])
                    EKV[kv_key(kk, p)] = [self.prog.transfer("exchange", "other", self.peers(tn, n) * 2,
                                                             self.peers(tp, n) * 2)]
            else:
                EKV[kk] = [self._exchange(kk, self.slot), self._exchange(kk, self.slot)]
        return EQ, EKV

    def ring(self, q_rows: tuple[int, ...], piece: int | None = None) -> None:
        U, S = self.U, self.rows_of(piece)
        n = self.shape.nbytes(self.h, S)
        ring_ops(self.prog, PassRing, self.ring_ranks, self.r, q_rows, (S,) * U,
                 self.shape.batch * self.h, (U * n, U * n))

    def ring_all(self, piece: int | None = None) -> None:
        """``TwoSidedTorusIO.ring_all``'s exchange: K and V of my block (piece) to every ring
        peer."""
        peers = [p for _, p in ring_peers(self.ring_ranks, self.r)]
        n = self.U * self.shape.nbytes(self.h, self.rows_of(piece))
        self.prog.wait(self.prog.transfer("exchange", "ring", [(p, n) for p in peers for _ in "KV"],
                                          [(p, n) for p in peers for _ in "KV"]))

    def barrier_ring(self) -> None:
        """Two-sided rings synchronise through their own sends and receives."""

    def push_o(self, kk: int) -> None:
        self.pending.append(self._exchange(-kk, self.oslot))

    def stage_out(self) -> None:
        self.prog.wait(*self.pending)


def torus_ops(io: TorusOps, launches: str = "ring") -> list[Op]:
    """The ops of one Torus layer on ``io``'s rank: steps 1-2, ``torus_schedule``'s steps
    3-7 over ``io`` (``launches="stage"``: ``fused_schedule``'s; the last Pull-KV stage in
    ``io.pieces`` pieces), step 8."""
    T, U, S, Tj = io.T, io.U, io.shape.tokens, io.shape.text
    R = len(io.ring_ranks)
    prog, bh = io.prog, io.shape.batch * io.h
    rows: dict[Entry, tuple[int, ...]] = {a: (S,) * U for a in range(T)} | {TEXT: (Tj,)}
    gathered: set = set()
    piece = lambda p: {} if p is None else {"piece": p}  # noqa: E731
    io.stage_in()
    for s in schedule_of(launches, T, io.t, Tj > 0, io.pieces):
        match s.kind:
            case "issue":
                EQ, EKV = io.issue_pulls()
            case "init":
                prog.add(*(Copy(io.shape.state_bytes(io.h, n)) for e in s.q for n in rows[e]))
            case "wait_q":
                prog.wait(*EQ[s.k])
            case "wait_kv":
                prog.wait(*EKV[kv_key(s.k, s.piece)])
            case "barrier_ring":
                io.barrier_ring()
            case "attend":
                q_rows = tuple(n for e in s.q for n in rows[e])
                if s.kv == TEXT:
                    prog.add(Attend(q_rows, (Tj,), bh))
                else:
                    io.ring(q_rows, **piece(s.piece))
            case "finalize":
                prog.add(Attend(rows[s.q[0]], (), bh, finalize=True))
            case "launch":
                kv_rows: tuple[int, ...] = ()
                for e, p in s.kv_pieces():
                    if e != TEXT and (e, p) not in gathered and R > 1:
                        io.ring_all(**piece(p))
                        gathered.add((e, p))
                    kv_rows += rows[e] if e == TEXT else (io.rows_of(p),) * (U * R)
                prog.add(Attend(tuple(n for e in s.q for n in rows[e]), kv_rows, bh, finalize=s.finalize))
            case "push":
                io.push_o(s.k)
    io.stage_out()
    prog.add(Copy(T * U * io.oslot))  # gather_output
    return prog.ops


def build_torus(a) -> TorusAttention:
    kv_pieces_option(a.options)  # checked before any communicator is made
    two = a.two_sided()
    io = TwoSidedTorusIO(a.groups, two, a.rank, fp8.enabled(a.options))
    return TorusAttention(SPEC, a.mesh, io, a.rank, [two], a.options)


SPEC = register(StrategySpec(
    "torus", "tas", "as tas, the inter-machine all-to-all in Torus stages over isend/irecv, "
    "overlapped with attention", build=build_torus,
    program=lambda mesh, rank, shape, launches="ring", kv_pieces=1: torus_ops(
        TwoSidedTorusOps(mesh, rank, shape, kv_pieces), launches), needs_torus=True,
    fallback="tas", order=2, native=NATIVE, launch_modes=("ring", "stage"),
    program_options=(KV_PIECES_OPTION,)))
