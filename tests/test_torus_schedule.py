"""The Torus schedule (``torus_schedule``) against its invariants, for every rank of a mesh,
in one process: no forked ranks, no torch.distributed.

(a) every (query, key) pair of every head group is attended exactly once, text included;
(b) on every rank each wait precedes the use of its data, the ring barrier of a remote K/V
    block precedes the ring attention over it, each output is finalized after its last
    attend and pushed after its finalization;
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
from xfuser_swiftfusion.strategies.torus import TEXT, Launch, Step, TorusAttention, ring_peers, torus_schedule
from xfuser_swiftfusion.topology import Topology
from support.fp64_kernel import attend64, new_state64
from support.reference import max_abs_err, rank_rows

MESHES = [(T, U, R) for T in (1, 2, 3, 4) for U in (1, 2) for R in (1, 2)]
Schedule = Callable[[int, int, bool], list[Step]]


def make_mesh(T: int, U: int, R: int) -> Mesh:
    """T machines of U*R GPUs, Ulysses T*U across them, ring R inside (tas placement)."""
    return Mesh(Topology(T, U * R), T * U, R, "tas")


# --- (a) coverage --------------------------------------------------------------------------

def coverage_problems(T: int, U: int, R: int, text: bool, schedule: Schedule = torus_schedule) -> list[str]:
    """Counts (head group, query, key) over the attend steps of every rank; queries are a GPU's
    tokens (its rank) or ``("text", r)`` (each ring rank computes the text rows it sends),
    keys a GPU's tokens or ``"text"``. Every pair must count exactly once."""
    mesh, W = make_mesh(T, U, R), T * U * R
    seen: Counter = Counter()
    for x in range(W):
        t, u, r = mesh.coords(x)
        for s in schedule(T, t, text):
            if s.kind != "attend":
                continue
            keys = (["text"] if s.kv == TEXT
                    else [mesh.rank_of(s.kv, b, r2) for b in range(U) for r2 in range(R)])
            for e in s.q:
                queries = [("text", r)] if e == TEXT else [mesh.rank_of(e, b, r) for b in range(U)]
                seen.update((t * U + u, qq, kk) for qq in queries for kk in keys)
    queries = [*range(W), *([("text", r) for r in range(R)] if text else [])]
    keys = [*range(W), *(["text"] if text else [])]
    expected = {(g, qq, kk) for g in range(T * U) for qq in queries for kk in keys}
    return ([f"head group {g}: query {qq} x key {kk} attended {seen[g, qq, kk]} times"
             for g, qq, kk in sorted(expected, key=str) if seen[g, qq, kk] != 1]
            + [f"unexpected pair {p}" for p in seen if p not in expected])


# --- (b) order -----------------------------------------------------------------------------

def order_problems(steps: list[Step], T: int, t: int, text: bool) -> list[str]:
    """Ordering invariants of one rank's steps (machine ``t``)."""
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
        wq = where(lambda s: s.kind == "wait_q" and s.q == (a,))
        wkv = where(lambda s: s.kind == "wait_kv" and s.kv == a)
        bar = where(lambda s: s.kind == "barrier_ring" and s.kv == a)
        if len(wq) != 1 or len(wkv) != 1 or len(bar) != 1:
            problems.append(f"machine {a}: {len(wq)} Q waits, {len(wkv)} K/V waits, {len(bar)} ring barriers")
            continue
        if (steps[wq[0]].k, steps[wkv[0]].k) != (k, k):
            problems.append(f"machine {a} arrives in stage {k}, waited for as stage "
                            f"{steps[wq[0]].k} (Q) / {steps[wkv[0]].k} (K/V)")
        if any(i < wq[0] for i in where(lambda s: s.kind in ("attend", "finalize") and a in s.q)):
            problems.append(f"Q of machine {a} used before its wait")
        if bar[0] < wkv[0]:
            problems.append(f"ring barrier for K/V of machine {a} before its wait")
        kv_uses = where(lambda s: s.kind == "attend" and s.kv == a)
        if any(i < wkv[0] for i in kv_uses):
            problems.append(f"K/V of machine {a} attended before its wait")
        if any(i < bar[0] for i in kv_uses):
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


@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("T,U,R", MESHES)
def test_every_pair_attended_once(T, U, R, text):
    assert coverage_problems(T, U, R, text) == []


@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_waits_barriers_finalize_push_order(T, text):
    for t in range(T):  # the schedule depends on t only, not on u or r
        assert order_problems(torus_schedule(T, t, text), T, t, text) == [], (T, t)


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

    def stage_in(self, q, k, v, text_len):
        assert text_len == self.text_len, (text_len, self.text_len)  # sizes the real slots
        mine = slice(self.rank * self.S, (self.rank + 1) * self.S)
        assert torch.equal(k, self.glob["K"][:, :, mine]) and torch.equal(v, self.glob["V"][:, :, mine])
        for n in ("Q", "K", "V"):  # steps 1-2: my machine's tokens of my head group
            self.buf[n][self.t] = self.block(n, self.t)

    def issue_pulls(self):
        T, t = self.mesh.torus, self.t
        pull = lambda n, a: _Pull(self.buf[n][a], self.block(n, a))  # noqa: E731
        return ({k: [pull("Q", (t - k) % T)] for k in range(1, T)},
                {k: [pull("K", (t - k) % T), pull("V", (t - k) % T)] for k in range(1, T)})

    def q_block(self, a):
        return self.buf["Q"][a]

    def kv_block(self, a):
        return self.buf["K"][a], self.buf["V"][a]

    def ring(self, q_chunks, states, a, *, scale, what, masks=None):
        self.calls["ring"] += 1
        for r2 in range(self.mesh.ring):  # ring peer r2's block a (mine as it stands in my buffer)
            k, v = self.kv_block(a) if r2 == self.r else (self.block("K", a, r2), self.block("V", a, r2))
            attend64(q_chunks, list(zip(k.unbind(0), v.unbind(0))), states, scale=scale,
                     key_masks=None if masks is None else masks(r2))

    def ring_all(self, a, *, what):
        """Every ring peer's block ``a`` (mine as it stands in my buffer): (ring rank, its U
        (K, V) chunks)."""
        self.calls["ring_all"] += 1
        out = []
        for r2 in range(self.mesh.ring):
            k, v = self.kv_block(a) if r2 == self.r else (self.block("K", a, r2), self.block("V", a, r2))
            out.append((r2, list(zip(k.unbind(0), v.unbind(0)))))
        return out

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
                 kv_heads: int | None = None) -> list[float]:
    """Run ``TorusAttention`` (``launches``: ``torus_schedule``'s steps or ``fused_schedule``'s
    launches, the GPU default) for every rank (one after the other) and return each rank's max
    error against fp64 softmax attention over the whole sequence [text; image] (``masked``:
    under a random key mask of the image and of the text keys; ``kv_heads``: grouped-query K/V
    of that many heads, which the transport holds repeated to ``lcm(kv_heads, T U)`` heads)."""
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
        options = {} if launches is None else {"launches": launches}
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
    monkeypatch.setattr(torus, "torus_schedule", lambda T, t, text: mutate(torus_schedule(T, t, text)))
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
