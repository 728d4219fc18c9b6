"""``comm/base.py``'s shared logic without processes: byte counting, the put/get checks and
the barrier kinds, each on a plain object standing for a communicator's state."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xfuser_swiftfusion.comm.base import ByteCounter, OneSided


def test_byte_counter_splits_by_machine_and_resets():
    c = ByteCounter([0, 0, 1], 0)
    c.count(1, 10)
    c.count(2, 5)
    c.count(0, 99)  # to myself: not a transfer
    assert (c.intra_node_bytes, c.inter_node_bytes, c.messages) == (10, 5, 2)
    c.grouped_calls, c.barriers = 3, 4
    c.reset()
    assert (c.intra_node_bytes, c.inter_node_bytes, c.messages, c.grouped_calls, c.barriers) == (0,) * 5


def test_check_transfer_refuses_bad_peers_queues_and_shapes():
    me = SimpleNamespace(world_size=2, node_of=[0, 0], rank=0, _buffers=None)
    x = torch.zeros(4)
    OneSided.check_transfer(me, x, torch.zeros(4), 1, "other")  # same machine: any local tensor
    for args in ((x, torch.zeros(4), 2, "other"), (x, torch.zeros(4), -1, "other"),
                 (x, torch.zeros(5), 1, "other"), (x, torch.zeros(4, dtype=torch.float64), 1, "other"),
                 (x, torch.zeros(4), 1, "no such queue")):
        with pytest.raises(ValueError):
            OneSided.check_transfer(me, *args)


def test_barrier_kinds():
    """``barrier_all`` and ``barrier`` quiet my transfers first, ``sync`` does not."""
    seen = []
    me = SimpleNamespace(prepare_barrier=lambda ranks, *, what, quiet: (lambda: seen.append((ranks, what, quiet))))
    me._barrier = lambda ranks, what, quiet: OneSided._barrier(me, ranks, what, quiet)
    OneSided.barrier_all(me, what="a")
    OneSided.barrier(me, [0, 1], what="b")
    OneSided.sync(me, [1, 0], what="c")
    assert seen == [(None, "a", True), ((0, 1), "b", True), ((1, 0), "c", False)]
    assert OneSided.failed is False  # a new communicator has not failed: close() may synchronize


def bare():
    """The base class's own behaviour: a communicator whose only backend part is ``close``."""
    from dataclasses import dataclass

    from xfuser_swiftfusion.comm.base import Communicator

    @dataclass
    class Bare(Communicator):
        closed: int = 0
        cleaned: int = 0

        def close(self):
            self.closed += 1
            self.stop_watching()

        def _after_capture(self):
            self.cleaned += 1
    return Bare(0, 2, [0, 1], 5.0)


def test_capture_notes_what_is_issued_and_ends_clean():
    c = bare()
    assert not c._capturing and c.counter.grouped_calls == c.counter.barriers == 0
    c.note_captured([1], "put", "outside")  # no capture: nothing kept
    with c.capturing() as issued:
        assert c._capturing
        c.note_captured([1, 0], "put", "a")
        c.note_captured(None, "barrier", "b")
    assert issued == [((1, 0), "put", "a"), (None, "barrier", "b")]
    assert not c._capturing and c._captured is None and c.cleaned == 1


def test_replays_are_watched_and_failures_raised():
    c = bare()
    seen = []
    c._watchdog = SimpleNamespace(watch=lambda done, doing, what: seen.append((done(), doing, what)))
    c.watch(SimpleNamespace(query=lambda: True), "layer 3", "a replay")
    assert seen == [(True, "a replay", "layer 3")]
    d = bare()
    dog = d._replays_watched()  # a backend without a watchdog gets one for replays, once
    assert dog is not None and d._replays_watched() is dog and dog._thread.is_alive()
    with d:
        pass
    assert d.closed == 1 and not dog._thread.is_alive()  # close stops it
    assert d.failure is None
    d.check()
    d._replay_failure = TimeoutError("rank 0: replay past 5 s")
    with pytest.raises(TimeoutError, match="replay past"):
        d.check()


def test_symmetric_buffers_resolve_views():
    from xfuser_swiftfusion.comm.base import SymmetricBuffers
    bufs, x = SymmetricBuffers(), torch.zeros(8)
    bufs.add(x, "entry")
    assert bufs.holds(x[2:6]) and bufs.lookup(x[::2]) == "entry" and bufs.entries() == ["entry"]
    assert not bufs.holds(torch.zeros(8))
    bufs.clear()
    assert not bufs.holds(x) and bufs.entries() == []
    with pytest.raises(ValueError):
        bufs.lookup(x)
