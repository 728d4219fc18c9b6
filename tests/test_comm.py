"""Communicator backends on an emulated 2x2 cluster (ranks 0,1 on machine 0; 2,3 on machine 1).

Every value a rank checks is recomputed independently from the ranks involved, never read
back from the sender.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from xfuser_swiftfusion.comm import (CommTimeout, PeerFailure, make_one_sided, make_two_sided)
from xfuser_swiftfusion.comm import nvshmem as nv
from xfuser_swiftfusion.emulation.launcher import EmulationError, run_emulated
from xfuser_swiftfusion.topology import TOPOLOGY_ENV, Topology

TOPO = "2x2"
W = 4
NODE_OF = [0, 0, 1, 1]


def _node_of() -> list[int]:
    topo = Topology.parse(os.environ[TOPOLOGY_ENV])
    return [topo.node_of(r) for r in range(topo.world_size)]


def _one_sided(timeout_s: float = 20.0):
    return make_one_sided("shm", rank=dist.get_rank(), world_size=dist.get_world_size(),
                          node_of=_node_of(), timeout_s=timeout_s)


def _two_sided(timeout_s: float = 20.0):
    return make_two_sided(rank=dist.get_rank(), world_size=dist.get_world_size(),
                          node_of=_node_of(), timeout_s=timeout_s)


def _our_shm_files(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def _pattern(shape: tuple[int, ...], src: int, dst: int, salt: int = 0) -> torch.Tensor:
    """The values rank ``src`` sends to rank ``dst``; any rank can recompute them."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000 * src + 100 * dst + 10000 * salt).view(shape)


def _intra_inter(me: int, transfers: list[tuple[int, int]]) -> tuple[int, int]:
    """Expected (intra, inter) bytes for ``(peer, nbytes)`` transfers of rank ``me``."""
    intra = sum(n for p, n in transfers if p != me and NODE_OF[p] == NODE_OF[me])
    inter = sum(n for p, n in transfers if NODE_OF[p] != NODE_OF[me])
    return intra, inter


# -- shm: put/get placement, queues, ordering, counters -------------------------------------

def _shm_put_get() -> dict:
    me = dist.get_rank()
    with _one_sided() as comm:
        buf = comm.symmetric_empty((W, 4, 6), torch.float64)
        src = comm.symmetric_empty((5, 4), torch.float64)
        loc = comm.symmetric_empty((3, 6), torch.float64)  # local sides (symmetric: across machines)
        buf.fill_(-1)
        src.copy_(_pattern((5, 4), me, me))
        comm.barrier_all(what="init")
        left_after_alloc = _our_shm_files(comm.prefix)
        a, b = (me + 1) % W, (me + 2) % W
        loc[0].copy_(_pattern((6,), me, a))
        loc[1].copy_(_pattern((6,), me, b))
        # non-contiguous slice on "other", contiguous row on "ring"
        h1 = comm.put(buf[me, 1:3, ::2], loc[0].view(2, 3), a, queue="other", what="put-a")
        h2 = comm.put(buf[me, 0], loc[1], b, queue="ring", what="put-b")
        # get a strided block of peer c's src (any machine) into a symmetric local view, and of
        # my machine-mate m's src into a transposed plain tensor (allowed within a machine)
        c, m = (me + 3) % W, me ^ 1
        h3 = comm.get(loc[2].view(3, 2), src[::2, 1:3], c, queue="other", what="get-c")
        local = torch.zeros(2, 3, dtype=torch.float64).t()
        h4 = comm.get(local, src[::2, 1:3], m, queue="other", what="get-m")
        for h in (h1, h2, h3, h4):
            h.wait()
        got_ok = (torch.equal(loc[2].view(3, 2), _pattern((5, 4), c, c)[::2, 1:3])
                  and torch.equal(local, _pattern((5, 4), m, m)[::2, 1:3]))
        comm.barrier_all(what="after puts")
        expected = torch.full((W, 4, 6), -1.0, dtype=torch.float64)
        for s in range(W):
            if (s + 1) % W == me:
                expected[s, 1:3, ::2] = _pattern((2, 3), s, me)
            if (s + 2) % W == me:
                expected[s, 0] = _pattern((6,), s, me)
        buf_ok = torch.equal(buf, expected)
        comm.barrier_all(what="checked")  # nobody writes into buf before everyone checked
        counts = (comm.counter.intra_node_bytes, comm.counter.inter_node_bytes, comm.counter.messages)
        exp_counts = (*_intra_inter(me, [(a, 6 * 8), (b, 6 * 8), (c, 6 * 8), (m, 6 * 8)]), 4)
        # FIFO per queue: a large put then a tiny get of its last element from the same peer
        # location on one queue, nothing waited in between: every get sees its own put.
        big = comm.symmetric_empty((W, 2, 1 << 19), torch.float64)  # one slot per queue
        vals = comm.symmetric_empty((6, 1 << 19), torch.float64)
        outs = comm.symmetric_empty((6, 1), torch.float64)
        comm.barrier_all(what="big")
        handles = []
        for i, (k, queue) in enumerate([(0, "ring"), (1, "other")] * 3):
            vals[i].fill_(float(i * 10 + me))
            handles.append(comm.put(big[me, k], vals[i], a, queue=queue, what="fifo put"))
            handles.append(comm.get(outs[i], big[me, k, -1:], a, queue=queue, what="fifo get"))
        for h in handles:
            h.wait()
        fifo_ok = outs[:, 0].tolist() == [float(i * 10 + me) for i in range(6)]
        heap = comm.symmetric_heap_bytes()
        comm.barrier_all(what="done")  # nobody closes while a peer still transfers to it
        return {"buf_ok": buf_ok, "get_ok": got_ok, "counts": counts,
                "exp_counts": exp_counts, "fifo_ok": fifo_ok, "heap": heap,
                "left_after_alloc": left_after_alloc, "prefix": comm.prefix}


def test_shm_put_get_slices_queues_fifo_and_counters():
    before = set(os.listdir("/dev/shm"))
    results = run_emulated(_shm_put_get, TOPO, timeout_s=60)
    for r, res in enumerate(results):
        assert res["buf_ok"], f"rank {r}: puts landed in the wrong place"
        assert res["get_ok"], f"rank {r}: get returned wrong data"
        assert res["fifo_ok"], f"rank {r}: queue is not FIFO"
        assert res["counts"] == res["exp_counts"], r
        assert res["heap"] == (W * 4 * 6 + 5 * 4 + 3 * 6 + W * 2 * (1 << 19) + 6 * (1 << 19) + 6) * 8
        assert res["left_after_alloc"] == []
    assert {res["prefix"] for res in results} == {results[0]["prefix"]}
    # rank 0: a=1 (intra), b=2 (inter), c=3 (inter), m=1; rank 1: a=2, b=3, c=0 (intra), m=0
    assert results[0]["counts"][:2] == (96, 96) and results[1]["counts"][:2] == (96, 96)
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith(results[0]["prefix"])]


def _outcomes(*calls) -> list[str]:
    """Per call: "accepted", or the message of the ValueError it raised."""
    out = []
    for call in calls:
        try:
            call()
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    return out


def _shm_invalid() -> list[str]:
    errors = []
    with _one_sided() as comm:
        buf = comm.symmetric_empty((4, 4), torch.float32)
        plain = torch.zeros(4, 4)
        errors += _outcomes(lambda: comm.put(plain[0], buf[0], 1, queue="other", what="x"),  # not symmetric
                            lambda: comm.put(buf[0], torch.zeros(3), 1, queue="other", what="x"),
                            lambda: comm.put(buf[0], buf[1], 1, queue="nope", what="x"),
                            lambda: comm.get(buf[0], buf[1], W, queue="ring", what="x"),
                            lambda: comm.barrier((5, 6), what="x"))
        comm.barrier_all(what="end")
    try:
        comm.put(buf[0], buf[1], 1, queue="other", what="late")
        errors.append("accepted after close")
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_copy_queue_keeps_two_requests_in_flight_and_completes_in_order():
    """Proxy requests of one kind overlap (the second is sent before the first's reply is
    received), never more than two; a local copy or a request of the other kind waits for
    those in flight; completion (``done``) stays in submission order, also after a failure."""
    from xfuser_swiftfusion.emulation.shm import _IN_FLIGHT, _CopyQueue

    assert _IN_FLIGHT == 2
    log: list[str] = []
    gate = {i: threading.Event() for i in range(7)}

    def request(i: int, fail: bool = False):
        def send():
            log.append(f"send {i}")
            if fail:
                raise ConnectionError(f"request {i} could not be sent")

            def finish():
                assert gate[i].wait(5.0), f"reply {i} never released"
                log.append(f"reply {i}")
            return finish
        return send

    q = _CopyQueue("test-queue")
    try:
        jobs = [q.submit(request(0), "get"), q.submit(request(1), "get"), q.submit(request(2), "get"),
                q.submit(lambda: log.append("local 3")), q.submit(request(4), "put"),
                q.submit(request(5), "get"), q.submit(request(6, fail=True), "get")]
        time.sleep(0.2)
        assert log == ["send 0", "send 1"]  # two in flight, the third waits for a reply
        assert not any(j.done.is_set() for j in jobs)
        gate[1].set()  # a later reply does not complete anything out of order
        time.sleep(0.1)
        assert not jobs[1].done.is_set() and log == ["send 0", "send 1"]
        gate[0].set()
        assert jobs[1].done.wait(5.0) and jobs[0].done.is_set()
        time.sleep(0.1)
        assert log[2:] == ["reply 0", "send 2", "reply 1"]
        assert not jobs[3].done.is_set()  # the local copy waits for request 2
        gate[2].set()
        assert jobs[3].done.wait(5.0)
        time.sleep(0.1)
        assert log[5:] == ["reply 2", "local 3", "send 4"]  # the put is not sent beside a get
        gate[4].set()
        time.sleep(0.1)
        assert log[8:] == ["reply 4", "send 5", "send 6"]
        assert not jobs[6].done.is_set()  # the failed send completes after get 5
        gate[5].set()
        assert jobs[6].done.wait(5.0) and jobs[5].done.is_set() and jobs[5].error is None
        assert isinstance(jobs[6].error, ConnectionError) and q.error is jobs[6].error
        assert [j.done.is_set() for j in jobs] == [True] * 7
    finally:
        for g in gate.values():
            g.set()
        q.stop()


def test_shm_rejects_invalid_transfers():
    errors = run_emulated(_shm_invalid, "1x2", timeout_s=60)[0]
    assert "symmetric_empty" in errors[0]
    assert "shape" in errors[1]
    assert "queue" in errors[2]
    assert "peer 4" in errors[3]
    assert "not in barrier group" in errors[4]
    assert "closed" in errors[5]


def _shm_inter_machine_local_side() -> list[str]:
    """2x1: the peer is on the other machine, so the local side must be a contiguous
    symmetric view (NVSHMEM over InfiniBand/EFA needs it registered)."""
    with _one_sided() as comm:
        buf = comm.symmetric_empty((4, 4), torch.float32)
        peer = 1 - dist.get_rank()
        out = _outcomes(lambda: comm.put(buf[0], torch.zeros(4), peer, queue="other", what="x"),
                        lambda: comm.get(torch.zeros(4), buf[0], peer, queue="other", what="x"),
                        lambda: comm.get(buf[:, 1], buf[0], peer, queue="other", what="x"),
                        lambda: comm.get(buf[1], buf[0], peer, queue="other", what="x").wait())
        comm.barrier_all(what="end")
    return out


def test_shm_inter_machine_transfers_need_a_symmetric_local_side():
    for errors in run_emulated(_shm_inter_machine_local_side, "2x1", timeout_s=60):
        assert all("another machine" in e and "symmetric" in e for e in errors[:3]), errors
        assert errors[3] == "accepted"


# -- shm: barriers -------------------------------------------------------------------------

def _shm_group_barrier() -> dict:
    me = dist.get_rank()
    group = (0, 1) if me < 2 else (2, 3)
    partner = group[1] if me == group[0] else group[0]
    with _one_sided() as comm:
        buf = comm.symmetric_empty((64,), torch.float64)
        ok = True
        for it in range(30):
            comm.put(buf, _pattern((64,), me, partner, it), partner, queue="ring", what="ring step")
            comm.barrier(group, what=f"ring barrier {it}")  # quiets the put, then syncs
            ok &= torch.equal(buf, _pattern((64,), partner, me, it))
            comm.barrier(group, what=f"ring reuse {it}")  # partner read before I overwrite
        # a barrier must block: rank 1 and 3 arrive 0.5 s late
        if me % 2:
            time.sleep(0.5)
        t0 = time.monotonic()
        comm.barrier_all(what="late arrival")
        waited = time.monotonic() - t0
    return {"ok": ok, "waited": waited}


def _shm_sync_does_not_quiet() -> dict:
    me = dist.get_rank()
    group = (0, 1) if me < 2 else (2, 3)
    with _one_sided() as comm:
        busy = comm._queues["other"].submit(lambda: time.sleep(1.0))  # a slow transfer in flight
        if me in (1, 3):
            time.sleep(0.3)  # sync still waits for a late partner
        t0 = time.monotonic()
        comm.sync(group, what="sync")
        synced, in_flight = time.monotonic() - t0, not busy.done.is_set()
        comm.barrier(group, what="barrier")  # quiets: waits for the slow transfer
        drained = busy.done.is_set()
        comm.barrier_all(what="end")
    return {"synced": synced, "in_flight": in_flight, "drained": drained}


def test_shm_sync_blocks_for_peers_but_leaves_transfers_in_flight():
    res = run_emulated(_shm_sync_does_not_quiet, TOPO, timeout_s=60)
    assert all(r["in_flight"] and r["drained"] for r in res), res
    assert res[0]["synced"] > 0.2 and res[2]["synced"] > 0.2, res


def test_shm_group_barrier_makes_puts_visible_and_blocks():
    res = run_emulated(_shm_group_barrier, TOPO, timeout_s=60)
    assert all(r["ok"] for r in res)
    assert res[0]["waited"] > 0.35 and res[2]["waited"] > 0.35


def _shm_skip_barrier() -> str:
    me = dist.get_rank()
    comm = _one_sided(timeout_s=0.5)
    comm.barrier_all(what="warm-up")
    if me == 3:
        time.sleep(2.5)  # alive but never arrives (others time out after 0.5 s)
        return "skipped"
    try:
        comm.barrier_all(what="Pull-KV stage 2")
    except CommTimeout as exc:
        # stay open a while: a rank that enters the barrier later (a loaded host) times out
        # on its own instead of seeing this one close first (a PeerFailure, also right)
        time.sleep(1.5)
        return str(exc)
    return "no timeout"


def test_shm_barrier_timeout_names_stage_and_missing_rank():
    res = run_emulated(_shm_skip_barrier, TOPO, timeout_s=60)
    for r in range(3):
        assert f"rank {r}" in res[r] and "Pull-KV stage 2" in res[r]
        assert "did not arrive: [3]" in res[r], res[r]


def _shm_peer_failure(mode: str, prefix_file: str) -> None:
    me = dist.get_rank()
    comm = _one_sided(timeout_s=20.0)
    buf = comm.symmetric_empty((1024,), torch.float32)
    comm.barrier_all(what="layer 0")
    if me == 0:
        with open(prefix_file, "w") as f:
            f.write(comm.prefix)
    if me == 2:
        comm.put(buf, torch.ones(1024), 1, queue="other", what="Push-O").wait()
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise ValueError("rank 2 broke mid-layer")
        comm.close()
        time.sleep(1.0)  # alive, but closed
        return
    t0 = time.monotonic()
    try:
        comm.barrier_all(what="layer 1 Push-O")
    except PeerFailure as exc:
        raise RuntimeError(f"detected after {time.monotonic() - t0:.2f} s: {exc}") from exc


@pytest.mark.parametrize("mode", ["kill", "raise", "close"])
def test_shm_dead_peer_fails_others_fast_and_leaves_no_files(mode, tmp_path):
    prefix_file = str(tmp_path / "prefix")
    with pytest.raises(EmulationError) as info:
        run_emulated(_shm_peer_failure, TOPO, mode, prefix_file, timeout_s=60)
    text = str(info.value)
    for r in (0, 1, 3):
        block = text.split(f"--- rank {r}:")[1].split("--- rank")[0]
        assert "PeerFailure" in block and "peer rank 2" in block and "layer 1 Push-O" in block, block
        assert float(re.search(r"detected after ([\d.]+) s", block).group(1)) < 5.0
    prefix = (tmp_path / "prefix").read_text()
    assert prefix.startswith("sf-") and _our_shm_files(prefix) == []


# -- p2p -----------------------------------------------------------------------------------

def _p2p() -> dict:
    me = dist.get_rank()
    comm = _two_sided()
    nxt, prv, opp = (me + 1) % W, (me - 1) % W, (me + 2) % W
    recv_prev = torch.zeros(3, 4, dtype=torch.float64).t()  # non-contiguous target
    recv_opp = [torch.zeros(5, dtype=torch.float64) for _ in range(2)]
    h = comm.exchange(
        [(_pattern((4, 3), me, nxt), nxt), (_pattern((5,), me, opp, 0), opp),
         (_pattern((5,), me, opp, 1), opp)],
        [(recv_prev, prv), (recv_opp[0], opp), (recv_opp[1], opp)], what="exchange")
    h.wait()
    ok = torch.equal(recv_prev, _pattern((4, 3), prv, me)) and all(
        torch.equal(recv_opp[i], _pattern((5,), opp, me, i)) for i in range(2))
    counts = (comm.counter.intra_node_bytes, comm.counter.inter_node_bytes)
    exp = _intra_inter(me, [(nxt, 96), (opp, 40), (opp, 40)])
    # all_to_all over all ranks in a permuted order, and over two disjoint pairs at once
    results = []
    for ranks in ((2, 0, 3, 1), (0, 2) if me % 2 == 0 else (1, 3)):
        inp = torch.cat([_pattern((2, 3), me, dst) for dst in ranks])
        out = torch.empty_like(inp)
        comm.all_to_all(out, inp, ranks, what="a2a")
        results.append(torch.equal(out, torch.cat([_pattern((2, 3), s, me) for s in ranks])))
    comm.close()
    return {"ok": ok, "a2a": results, "counts": counts, "exp": exp}


def test_p2p_exchange_all_to_all_and_counters():
    res = run_emulated(_p2p, TOPO, timeout_s=60)
    for r, x in enumerate(res):
        assert x["ok"] and x["a2a"] == [True, True], r
        assert x["counts"] == x["exp"], r
    # rank 0 sends 96 B to rank 1 (intra), 2 x 40 B to rank 2 (inter); a2a adds 48 B per peer
    assert res[0]["counts"] == (96, 80)


def _p2p_timeout() -> str:
    comm = _two_sided(timeout_s=0.5)
    if dist.get_rank() == 1:
        time.sleep(2.5)
        return "silent"
    try:
        comm.exchange([], [(torch.zeros(4), 1)], what="Pull-Q stage 1").wait()
    except CommTimeout as exc:
        return str(exc)
    return "no timeout"


def test_p2p_timeout_names_stage_and_peer():
    msg = run_emulated(_p2p_timeout, "1x2", timeout_s=60)[0]
    assert "rank 0" in msg and "Pull-Q stage 1" in msg and "[1]" in msg, msg


# -- factories and nvshmem without a GPU ---------------------------------------------------

def _factories() -> list[str]:
    out = [type(make_one_sided(rank=dist.get_rank(), world_size=2, node_of=[0, 0], timeout_s=5)).__name__]
    for kind in ("bogus", "nvshmem"):
        try:
            make_one_sided(kind, rank=dist.get_rank(), world_size=2, node_of=[0, 0], timeout_s=5)
        except (ValueError, RuntimeError) as exc:
            out.append(str(exc))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallbacks")
def test_factories_pick_shm_on_cpu_and_explain_missing_cuda():
    res = run_emulated(_factories, "1x2", timeout_s=60)[0]
    assert res[0] == "ShmCommunicator"
    assert "unknown one-sided communicator 'bogus'" in res[1]
    assert "CUDA" in res[2] and "shm" in res[2]


def test_factories_need_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_two_sided(rank=0, world_size=1, node_of=[0], timeout_s=1)


def _runs_as_elements(view: torch.Tensor) -> list[int]:
    es = view.element_size()
    return [(off // es) + i for off, n in nv.contiguous_runs(view) for i in range(n // es)]


@pytest.mark.parametrize("make", [
    lambda b: b, lambda b: b[1], lambda b: b[:, 1:3], lambda b: b[..., ::2],
    lambda b: b.transpose(0, 1), lambda b: b[1:2, :, 2:3], lambda b: b[:0], lambda b: b[:, 2],
])
def test_contiguous_runs_cover_the_view_in_logical_order(make):
    base = torch.zeros(3, 4, 5, dtype=torch.float16)
    index = torch.arange(base.numel()).view(base.shape)
    view, idx = make(base), make(index)
    expected = [int(i) - view.storage_offset() for i in idx.reshape(-1)]
    assert _runs_as_elements(view) == expected


def test_contiguous_runs_merge_contiguous_dims():
    base = torch.zeros(3, 4, 5)
    assert nv.contiguous_runs(base[1]) == [(0, 80)]
    assert nv.contiguous_runs(base[:, 1:3]) == [(0, 40), (80, 40), (160, 40)]


def test_team_split_args():
    assert nv.team_split_args((4, 5, 6, 7)) == (4, 1, 4)
    assert nv.team_split_args((6, 2, 4)) == (2, 2, 3)
    assert nv.team_split_args((3,)) == (3, 1, 1)
    for bad in ((0, 1, 3), (1, 1)):
        with pytest.raises(ValueError, match="strided"):
            nv.team_split_args(bad)


def test_nvshmem_uid_bytes_round_trip():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py not installed")
    core, _ = nv.nvshmem_modules()
    uid = core.get_unique_id()
    raw = nv.uid_to_bytes(uid)
    assert len(raw) == nv.UID_BYTES and any(raw)
    assert nv.uid_from_bytes(raw) == uid
    with pytest.raises(ValueError, match="128"):
        nv.uid_from_bytes(raw[:64])


def _broadcast_uid() -> bytes:
    return nv.uid_to_bytes(nv.broadcast_unique_id(dist.get_rank()))


def test_nvshmem_unique_id_broadcast_over_gloo():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py not installed")
    a, b = run_emulated(_broadcast_uid, "1x2", timeout_s=60)
    assert a == b and len(a) == nv.UID_BYTES and any(a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nvshmem_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CUDA"):
        nv.NvshmemCommunicator(0, 1, [0], 1.0)


def test_process_alive_sees_exited_and_zombie_processes():
    from xfuser_swiftfusion.emulation.procs import process_alive as _process_alive

    assert _process_alive(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 5
    while _process_alive(pid) and time.monotonic() < deadline:  # a zombie until reaped
        time.sleep(0.01)
    assert not _process_alive(pid)
    os.waitpid(pid, 0)
    assert not _process_alive(pid)


_EXIT_SCRIPT = """
import atexit, glob, sys, tempfile
def gloo_threads():
    return sum("gloo" in open(f).read() for f in glob.glob("/proc/self/task/*/comm"))
# registered before p2p's own handler, so it runs after it (atexit runs last-in first-out)
atexit.register(lambda: print("at exit:", gloo_threads(), flush=True))
import torch.distributed as dist
from xfuser_swiftfusion.comm import p2p
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
p2p.queue_groups()
dist.destroy_process_group()
print("after destroy:", gloo_threads(), flush=True)
"""


def test_queue_groups_free_their_threads_before_interpreter_teardown():
    """``destroy_process_group`` leaves the groups the two-sided queues hold alive (their gloo
    threads run on); at exit they are released before the interpreter tears down, where a
    gloo group freed late can abort the rank ("terminate called without an active
    exception", seen as a failed torchrun job after a passing check)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    after = int(re.search(r"after destroy: (\d+)", res.stdout).group(1))
    at_exit = int(re.search(r"at exit: (\d+)", res.stdout).group(1))
    assert after > 0 and at_exit == 0, res.stdout


# -- on NCCL no wait blocks the host; the watchdog bounds them ---------------------------------

class _NcclWork:
    """A ``ProcessGroupNCCL`` work: ``wait(timeout=...)`` would block the host thread until the
    work completes (``WorkNCCL::wait``), so it fails here; ``wait()`` orders the stream."""

    def __init__(self, done: bool) -> None:
        self.done, self.stream_waits = done, 0

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            raise AssertionError("a host-blocking wait on an NCCL work (a timeout was given)")
        self.stream_waits += 1
        return True

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture
def fake_nccl(monkeypatch):
    """A one-rank gloo group that calls itself NCCL, with CUDA streams faked and every posted
    batch a ``_NcclWork`` (never completing when ``state["hang"]``)."""
    import contextlib
    from xfuser_swiftfusion.comm import p2p
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = {"hang": False, "works": []}

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(p2p, "_nccl_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(p2p, "queue_groups", lambda: {"ring": None, "other": None})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)

    def post(ops):
        works = [_NcclWork(not state["hang"])]
        state["works"] += works
        return works

    monkeypatch.setattr(dist, "batch_isend_irecv", post)
    yield state
    if created:
        dist.destroy_process_group()


def test_nccl_waits_order_streams_and_never_block_the_host(fake_nccl):
    """pytorch's WorkNCCL::wait blocks the host whenever a timeout is given: the two-sided
    communicator's waits give none on NCCL (the torus overlap would be lost), and a batch that
    never completes fails the communicator through the watchdog, naming rank, peers and stage."""
    from xfuser_swiftfusion.comm.p2p import P2PCommunicator
    comm = P2PCommunicator(0, 2, [0, 1], 0.3)
    comm.abort_after_s = 60.0
    try:
        a, b = torch.zeros(4), torch.zeros(4)
        h = comm.exchange([(a, 1)], [(b, 1)], what="Pull-KV stage 1", queue="other")
        t0 = time.monotonic()
        h.wait()
        assert time.monotonic() - t0 < 0.1 and fake_nccl["works"][0].stream_waits == 1
        fake_nccl["hang"] = True
        comm.exchange([(a, 1)], [(b, 1)], what="Pull-KV stage 2", queue="other").wait()  # returns
        deadline = time.monotonic() + 5
        while comm._failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(CommTimeout, match=r"rank 0: 'Pull-KV stage 2': exchange with peers \[1\].*0\.3 s"):
            comm.exchange([(a, 1)], [(b, 1)], what="Push-O", queue="other")
    finally:
        comm.close()
