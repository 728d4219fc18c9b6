"""The in-process two-sided communicator of the tests (``support/inproc_comm.py``) obeys the
rules it stands for: matching in list order per pair and queue, sizes and dtypes checked,
messages landing between both posts and the first wait, waits that end with an error naming
rank, peers and stage."""
from __future__ import annotations

import pytest
import torch

from xfuser_swiftfusion.comm.errors import CommTimeout
from support.inproc_comm import Fabric


def test_messages_match_in_list_order_per_pair_and_queue():
    f = Fabric(2, [0, 1])

    def main(x):
        c = f.comm(x)
        if x == 0:  # two exchanges on "other", one on "ring", posted before the peer's
            h = [c.exchange([(torch.full((2,), 1.0), 1), (torch.full((3,), 2.0), 1)], [], what="a"),
                 c.exchange([(torch.full((2,), 3.0), 1)], [], what="b", queue="ring")]
            for x_ in h:
                x_.wait()
            return c.counter
        bufs = [torch.zeros(2), torch.zeros(3), torch.zeros(2)]
        c.exchange([], [(bufs[2], 0)], what="c", queue="ring").wait()
        c.exchange([], [(bufs[0], 0), (bufs[1], 0)], what="d").wait()
        return bufs

    counter, bufs = f.run(main)
    assert [b.tolist() for b in bufs] == [[1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0]]
    assert (counter.inter_node_bytes, counter.messages, counter.grouped_calls) == (28, 3, 2)


@pytest.mark.parametrize("land", ["wait", "post"])
def test_a_message_lands_between_both_posts_and_the_first_wait(land):
    f = Fabric(2, land=land)
    seen = {}

    def main(x):
        c = f.comm(x)
        src, dst = torch.full((2,), float(x)), torch.full((2,), -1.0)
        h = c.exchange([(src, 1 - x)], [(dst, 1 - x)], what="w")
        sync = lambda: c.exchange([(torch.zeros(1), 1 - x)], [(torch.zeros(1), 1 - x)],  # noqa: E731
                                  what="sync").wait()
        sync()
        if x == 1:  # both posted, neither waited: landed with "post", not yet with "wait"
            seen[x] = dst.clone()
        sync()
        h.wait()
        return dst

    outs = f.run(main)
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [0.0, 0.0]]
    assert seen[1].tolist() == ([0.0, 0.0] if land == "post" else [-1.0, -1.0])


def test_sizes_and_dtypes_must_match():
    for recv in (torch.zeros(3), torch.zeros(2, dtype=torch.float64)):
        f = Fabric(2)

        def main(x, recv=recv):
            c = f.comm(x)
            if x == 0:
                c.exchange([(torch.zeros(2), 1)], [], what="Pull-Q stage 2").wait()
            else:
                c.exchange([], [(recv, 0)], what="Pull-Q stage 2").wait()

        with pytest.raises(ValueError, match=r"rank 1: 'Pull-Q stage 2'.* from rank 0"):
            f.run(main)


def test_a_wait_that_can_never_complete_names_rank_peers_and_stage():
    f = Fabric(3)

    def main(x):
        c = f.comm(x)
        if x == 2:
            c.exchange([], [(torch.zeros(1), 0)], what="Push-O to machine 1", queue="ring").wait()

    with pytest.raises(CommTimeout, match=r"rank 2: 'Push-O to machine 1': exchange with peers \[0\] "
                                          r"on queue 'ring'"):
        f.run(main)


def test_copies_to_myself_and_bad_calls():
    c = Fabric(2).comm(0)
    a, b = torch.arange(3.0), torch.zeros(3)
    c.exchange([(a, 0)], [(b, 0)], what="self").wait()
    assert b.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="1 sends to myself but 0 receives"):
        c.exchange([(a, 0)], [], what="self")
    with pytest.raises(ValueError, match="queue"):
        c.exchange([], [], what="x", queue="side")
    with pytest.raises(ValueError, match="invalid exchange peer 2"):
        c.exchange([(a, 2)], [], what="x")
