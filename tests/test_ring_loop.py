"""The ring loop of ``strategies/ring.py`` on rings of 3 and 4 ranks over in-process
transports, against the fp64 reference.

Every rank holds a block of ``n`` key/value slots and a key mask per slot; every rank's queries
must see all R blocks, each under ITS OWN mask. On a ring of 3 or more the next and the previous
rank differ, so a block fetched from the wrong rank, or attended under the mask of another
rank's block, changes the output. Transports: a pass ring's exchange between threads (one per
rank) through mailboxes (a send is the tensor as posted); a pull ring's get reads the peer's own
block. A transfer lands when waited for, or at once when issued (``eager``): an asynchronous
transfer may do either, so a receive buffer still being read, or a wait left out, shows in one
of the two. Both count on nothing from the code under test.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from xfuser_swiftfusion.kernels import AttnState, new_state
from xfuser_swiftfusion.strategies.ops import Attend, Program, Transfer, Wait
from xfuser_swiftfusion.strategies.ring import PassRing, PullRing, RingStep, ring_ops
from support.inproc_comm import Fabric
from support.reference import attention, max_abs_err

B, H, S, D, N = 1, 4, 3, 8, 2  # N slots of S tokens per block
TIMEOUT_S = 20.0


class _Landing:
    """A receive or a get: copies ``src()`` into ``dst`` when waited for (``eager``: now)."""

    def __init__(self, pairs, eager: bool) -> None:
        self.pairs = pairs  # [(dst, src: () -> tensor)]
        if eager:
            self._land()
            self.pairs = []

    def _land(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src())

    def wait(self) -> None:
        self._land()


class PeerComm:
    """One-sided ``get`` of a peer's own block (``src`` names the slot by identity)."""

    def __init__(self, me: int, own: dict, eager: bool = False) -> None:
        self.me, self.own, self.eager = me, own, eager  # own: rank -> its block (tensors)

    def get(self, dst, src, peer, *, queue, what):
        assert queue == "ring", queue
        i = next(j for j, x in enumerate(self.own[self.me]) if x is src)
        return _Landing([(dst, lambda: self.own[peer][i])], self.eager)


def normalised(s: AttnState) -> torch.Tensor:
    """The output ``acc / l`` ``[B, H, Lq, D]`` of a state (every row here sees keys)."""
    return s.acc / s.l.unsqueeze(-1)


def inputs(R: int, hkv: int, seed: int):
    """Queries per rank ``[B, H, Lq, D]`` (two chunks), global K/V ``[B, hkv, R N S, D]``, a
    global key mask ``[B, R N S]`` (every rank's block has kept and dropped keys)."""
    g = torch.Generator().manual_seed(seed)
    q = [[torch.randn(B, H, L, D, generator=g) for L in (2, 3)] for _ in range(R)]
    k, v = (torch.randn(B, hkv, R * N * S, D, generator=g) for _ in range(2))
    mask = torch.rand(B, R * N * S, generator=g) < 0.6
    mask[:, ::4] = True
    mask[:, 1::5] = False
    return q, k, v, mask


def block_of(x: torch.Tensor, r: int) -> torch.Tensor:
    """Rank r's slots of a global ``[B, h, R N S, D]`` tensor: ``[N, B, h, S, D]``."""
    return torch.stack([x[:, :, (r * N + j) * S:(r * N + j + 1) * S] for j in range(N)])


def masks_of(mask: torch.Tensor):
    """Ring rank -> the key masks ``[B, S]`` of its block's slots."""
    return lambda r: [mask[:, (r * N + j) * S:(r * N + j + 1) * S] for j in range(N)]


def run_ring(form, R: int, hkv: int, packed: bool, eager: bool, seed: int = 0):
    """Every rank's outputs (per Q chunk, two calls) and the reference, fp64; the rings."""
    q, k, v, mask = inputs(R, hkv, seed)
    ranks = tuple(range(10, 10 + R))
    own = {}
    for r in range(R):
        kb, vb = block_of(k, r), block_of(v, r)
        own[ranks[r]] = (torch.stack([kb, vb], 1),) if packed else (kb, vb)
    fabric = Fabric(ranks[-1] + 1, land="post" if eager else "wait", timeout_s=TIMEOUT_S)
    rings = [None] * R

    def rank_main(x: int):
        r = ranks.index(x)
        comm = fabric.comm(x) if form is PassRing else PeerComm(x, own, eager)
        ring = rings[r] = form(comm, ranks, r)
        outs = []
        for _ in range(2):  # the second call reuses the receive buffers
            states = [new_state(x) for x in q[r]]
            ring(q[r], states, *own[x], scale=D ** -0.5, what="test", masks=masks_of(mask))
            outs += [normalised(s) for s in states]
        return outs

    outs = fabric.run(rank_main, ranks=ranks)[ranks[0]:]
    assert all(qu == "ring" for _, qu, _, _, _ in fabric.log)
    refs = [[attention(x, k, v, D ** -0.5, mask) for x in q[r]] for r in range(R)]
    return outs, [x * 2 for x in refs], rings


@pytest.mark.parametrize("eager", [False, True], ids=["at-wait", "eager"])
@pytest.mark.parametrize("form", [PassRing, PullRing])
@pytest.mark.parametrize("R,hkv,packed", [(3, 4, False), (4, 2, True), (3, 1, True), (2, 4, False)])
def test_ring_attends_every_block_under_its_own_mask(form, R, hkv, packed, eager):
    outs, refs, rings = run_ring(form, R, hkv, packed, eager)
    for r in range(R):
        assert len(outs[r]) == len(refs[r])
        for o, ref in zip(outs[r], refs[r]):
            assert max_abs_err(o, ref) < 1e-5, (form.__name__, R, r)
        # two receive buffers per block form, allocated once
        assert [len(p) for p in rings[r].bufs._bufs.values()] == [2], r


def test_pass_ring_sends_next_and_receives_previous_on_every_step():
    R, ranks = 3, (10, 11, 12)
    q, k, v, mask = inputs(R, H, 1)
    fabric = Fabric(13)

    def rank_main(x):
        r = ranks.index(x)
        PassRing(fabric.comm(x), ranks, r)([q[r][0]], [new_state(q[r][0])], block_of(k, r),
                                           block_of(v, r), scale=1.0, what="test")
    fabric.run(rank_main, ranks=ranks)
    exchanges = {r: [([p for p, _ in s], [p for p, _ in rv]) for y, qu, _, s, rv in fabric.log
                     if y == x and qu == "ring"] for r, x in enumerate(ranks)}
    expected = {0: ([11, 11], [12, 12]), 1: ([12, 12], [10, 10]), 2: ([10, 10], [11, 11])}
    assert exchanges == {r: [e] * (R - 1) for r, e in expected.items()}


def test_a_ring_of_one_allocates_no_receive_buffers():
    q, k, v, mask = inputs(1, H, 2)
    ring = PullRing(None, (7,), 0)
    state = new_state(q[0][0])
    ring([q[0][0]], [state], block_of(k, 0), block_of(v, 0), scale=D ** -0.5, what="test")
    assert max_abs_err(normalised(state), attention(q[0][0], k, v, D ** -0.5)) < 1e-5
    assert ring.bufs._bufs == {}


def test_ring_steps_are_values():
    s = RingStep(2, True)
    assert {s, RingStep(2, True)} == {s}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.i = 3  # type: ignore[misc]


def test_pass_ring_fetch_ops_of_every_rank():
    ranks = (10, 11, 12, 13)
    peers = {0: (11, 13), 1: (12, 10), 2: (13, 11), 3: (10, 12)}  # r -> (next, previous)
    for r, (nxt, prv) in peers.items():
        prog = Program(ranks[r])
        PassRing.fetch_ops(prog, ranks, r, 1, (100,))
        (t,) = [op for op in prog.ops if isinstance(op, Transfer)]
        assert (t.sends, t.recvs) == (((nxt, 100),), ((prv, 100),)), r


def test_pull_ring_fetch_ops_of_every_step():
    ranks = (10, 11, 12, 13)
    for r, peers in {0: (11, 12, 13), 1: (12, 13, 10), 3: (10, 11, 12)}.items():
        got = []
        for i in (1, 2, 3):
            prog = Program(ranks[r])
            PullRing.fetch_ops(prog, ranks, r, i, (100,))
            got += [t.recvs[0][0] for t in prog.ops if isinstance(t, Transfer)]
        assert tuple(got) == peers, r


def test_ring_ops_attend_each_block_then_wait_for_the_next():
    prog = Program(11)
    ring_ops(prog, PullRing, (10, 11, 12), 1, (0, 1), (2,), 8, (100, 200))
    a = Attend((0, 1), (2,), 8)
    assert prog.ops == [
        Transfer("get1", "get", "ring", (), ((12, 100),)), Transfer("get2", "get", "ring", (), ((12, 200),)),
        a, Wait(("get1", "get2")),
        Transfer("get3", "get", "ring", (), ((10, 100),)), Transfer("get4", "get", "ring", (), ((10, 200),)),
        a, Wait(("get3", "get4")),
        a]
