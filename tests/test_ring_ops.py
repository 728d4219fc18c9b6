"""The ring's transfers as the timeline sees them (``fetch_ops``), on a ring of 4 where the
next and the previous rank differ: a pass ring sends to ring rank r + 1 and receives from
r - 1; a pull ring gets ring rank r + i's block."""
from __future__ import annotations

from xfuser_swiftfusion.strategies.ops import Program, Transfer
from xfuser_swiftfusion.strategies.ring import PassRing, PullRing


def transfers(prog: Program) -> list[Transfer]:
    return [op for op in prog.ops if isinstance(op, Transfer)]


def test_pass_ring_sends_to_the_next_and_receives_from_the_previous():
    ranks = (10, 11, 12, 13)
    prog = Program(11)
    PassRing.fetch_ops(prog, ranks, 1, 1, (100, 200))
    (t,) = transfers(prog)
    assert (t.kind, t.queue) == ("exchange", "ring")
    assert t.sends == ((12, 100), (12, 200)) and t.recvs == ((10, 100), (10, 200))


def test_pull_ring_gets_ring_rank_r_plus_i():
    ranks = (10, 11, 12, 13)
    prog = Program(11)
    PullRing.fetch_ops(prog, ranks, 1, 2, (100, 200))
    assert [(t.kind, t.recvs) for t in transfers(prog)] == [("get", ((13, 100),)), ("get", ((13, 200),))]
