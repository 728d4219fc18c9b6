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
