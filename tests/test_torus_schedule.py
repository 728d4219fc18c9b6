"""The Torus schedule (``torus_schedule``) against its invariants, for every rank of a mesh,
in one process: no forked ranks, no torch.distributed.

(a) every (query, key) pair of every head group is attended exactly once, text included
    (with ``kv_pieces`` P: every piece of a key's rows once);
(b) on every rank each wait precedes the use of its data, the ring barrier of a remote K/V
    block (piece) precedes the ring attention over it, each output is finalized after its
    last attend and pushed after its finalization;
(c) ``TorusAttention`` over an in-process transport equals fp64 softmax attention over the
    whole sequence.
Each check is also shown to fail on a broken copy of the schedule.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from xfuser_swiftfusion.mesh import Mesh
from xfuser_swiftfusion.strategies import torus
from xfuser_swiftfusion.strategies.layout import Joint, KeyMask, Slots, gather_output
from xfuser_swiftfusion.strategies.torus import (TEXT, Launch, Step, TorusAttention, fused_schedule, kv_key,
                                                 piece_bounds, ring_peers, torus_schedule)
from xfuser_swiftfusion.topology import Topology
from support.fp64_kernel import attend64, new_state64
from support.reference import max_abs_err, rank_rows

MESHES = [(T, U, R) for T in (1, 2, 3, 4) for U in (1, 2) for R in (1, 2)]
PIECES = (1, 2, 3)
Schedule = Callable[[int, int, bool], list[Step]]


def pieced(P: int) -> Schedule:
    """``torus_schedule`` with ``kv_pieces`` P."""
    return lambda T, t, text: torus_schedule(T, t, text, P)


def make_mesh(T: int, U: int, R: int) -> Mesh:
    """T machines of U*R GPUs, Ulysses T*U across them, ring R inside (tas placement)."""
    return Mesh(Topology(T, U * R), T * U, R, "tas")


# --- (a) coverage --------------------------------------------------------------------------

def coverage_problems(T: int, U: int, R: int, text: bool, schedule: Schedule = torus_schedule,
                      P: int = 1) -> list[str]:
    """Counts (head group, query, key) over the attend steps of every rank; queries are a GPU's
    tokens (its rank) or ``("text", r)`` (each ring rank computes the text rows it sends),
    keys piece p of P of a GPU's tokens (``(rank, p)``; a whole block: all P) or ``"text"``.
    Every pair must count exactly once."""
    mesh, W = make_mesh(T, U, R), T * U * R
    seen: Counter = Counter()
    for x in range(W):
        t, u, r = mesh.coords(x)
        for s in schedule(T, t, text):
            if s.kind != "attend":
                continue
            parts = range(P) if s.piece is None else [s.piece]
            keys = (["text"] if s.kv == TEXT
                    else [(mesh.rank_of(s.kv, b, r2), p) for b in range(U) for r2 in range(R) for p in parts])
            for e in s.q:
                queries = [("text", r)] if e == TEXT else [mesh.rank_of(e, b, r) for b in range(U)]
                seen.update((t * U + u, qq, kk) for qq in queries for kk in keys)
    queries = [*range(W), *([("text", r) for r in range(R)] if text else [])]
    keys = [*((x, p) for x in range(W) for p in range(P)), *(["text"] if text else [])]
    expected = {(g, qq, kk) for g in range(T * U) for qq in queries for kk in keys}
    return ([f"head group {g}: query {qq} x key {kk} attended {seen[g, qq, kk]} times"
             for g, qq, kk in sorted(expected, key=str) if seen[g, qq, kk] != 1]
            + [f"unexpected pair {p}" for p in seen if p not in expected])


# --- (b) order -----------------------------------------------------------------------------

def order_problems(steps: list[Step], T: int, t: int, text: bool, P: int = 1) -> list[str]:
    """Ordering invariants of one rank's steps (machine ``t``; ``P``: ``kv_pieces``, the last
    Pull-KV stage's block ``t + 1`` waited for, synchronised and attended piece by piece)."""
    entries = [*range(T), *([TEXT] if text else [])]
    where = lambda pred: [i for i, s in enumerate(steps) if pred(s)]  # noqa: E731
    problems = [f"step {i} has no line tag" for i in where(lambda s: not s.line)]

    issue, init = where(lambda s: s.kind == "issue"), where(lambda s: s.kind == "init")
    if len(issue) != 1 or len(init) != 1:
        return problems + [f"{len(issue)} issue and {len(init)} init steps, want one each"]
    if sorted(steps[init[0]].q, key=str) != sorted(entries, key=str):
        problems.append(f"init creates states for {steps[init[0]].q}, want {entries}")
    if waits := where(lambda s: s.kind in ("wait_q", "wait_kv")):
        if waits[0] < issue[0]:
            problems.append("a wait comes before the pulls are issued")
    if uses := where(lambda s: s.kind in ("attend", "finalize")):
        if uses[0] < init[0]:
            problems.append("a state is used before init")

    for a in (a for a in range(T) if a != t):
        k = (t - a) % T
        parts = list(range(P)) if P > 1 and k == T - 1 else [None]  # the pieces block a comes in
        wq = where(lambda s: s.kind == "wait_q" and s.q == (a,))
        wkv = {p: where(lambda s: s.kind == "wait_kv" and s.kv == a and s.piece == p) for p in parts}
        bar = {p: where(lambda s: s.kind == "barrier_ring" and s.kv == a and s.piece == p) for p in parts}
        n_kv = len(where(lambda s: s.kind == "wait_kv" and s.kv == a))
        n_bar = len(where(lambda s: s.kind == "barrier_ring" and s.kv == a))
        if (len(wq) != 1 or n_kv != len(parts) or n_bar != len(parts)
                or any(len(wkv[p]) != 1 or len(bar[p]) != 1 for p in parts)):
            problems.append(f"machine {a}: {len(wq)} Q waits, {n_kv} K/V waits, {n_bar} ring barriers "
                            f"(pieces {parts})")
            continue
        wkv, bar = {p: w[0] for p, w in wkv.items()}, {p: b[0] for p, b in bar.items()}
        if steps[wq[0]].k != k or any(steps[w].k != k for w in wkv.values()):
            problems.append(f"machine {a} arrives in stage {k}, waited for as stage "
                            f"{steps[wq[0]].k} (Q) / {[steps[w].k for w in wkv.values()]} (K/V)")
        if any(i < wq[0] for i in where(lambda s: s.kind in ("attend", "finalize") and a in s.q)):
            problems.append(f"Q of machine {a} used before its wait")
        if any(bar[p] < wkv[p] for p in parts):
            problems.append(f"ring barrier for K/V of machine {a} before its wait")
        for i in where(lambda s: s.kind == "attend" and s.kv == a):
            p = steps[i].piece
            need = parts if p is None else [p]  # a whole block needs every piece of it
            if p not in parts and p is not None:
                problems.append(f"K/V of machine {a} attended as piece {p}, not one of {parts}")
                continue
            if any(i < wkv[x] for x in need):
                problems.append(f"K/V of machine {a} attended before its wait")
            if any(i < bar[x] for x in need):
                problems.append(f"K/V of machine {a} attended before its ring barrier")

    fin = {}
    for e in entries:
        f = where(lambda s: s.kind == "finalize" and s.q == (e,))
        if len(f) != 1:
            problems.append(f"output {e} finalized {len(f)} times")
            continue
        fin[e] = f[0]
        if any(i > f[0] for i in where(lambda s: s.kind == "attend" and e in s.q)):
            problems.append(f"output {e} finalized before its last attend")
    pushes = []
    for a in range(T):
        p = where(lambda s: s.kind == "push" and s.q == (a,))
        if len(p) != 1:
            problems.append(f"output {a} pushed {len(p)} times")
            continue
        pushes.append(p[0])
        if steps[p[0]].k != (t - a) % T:
            problems.append(f"output {a} pushed as stage {steps[p[0]].k}, want {(t - a) % T}")
        if a in fin and p[0] < fin[a]:
            problems.append(f"output {a} pushed before it is finalized")
    if TEXT in fin and pushes and fin[TEXT] > min(pushes):
        problems.append("text output final after a push (its rows ride in every slot)")
    return problems


@pytest.mark.parametrize("P", PIECES)
@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("T,U,R", MESHES)
def test_every_pair_attended_once(T, U, R, text, P):
    assert coverage_problems(T, U, R, text, pieced(P), P) == []


@pytest.mark.parametrize("P", PIECES)
@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_waits_barriers_finalize_push_order(T, text, P):
    for t in range(T):  # the schedule depends on t only, not on u or r
        assert order_problems(torus_schedule(T, t, text, P), T, t, text, P) == [], (T, t)


def test_one_piece_is_the_schedule_without_pieces():
    for T in (1, 2, 3, 4):
        for t in range(T):
            steps = torus_schedule(T, t, True, 1)
            assert all(s.piece is None for s in steps) and steps == torus_schedule(T, t, True)
    assert torus_schedule(1, 0, True, 3) == torus_schedule(1, 0, True)  # one machine: no Pull-KV
    with pytest.raises(ValueError, match="kv_pieces"):
        torus_schedule(2, 0, False, 0)


def test_launches_name_pieces_only_where_a_kv_entry_is_a_piece():
    """``Launch.pieces``: empty where every K/V entry is whole, else one per K/V entry, each
    that of the step it came from (the launch's K/V entries are its steps' in order)."""
    for T in (1, 2, 3, 4):
        for t in range(T):
            for text in (False, True):
                for P in (1, 2, 3):
                    steps = [(s.q, s.kv, s.piece) for s in torus_schedule(T, t, text, P) if s.kind == "attend"]
                    launched = []
                    for x in fused_schedule(T, t, text, P):
                        if isinstance(x, Launch) and x.kv:
                            whole = all(p is None for _, p in x.kv_pieces())
                            assert (x.pieces == ()) == whole and (whole or len(x.pieces) == len(x.kv)), x
                            launched += [(x.q, e, p) for e, p in x.kv_pieces()]
                    assert launched == steps, (T, t, text, P)


def test_pieces_of_the_last_stage_read_like_the_refinement():
    """T = 2, machine 0, P = 3: pieces 1-2 of block 1 by every query entry as they arrive, the
    last piece block by block (the remote block first, pushed at once; mine beside the push)."""
    steps = [(s.kind, s.q, s.kv, s.piece) for s in torus_schedule(2, 0, True, 3)][7:]
    assert steps == [("wait_kv", (), 1, 0), ("barrier_ring", (), 1, 0), ("attend", (0, 1, TEXT), 1, 0),
                     ("wait_kv", (), 1, 1), ("barrier_ring", (), 1, 1), ("attend", (0, 1, TEXT), 1, 1),
                     ("wait_kv", (), 1, 2), ("barrier_ring", (), 1, 2), ("attend", (1, TEXT), 1, 2),
                     ("finalize", (TEXT,), None, None), ("finalize", (1,), None, None),
                     ("push", (1,), None, None), ("attend", (0,), 1, 2), ("finalize", (0,), None, None),
                     ("push", (0,), None, None)]
    # fused: one launch per piece; the P - 1 pieces add P - 1 launches to the layer
    for T, P in ((2, 3), (4, 4)):
        n = lambda P: sum(isinstance(x, Launch) for x in fused_schedule(T, 0, True, P))  # noqa: E731
        assert n(P) == n(1) + P - 1, (T, P)
    launch = [x for x in fused_schedule(2, 0, True, 3) if isinstance(x, Launch)][2]
    assert (launch.q, launch.kv, launch.pieces, launch.kv_pieces()) == ((0, 1, TEXT), (1,), (0,), [(1, 0)])
    assert piece_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)] and piece_bounds(4, 1) == [(0, 4)]
    assert kv_key(2, None) == 2 and kv_key(2, 1) == (2, 1)


def test_schedule_reads_like_the_paper():
    """T = 3, machine 1, with text: the stage names and call shapes the transports log."""
    rings = [(s.what, s.q, s.kv) for s in torus_schedule(3, 1, True) if s.kind == "attend" and s.kv != TEXT]
    assert rings == [("Pull-Q stage 1", (1, TEXT), 1), ("Pull-Q stage 2", (0,), 1),
                     ("Pull-Q stage 3", (2,), 1), ("Pull-KV stage 1", (1, 0, 2, TEXT), 0),
                     ("Pull-KV stage 2, queries of machine 0", (0, TEXT), 2),
                     ("Pull-KV stage 2, queries of machine 2", (2,), 2), ("Push-O", (1,), 2)]
    # the last Pull-KV stage block by block, each output pushed once final; then Push-O
    tail = [(s.kind, s.q, s.kv, s.k) for s in torus_schedule(3, 1, True)][-10:]
    assert tail == [("attend", (0, TEXT), 2, 0), ("finalize", (TEXT,), None, 0), ("finalize", (0,), None, 0),
                    ("push", (0,), None, 1), ("attend", (2,), 2, 0), ("finalize", (2,), None, 0),
                    ("push", (2,), None, 2), ("attend", (1,), 2, 0), ("finalize", (1,), None, 0),
                    ("push", (1,), None, 0)]


# --- the checks fail on broken schedules ---------------------------------------------------

def _edit(pred, how: str):
    """A mutation of a schedule: its first step matching ``pred`` dropped, doubled, or moved
    last or first (right after issue and init)."""
    def mutate(steps: list[Step]) -> list[Step]:
        i = next(i for i, s in enumerate(steps) if pred(s))
        s, rest = steps[i], steps[:i] + steps[i + 1:]
        return {"drop": rest, "twice": steps[:i] + [s] + steps[i:], "last": rest + [s],
                "first": rest[:2] + [s] + rest[2:]}[how]
    return mutate


def _ring(what):
    return lambda s: s.kind == "attend" and s.what == what and s.kv != TEXT


BROKEN = {  # name: (mutation of each rank's schedule, check, expected problem)
    "drop a Pull-Q ring": (_edit(_ring("Pull-Q stage 2"), "drop"), "coverage", "attended 0 times"),
    "drop a text K/V attend": (_edit(lambda s: s.kv == TEXT and s.what == "Pull-Q stage 3", "drop"),
                               "coverage", "x key text attended 0 times"),
    "ring twice": (_edit(_ring("Pull-KV stage 1"), "twice"), "coverage", "attended 2 times"),
    "Q wait late": (_edit(lambda s: s.kind == "wait_q", "last"), "order", "used before its wait"),
    "K/V wait late": (_edit(lambda s: s.kind == "wait_kv", "last"), "order", "attended before its wait"),
    "no ring barrier": (_edit(lambda s: s.kind == "barrier_ring", "drop"), "order", "ring barriers"),
    "ring barrier late": (_edit(lambda s: s.kind == "barrier_ring", "last"), "order",
                          "attended before its ring barrier"),
    "finalize early": (_edit(lambda s: s.kind == "finalize" and s.q != (TEXT,), "first"), "order",
                       "finalized before its last attend"),
    "push early": (_edit(lambda s: s.kind == "push", "first"), "order", "pushed before it is finalized"),
    "text final late": (_edit(lambda s: s.kind == "finalize" and s.q == (TEXT,), "last"), "order",
                        "text output final after a push"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_checks_catch_broken_schedules(name):
    mutate, check, expected = BROKEN[name]
    T, U, R = 3, 2, 2
    broken = lambda T, t, text: mutate(torus_schedule(T, t, text))  # noqa: E731
    if check == "coverage":
        problems = coverage_problems(T, U, R, True, broken)
    else:
        problems = [p for t in range(T) for p in order_problems(broken(T, t, True), T, t, True)]
    assert any(expected in p for p in problems), problems


def _piece(p, kind="attend"):
    return lambda s: s.kind == kind and s.piece == p


def _renumber(p, to):
    """The first attend of piece ``p`` attending piece ``to`` instead."""
    def mutate(steps):
        i = next(i for i, s in enumerate(steps) if _piece(p)(s))
        return steps[:i] + [dataclasses.replace(steps[i], piece=to)] + steps[i + 1:]
    return mutate


BROKEN_PIECES = {  # as BROKEN, at kv_pieces = 3
    "drop a piece's attend": (_edit(_piece(1), "drop"), "coverage", "attended 0 times"),
    "a piece twice": (_edit(_piece(0), "twice"), "coverage", "attended 2 times"),
    "the wrong piece": (_renumber(0, 1), "coverage", "attended 2 times"),
    "a piece's wait late": (_edit(_piece(1, "wait_kv"), "last"), "order", "attended before its wait"),
    "a piece's wait dropped": (_edit(_piece(2, "wait_kv"), "drop"), "order", "2 K/V waits"),
    "a piece's barrier late": (_edit(_piece(0, "barrier_ring"), "last"), "order",
                               "attended before its ring barrier"),
    "the last piece's wait late": (_edit(_piece(2, "wait_kv"), "last"), "order", "attended before its wait"),
}


@pytest.mark.parametrize("name", BROKEN_PIECES)
def test_checks_catch_broken_pieces(name):
    mutate, check, expected = BROKEN_PIECES[name]
    T, U, R, P = 3, 2, 2, 3
    broken = lambda T, t, text: mutate(torus_schedule(T, t, text, P))  # noqa: E731
    if check == "coverage":
        problems = coverage_problems(T, U, R, True, broken, P)
    else:
        problems = [p for t in range(T) for p in order_problems(broken(T, t, True), T, t, True, P)]
    assert any(expected in p for p in problems), problems


# --- (c) numerics over an in-process transport ---------------------------------------------

class _Pull:
    """A transfer that lands when waited for."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src

    def wait(self) -> None:
        self.dst.copy_(self.src)


class FakeIO:
    """``TorusIO`` of GPU ``(t, u, r)`` over global ``[B, H, L, D]`` tensors (rank x holds
    tokens ``[x S, (x+1) S)``). Buffers start as NaN, pulled blocks land when waited for,
    query block ``a`` lives in the image rows of output slot ``a`` (as in both transports),
    pushes write into the peers' ``Ob``."""

    def __init__(self, mesh: Mesh, rank: int, q, k, v, text_len: int, fleet: dict) -> None:
        self.mesh, self.fleet, self.glob = mesh, fleet, {"Q": q, "K": k, "V": v}
        self.text_len, self.barriers, self.rank, self.calls = text_len, 0, rank, Counter()
        self.t, self.u, self.r = mesh.coords(rank)
        T, U = mesh.torus, mesh.ulysses_intra
        B, H, L, D = q.shape
        self.h, self.S = H // (T * U), L // mesh.world_size
        nan = lambda shape: q.new_full(shape, math.nan)  # noqa: E731
        self.O, self.Ob = (Slots.alloc(nan, (T, U), B, self.h, self.S, text_len, D) for _ in range(2))
        kv = (T, U, B, k.shape[1] // (T * U), self.S, D)  # K/V: H_kv heads (GQA) split alike
        self.buf = {"Q": self.O.rows, "K": nan(kv), "V": nan(kv)}  # [T, U, B, h, S, D] each

    def block(self, name: str, a: int, r: int | None = None) -> torch.Tensor:
        """``[U, B, h, S, D]``: tokens of GPUs (a, :, r), my head group (t, u)."""
        g, r = self.t * self.mesh.ulysses_intra + self.u, self.r if r is None else r
        h = self.glob[name].shape[1] // (self.mesh.torus * self.mesh.ulysses_intra)
        x = self.glob[name][:, g * h:(g + 1) * h]
        starts = [self.mesh.rank_of(a, b, r) * self.S for b in range(self.mesh.ulysses_intra)]
        return torch.stack([x[:, :, i:i + self.S] for i in starts])

    def stage_in(self, q, k, v, text_len, pieces=1):
        assert text_len == self.text_len, (text_len, self.text_len)  # sizes the real slots
        self.bounds = piece_bounds(self.S, pieces) if pieces > 1 else None
        mine = slice(self.rank * self.S, (self.rank + 1) * self.S)
        assert torch.equal(k, self.glob["K"][:, :, mine]) and torch.equal(v, self.glob["V"][:, :, mine])
        for n in ("Q", "K", "V"):  # steps 1-2: my machine's tokens of my head group
            self.buf[n][self.t] = self.block(n, self.t)

    def issue_pulls(self):
        """Pulls per stage; with pieces, the last stage's K/V block row range by row range."""
        T, t = self.mesh.torus, self.t
        pull = lambda n, a, rows=slice(None): _Pull(self.buf[n][a][..., rows, :],  # noqa: E731
                                                    self.block(n, a)[..., rows, :])
        kv = {k: [pull("K", (t - k) % T), pull("V", (t - k) % T)] for k in range(1, T)}
        if self.bounds is not None and T > 1:
            a = (t + 1) % T
            del kv[T - 1]
            kv |= {kv_key(T - 1, p): [pull("K", a, slice(lo, hi)), pull("V", a, slice(lo, hi))]
                   for p, (lo, hi) in enumerate(self.bounds)}
        return {k: [pull("Q", (t - k) % T)] for k in range(1, T)}, kv

    def q_block(self, a):
        return self.buf["Q"][a]

    def kv_block(self, a):
        return self.buf["K"][a], self.buf["V"][a]

    def _blocks(self, a, piece):
        """Each ring peer's block ``a`` (mine as it stands in my buffer), or its piece's rows."""
        rows = slice(None) if piece is None else slice(*self.bounds[piece])
        for r2 in range(self.mesh.ring):
            k, v = self.kv_block(a) if r2 == self.r else (self.block("K", a, r2), self.block("V", a, r2))
            yield r2, k[..., rows, :], v[..., rows, :]

    def ring(self, q_chunks, states, a, *, scale, what, masks=None, piece=None):
        self.calls["ring"] += 1
        if piece is not None:
            self.calls["pieces"] += 1
        for r2, k, v in self._blocks(a, piece):
            attend64(q_chunks, list(zip(k.unbind(0), v.unbind(0))), states, scale=scale,
                     key_masks=None if masks is None else masks(r2))

    def ring_all(self, a, *, what, piece=None):
        """Every ring peer's block ``a`` (or its piece): (ring rank, its U (K, V) chunks)."""
        self.calls["ring_all"] += 1
        if piece is not None:
            self.calls["pieces"] += 1
        return [(r2, list(zip(k.unbind(0), v.unbind(0)))) for r2, k, v in self._blocks(a, piece)]

    def barrier_ring(self, *, what):
        self.barriers += 1

    def push_o(self, k):
        T, t, u = self.mesh.torus, self.t, self.u
        a = (t - k) % T
        for b in range(self.mesh.ulysses_intra):
            self.fleet[self.mesh.rank_of(a, b, self.r)].Ob.flat[t, u] = self.O.flat[a, b]

    def stage_out(self):
        return self.Ob


def torus_errors(T: int, U: int, R: int, Tj: int, where: str = "front",
                 launches: str | None = "ring", fleet: dict | None = None, masked: bool = False,
                 kv_heads: int | None = None, kv_pieces: int = 1) -> list[float]:
    """Run ``TorusAttention`` (``launches``: ``torus_schedule``'s steps or ``fused_schedule``'s
    launches, the GPU default) for every rank (one after the other) and return each rank's max
    error against fp64 softmax attention over the whole sequence [text; image] (``masked``:
    under a random key mask of the image and of the text keys; ``kv_heads``: grouped-query K/V
    of that many heads, which the transport holds repeated to ``lcm(kv_heads, T U)`` heads;
    ``kv_pieces``: the option)."""
    mesh, W = make_mesh(T, U, R), T * U * R
    B, H, S, D, scale = 2, 2 * T * U, 3, 4, 0.4
    g = torch.Generator().manual_seed(T * 100 + U * 10 + R + Tj)
    Hkv = H if kv_heads is None else kv_heads
    q, k, v = (torch.randn(B, h, W * S, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    jq, jk, jv = (torch.randn(B, h, Tj, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    f = math.lcm(Hkv, T * U) // Hkv
    wide = lambda x: x.repeat_interleave(f, dim=1)  # noqa: E731  [B, H_kv f, L, D], head i <- i // f
    joint = Joint(jq, jk, jv, where) if Tj else None
    key_mask = tokens = text = None
    if masked:
        tokens, text = torch.rand(B, W * S, generator=g) < 0.6, torch.rand(B, Tj, generator=g) < 0.6
        tokens[:, 0] = True  # every query keeps a key
        key_mask = KeyMask(tokens, S, text if Tj else None)
    fleet = {} if fleet is None else fleet  # rank -> its FakeIO
    fleet.update({x: FakeIO(mesh, x, q, wide(k), wide(v), Tj, fleet) for x in range(W)})
    mine = lambda x: slice(x * S, (x + 1) * S)  # noqa: E731
    for x in range(W):  # pushes land in the peers' Ob, complete once every rank ran
        # the layer's calls run directly (no plan): FakeIO's work is plain torch
        options = ({} if launches is None else {"launches": launches}) | (
            {"kv_pieces": kv_pieces} if kv_pieces != 1 else {})
        TorusAttention(torus.SPEC, mesh, fleet[x], x, [], options).layer(q[:, :, mine(x)], k[:, :, mine(x)],
                                                          v[:, :, mine(x)], joint, scale, key_mask)
    errors = []
    for x in range(W):
        out = gather_output(fleet[x].Ob, joint)
        want = rank_rows(q, k, v, x, W, (jq, jk, jv), where, scale, tokens, text if Tj else None)
        errors.append(max_abs_err(out, want) if out.shape == want.shape else math.inf)
    return errors


@pytest.fixture
def fp64_kernel(monkeypatch):
    monkeypatch.setattr(torus, "attend", attend64)
    monkeypatch.setattr(torus, "new_states", lambda chunks: [new_state64(c) for c in chunks])


@pytest.mark.parametrize("Tj,where", [(0, "front"), (2, "front"), (3, "rear")])
@pytest.mark.parametrize("T,U,R", MESHES)
def test_matches_softmax_attention(fp64_kernel, T, U, R, Tj, where):
    errors = torus_errors(T, U, R, Tj, where)
    assert max(errors) <= 1e-10, errors


def test_every_ring_barrier_of_the_schedule_reaches_the_transport(fp64_kernel):
    fleet: dict[int, FakeIO] = {}
    torus_errors(3, 2, 2, 2, fleet=fleet)
    mesh = make_mesh(3, 2, 2)
    want = {x: sum(s.kind == "barrier_ring" for s in torus_schedule(3, mesh.coords(x)[0], True))
            for x in fleet}
    assert {x: io.barriers for x, io in fleet.items()} == want and min(want.values()) > 0


def test_steps_are_values_and_the_launches_option_is_checked():
    assert len({*torus_schedule(2, 0, True), *torus_schedule(2, 0, True)}) == len(set(torus_schedule(2, 0, True)))
    assert torus.launches_option({}) is None and torus.launches_option({"launches": "stage"}) == "stage"
    with pytest.raises(ValueError, match="launches"):
        torus.launches_option({"launches": "fused"})


def test_torus_runs_only_on_torus_ready_meshes():
    """3x2 with one head: U1 x R6, the ring crosses machines: no Torus schedule there."""
    from xfuser_swiftfusion.mesh import choose_mesh
    assert not torus.SPEC.runs_on(choose_mesh(Topology(3, 2), 1))
    assert torus.SPEC.runs_on(choose_mesh(Topology(3, 2), 6))


def test_ring_peers_from_the_next_one_on():
    assert ring_peers((10, 11, 12, 13), 1) == [(2, 12), (3, 13), (0, 10)]
    assert ring_peers((5, 7), 0) == [(1, 7)] and ring_peers((5, 7), 1) == [(0, 5)]
    assert ring_peers((4,), 0) == []


@pytest.mark.parametrize("Tj,where", [(0, "front"), (2, "front"), (3, "rear")])
@pytest.mark.parametrize("T,U,R", [(1, 2, 2), (2, 1, 2), (3, 2, 2), (4, 2, 1)])
def test_fused_launches_match_softmax_attention(fp64_kernel, T, U, R, Tj, where):
    """The fused schedule (one launch per stage against the ring group's gathered K/V)."""
    errors = torus_errors(T, U, R, Tj, where, launches="stage")
    assert max(errors) <= 1e-10, errors


@pytest.mark.parametrize("name", ["drop a Pull-Q ring", "drop a text K/V attend", "ring twice",
                                  "Q wait late", "K/V wait late", "finalize early"])
def test_numerics_catch_broken_schedules(fp64_kernel, monkeypatch, name):
    mutate = BROKEN[name][0]
    monkeypatch.setattr(torus, "torus_schedule",
                        lambda T, t, text, pieces=1: mutate(torus_schedule(T, t, text, pieces)))
    errors = torus_errors(3, 2, 2, 2)
    assert not max(errors) <= 1e-10, errors  # NaN (data used before it landed) fails too


@pytest.mark.parametrize("launches", ["ring", "stage"])
@pytest.mark.parametrize("T,U,R,Tj", [(3, 2, 2, 2), (2, 1, 3, 0)])
def test_key_masks_reach_every_block_and_the_text(fp64_kernel, launches, T, U, R, Tj):
    """Each ring peer's block under its own tokens' mask, the text keys under theirs."""
    errors = torus_errors(T, U, R, Tj, launches=launches, masked=True)
    assert max(errors) <= 1e-10, errors


@pytest.mark.parametrize("launches", ["ring", "stage"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_kv_repeated_to_split_into_the_head_groups(fp64_kernel, launches, kv_heads):
    """T U = 4 head groups, 8 query heads, 2 or 1 K/V heads (and text K/V): the K/V reach the
    transport repeated to 4 heads, one per group."""
    errors = torus_errors(2, 2, 1, 2, launches=launches, kv_heads=kv_heads)
    assert max(errors) <= 1e-10, errors


@pytest.mark.parametrize("launches,calls", [(None, "ring"), ("ring", "ring"), ("stage", "ring_all")])
def test_the_launches_option_picks_the_schedule(fp64_kernel, launches, calls):
    """No option on CPU tensors: the ring schedule; ``stage``: the fused launches (each over
    its ring group's K/V at once)."""
    fleet: dict[int, FakeIO] = {}
    assert max(torus_errors(2, 1, 2, 0, launches=launches, fleet=fleet)) <= 1e-10
    assert {n for io in fleet.values() for n in io.calls} == {calls}
    mesh = make_mesh(2, 1, 2)
    assert TorusAttention(torus.SPEC, mesh, fleet[0], 0, [], None).launches is None


def test_launches_are_values_and_torus_is_listed_after_tas():
    a = Launch("w", (0,), (1, TEXT))
    assert {a, Launch("w", (0,), (1, TEXT))} == {a}
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.finalize = True  # type: ignore[misc]
    from xfuser_swiftfusion.strategies.registry import specs
    names = [s.name for s in specs()]
    assert names.index("tas") < names.index("torus") < names.index("swiftfusion") < names.index("auto")


@pytest.mark.parametrize("launches", ["ring", "stage"])
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("T,U,R,Tj,masked,kv_heads", [(2, 2, 1, 2, True, 2), (3, 1, 2, 3, True, None),
                                                      (2, 1, 2, 0, False, 1), (3, 2, 1, 0, True, 3)])
def test_kv_pieces_match_softmax_attention(fp64_kernel, launches, P, T, U, R, Tj, masked, kv_heads):
    """The last Pull-KV stage in P pieces (S = 3 rows: P = 2 pieces of 2 and 1 rows): text, key
    masks (each piece under its columns), GQA, both launch modes; the pieces reach the
    transport (P ring calls or gathers per rank)."""
    fleet: dict[int, FakeIO] = {}
    errors = torus_errors(T, U, R, Tj, launches=launches, masked=masked, kv_heads=kv_heads,
                          kv_pieces=P, fleet=fleet)
    assert max(errors) <= 1e-10, errors
    # pieces 1..P-1 once each, the last piece by each of the T query blocks of the tail
    assert {io.calls["pieces"] for io in fleet.values()} == {P - 1 + T}


@pytest.mark.parametrize("name", ["a piece's wait late", "the last piece's wait late", "the wrong piece",
                                  "drop a piece's attend"])
def test_numerics_catch_broken_pieces(fp64_kernel, monkeypatch, name):
    mutate = BROKEN_PIECES[name][0]
    monkeypatch.setattr(torus, "torus_schedule",
                        lambda T, t, text, pieces=1: mutate(torus_schedule(T, t, text, pieces)))
    errors = torus_errors(3, 2, 2, 2, kv_pieces=3)
    assert not max(errors) <= 1e-10, errors


def test_kv_pieces_option_is_checked():
    assert torus.kv_pieces_option({}) == 1 and torus.kv_pieces_option({"kv_pieces": 4}) == 4
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match="kv_pieces"):
            torus.kv_pieces_option({"kv_pieces": bad})
    with pytest.raises(ValueError, match="kv_pieces > 1 with fp8_comms is not supported"):
        torus.kv_pieces_option({"kv_pieces": 2, "fp8_comms": True})
    assert torus.kv_pieces_option({"kv_pieces": 1, "fp8_comms": True}) == 1
