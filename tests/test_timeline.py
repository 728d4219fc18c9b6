"""The timeline (``timeline.simulate``) on hand-written programs, against times worked out by
hand from the profile's rates: latency + bytes / bandwidth, links shared by the transfers in
flight, FIFO queues, rendezvous, barriers, host cost, the host waiting or not, and compute
sharing a host's cores with the CPU cost of transfers."""
from __future__ import annotations

import dataclasses
import math

import pytest

from xfuser_swiftfusion.hardware import HardwareProfile, Rate
from xfuser_swiftfusion.strategies.ops import Attend, Barrier, Copy, Transfer, Wait
from xfuser_swiftfusion.timeline import simulate
from xfuser_swiftfusion.topology import Topology

MB = 1_000_000
LAT = 1e-3


def profile(**kw) -> HardwareProfile:
    """1 MB/s links per machine, 10 MB/s within a machine, 1 ms latency, 1 GFLOP/s attention,
    no host cost: easy arithmetic."""
    rate = {"intra": Rate(10 * MB, LAT), "inter": Rate(1 * MB, LAT)}
    base = HardwareProfile(
        name="test", transfers={k: rate for k in ("exchange", "all_to_all", "all_gather", "get", "put")},
        attention={"bf16": {64: ((1024, 1024, 1e9),)}}, attention_bh=1, barrier_s=0.01, sync_s=0.005,
        attend_call_s=0.0, transfer_call_s=0.0, merge_s_per_elem=0.0, copy_bw=1e9,
        host_waits=True, two_sided_fifo=False)
    return dataclasses.replace(base, **kw)


def run(programs, topo="2x1", **kw):
    return simulate(programs, Topology.parse(topo), profile(**kw), "bf16", 64).finish_s


def exchange(h, peer, n, queue="other"):
    return Transfer(h, "exchange", queue, ((peer, n),), ((peer, n),))


def test_one_message_latency_plus_bytes_over_bandwidth():
    prog = [[exchange("a", 1, MB), Wait(("a",))], [exchange("a", 0, MB), Wait(("a",))]]
    assert run(prog) == pytest.approx([LAT + 1.0] * 2)
    intra = run(prog, "1x2")
    assert intra == pytest.approx([LAT + 0.1] * 2)


def test_rendezvous_waits_for_the_later_side():
    """A two-sided message starts once both ends posted it."""
    late = [Copy(int(0.5e9)), exchange("a", 0, MB), Wait(("a",))]   # 0.5 s of copying first
    assert run([[exchange("a", 1, MB), Wait(("a",))], late]) == pytest.approx([0.5 + LAT + 1.0] * 2)


def test_machines_share_their_link():
    """Two ranks of machine 0 send 1 MB each to machine 1 at once: its 1 MB/s uplink takes 2 s."""
    to = lambda p: [Transfer("a", "put", "other", ((p, MB),)), Wait(("a",))]  # noqa: E731
    done = run([to(2), to(3), [], []], "2x2")
    assert done[:2] == pytest.approx([LAT + 2.0] * 2)
    # one GPU's NIC share caps it alone too
    assert run([to(2), [], [], []], "2x2", inter_gpu_bw=0.5 * MB)[0] == pytest.approx(LAT + 2.0)


def test_two_sided_fifo_per_peer_or_per_queue():
    """gloo (two_sided_fifo=False): two exchanges with one peer run one after the other, with
    two peers at once (sharing the link); NCCL (True): one after the other on one queue.
    Rank 0 waits for the first, then copies for 2 s."""
    then = [Wait(("a",)), Copy(int(2e9))]
    same = [[exchange("a", 1, MB), exchange("b", 1, MB), *then],
            [exchange("a", 0, MB), exchange("b", 0, MB), Wait(("a", "b"))]]
    assert run(same)[0] == pytest.approx(LAT + 1.0 + 2.0)
    two = [[exchange("a", 1, MB), exchange("b", 2, MB), *then],
           [exchange("a", 0, MB), Wait(("a",))], [exchange("b", 0, MB), Wait(("b",))]]
    assert run(two, "3x1")[0] == pytest.approx(LAT + 2.0 + 2.0)  # sharing rank 0's link
    fifo = run(two, "3x1", two_sided_fifo=True)
    assert fifo[0] == pytest.approx(LAT + 1.0 + 2.0) and fifo[2] == pytest.approx(2 * (LAT + 1.0))


def test_one_sided_queue_is_fifo_and_needs_no_peer():
    """Two gets on one queue: the first lands after one transfer time (then rank 0 copies for
    2 s), the second after two; the peer, busy for 5 s, takes no part."""
    gets = [Transfer("a", "get", "other", (), ((1, MB),)), Transfer("b", "get", "other", (), ((1, MB),)),
            Wait(("a",)), Copy(int(2e9))]
    assert run([gets, [Copy(int(5e9))]]) == pytest.approx([LAT + 1.0 + 2.0, 5.0])
    assert run([gets[:2] + [Wait(("b",))], []])[0] == pytest.approx(2 * (LAT + 1.0))


def test_barrier_ends_after_the_last_arrival():
    prog = [[Copy(int(1e9)), Barrier((0, 1))], [Barrier((0, 1))]]
    assert run(prog) == pytest.approx([1.0 + 0.01] * 2)
    sync = [[Copy(int(1e9)), Barrier((0, 1), quiet=False)], [Barrier((0, 1), quiet=False)]]
    assert run(sync) == pytest.approx([1.0 + 0.005] * 2)
    # a quiet barrier completes my transfers first, a sync does not
    put = Transfer("a", "put", "other", ((1, MB),))
    assert run([[put, Barrier((0, 1))], [Barrier((0, 1))]])[0] == pytest.approx(LAT + 1.0 + 0.01)
    assert run([[put, Barrier((0, 1), quiet=False)], [Barrier((0, 1), quiet=False)]])[0] == \
        pytest.approx(LAT + 1.0)  # the rank finishes when its transfer does


def test_attend_time_and_host_cost_sync_or_async():
    """1024 x 1024 x D64 x 4 rows of heads = 1.07 GFLOP: 1.07 s; a host cost of 0.5 s per call
    adds up on a CPU (the host waits) but hides behind the device on a GPU."""
    call = Attend((1024,), (1024,), 4)
    secs = 4 * 4 * 1024 * 1024 * 64 / 1e9
    assert run([[call], []])[0] == pytest.approx(secs)
    assert run([[call, call], []], attend_call_s=0.5)[0] == pytest.approx(2 * (secs + 0.5))
    assert run([[call, call], []], attend_call_s=0.5, host_waits=False)[0] == \
        pytest.approx(0.5 + 2 * secs)


def test_compute_and_transfer_cpu_share_the_host():
    """On a shared host of 1 core, 2 ranks computing 1 s each take 2 s; a transfer whose CPU
    cost is 2 % of the link's time runs at full link speed and slows compute by that 2 %."""
    cpu = int(1e9)  # one second of copying at 1 GB/s
    assert run([[Copy(cpu)], [Copy(cpu)]], host_cores=1.0) == pytest.approx([2.0, 2.0])
    # 4 ranks on 2 cores: half a core each; 2 ranks on 2 cores: one each (no more)
    assert run([[Copy(cpu)]] * 4, "4x1", host_cores=2.0) == pytest.approx([2.0] * 4)
    assert run([[Copy(cpu)]] * 2, host_cores=2.0) == pytest.approx([1.0] * 2)
    rate = {"intra": Rate(10 * MB, 0.0), "inter": Rate(1 * MB, 0.0, cpu_s_per_byte=0.02 / MB)}
    rates = {k: rate for k in ("exchange", "all_to_all", "all_gather", "get", "put")}
    prog = [[Transfer("a", "put", "other", ((1, MB),)), Copy(cpu), Wait(("a",))], []]
    done = run(prog, host_cores=1.0, transfers=rates)[0]
    assert done == pytest.approx(1.02, rel=1e-6)   # compute at 98 % while the 1 s put runs


def test_mismatched_messages_are_an_error():
    with pytest.raises(ValueError, match="sends 1 messages"):
        run([[exchange("a", 1, MB), Wait(("a",))], []])


def test_every_rank_finishes():
    done = run([[Copy(1)], [Copy(2)]])
    assert all(math.isfinite(x) for x in done)


def test_folded_machines_predict_what_every_rank_predicts(monkeypatch):
    """Where the timeline repeats every k machines only k are simulated: the same latency as
    simulating every rank (GPU and shared-host profiles); an asymmetric mesh is not folded."""
    from xfuser_swiftfusion import timeline
    from xfuser_swiftfusion.cost_model import GPU_PROFILES, Workload, predict, programs
    from xfuser_swiftfusion.mesh import choose_mesh
    from xfuser_swiftfusion.strategies import get
    shared = dataclasses.replace(profile(), host_cores=2.0)
    cases = [("4x2", 12, s, None, 1) for s in ("tas", "torus", "swiftfusion")] + [
        ("4x2", 12, "usp", None, 2), ("3x2", 12, "usp", 2, 1), ("3x2", 12, "tas", 2, 3), ("2x4", 8, "swiftfusion", None, 1)]
    for topo_s, H, s, deg, period in cases:
        topo = Topology.parse(topo_s)
        w = Workload(1, 512 * topo.world_size, H, 64)
        mesh = choose_mesh(topo, H, get(s).placement, deg)
        assert timeline.machine_period(programs(get(s), mesh, w), topo) == period, (topo_s, s)
        for prof in (GPU_PROFILES["p4de"], shared):
            folded = predict(s, topo, w, prof, deg).latency_s
            with monkeypatch.context() as m:
                m.setattr(timeline, "machine_period", lambda programs, topo: topo.nodes)
                assert predict(s, topo, w, prof, deg).latency_s == pytest.approx(folded, rel=1e-12)
    # usp with Ulysses 6 on 3 x 4: groups of 6 contiguous ranks straddle machines unevenly
    topo = Topology(3, 4)
    mesh = choose_mesh(topo, 6, "usp", 6)
    assert timeline.machine_period(programs(get("usp"), mesh, Workload(1, 1200, 6, 64)), topo) == 3


def test_a_collective_to_one_other_machine_takes_the_two_machine_rate():
    """An all-to-all of 3 machines (1 MB to each other machine) at the ``inter`` rate; the same
    bytes within a pair of machines at ``inter1`` (2 MB/s here) where the profile has it."""
    pair = {"intra": Rate(10 * MB, LAT), "inter": Rate(1 * MB, LAT), "inter1": Rate(2 * MB, LAT)}
    fast = dict(transfers={k: pair for k in ("exchange", "all_to_all", "all_gather", "get", "put")})

    def a2a(rank, group):
        peers = tuple((p, MB) for p in group if p != rank)
        return [Transfer("a", "all_to_all", "other", peers, peers), Wait(("a",))]

    three = [a2a(r, (0, 1, 2)) for r in range(3)]
    assert run(three, "3x1", **fast) == pytest.approx([LAT + 2.0] * 3)  # 2 MB up each link at 1 MB/s
    two = [a2a(0, (0, 1)), a2a(1, (0, 1)), []]
    assert run(two, "3x1", **fast)[:2] == pytest.approx([LAT + 0.5] * 2)  # fan-out 1: inter1
    assert run(two, "3x1")[:2] == pytest.approx([LAT + 1.0] * 2)  # no inter1: the inter rate


def test_host_slower_than_the_device_bounds_the_layer():
    """On a GPU (the host runs ahead) each call starts once the host issued it: 2 calls of 3
    query chunks at 0.5 s + 0.25 s per chunk of host each take the host 2.5 s against 2.15 s of
    device work, so the layer ends 1.25 s + 1.07 s after its start when the host issued the
    second call; ``host_s`` says when the host was done."""
    call = Attend((512, 256, 256), (1024,), 4)
    secs = 4 * 4 * 1024 * 1024 * 64 / 1e9
    host = 0.5 + 3 * 0.25
    res = simulate([[call, call], []], Topology.parse("2x1"),
                   profile(attend_call_s=0.5, merge_call_s=0.25, host_waits=False), "bf16", 64)
    assert res.host_s[0] == pytest.approx(2 * host)
    assert res.finish_s[0] == pytest.approx(2 * host + secs)   # the device waited for the host
    fast = simulate([[call, call], []], Topology.parse("2x1"), profile(host_waits=False), "bf16", 64)
    assert fast.host_s[0] == 0.0 and fast.finish_s[0] == pytest.approx(2 * secs)


def test_device_time_per_query_chunk():
    """``chunk_s`` adds device time per query chunk of a call, besides its FLOPs."""
    call = Attend((512, 256, 256), (1024,), 4)
    secs = 4 * 4 * 1024 * 1024 * 64 / 1e9
    assert run([[call], []], chunk_s=0.1)[0] == pytest.approx(secs + 0.3)


@pytest.mark.timeout(60)
def test_a_short_job_late_in_a_long_timeline_ends():
    """A job far shorter than the clock's resolution at its start (a 1-byte put after 10^4 s
    of compute: now + its time == now) ends; it used to leave the timeline spinning."""
    rates = {k: {"intra": Rate(1e18, 0.0), "inter": Rate(1e18, 0.0)}
             for k in ("exchange", "all_to_all", "all_gather", "get", "put")}
    prog = [[Copy(int(1e13)), Transfer("a", "put", "other", ((1, 1),)), Wait(("a",))], []]
    assert run(prog, transfers=rates) == pytest.approx([1e4, 0.0])


def test_one_rank_alone_runs_its_one_sided_program():
    """``simulate_alone``: the GPU suite's replay world, one rank with no peer there: its gets
    and puts run on it alone, its barriers end when it arrives; a two-sided transfer, which
    needs its peer, is refused."""
    from xfuser_swiftfusion.timeline import simulate_alone
    topo = Topology.parse("2x1")
    ops = [Transfer("a", "get", "other", recvs=((1, MB),)), Barrier((0, 1)), Copy(int(1e9))]
    res = simulate_alone(ops, 0, topo, profile(host_waits=False, barrier_s=0.0), "bf16", 64)
    assert res.finish_s == pytest.approx([LAT + 1.0 + 1.0])   # the get, then the copy
    with pytest.raises(ValueError, match="two-sided"):
        simulate_alone([exchange("a", 1, MB), Wait(("a",))], 0, topo, profile(), "bf16", 64)


def test_a_send_completes_when_its_message_arrives():
    """A two-sided send with no receive back: the sender's wait ends when its 1 MB has crossed
    the 1 MB/s link, as the receiver's does."""
    send = [Transfer("a", "exchange", "other", ((1, MB),), ()), Wait(("a",))]
    recv = [Transfer("a", "exchange", "other", (), ((0, MB),)), Wait(("a",))]
    assert run([send, recv]) == pytest.approx([LAT + 1.0] * 2)


def test_compute_seconds_at_the_speed_all_ranks_get():
    """``compute_s``: a rank's copying at 1 GB/s, on a shared host at the share every rank gets
    when all compute (1 core for 2 ranks: half speed; 4 cores for 2: full speed)."""
    prog = [[Copy(int(0.5e9)), Copy(int(0.25e9))], []]
    res = lambda **kw: simulate(prog, Topology.parse("2x1"), profile(**kw), "bf16", 64).compute_s  # noqa: E731
    assert res() == pytest.approx([0.75, 0.0])
    assert res(host_cores=1.0) == pytest.approx([1.5, 0.0])
    assert res(host_cores=4.0) == pytest.approx([0.75, 0.0])


def test_one_core_at_most_per_rank_and_the_host_shared_when_it_runs_ahead():
    """A rank alone on a 2-core host computes at one core's speed (1 s of copying takes 1 s),
    and ranks share the host's cores whether the host waits for the device or not."""
    cpu = int(1e9)
    assert run([[Copy(cpu)], []], host_cores=2.0) == pytest.approx([1.0, 0.0])
    assert run([[Copy(cpu)], [Copy(cpu)]], host_cores=1.0, host_waits=False) == pytest.approx([2.0, 2.0])


def test_a_transfer_with_host_cost_shares_its_link_evenly():
    """Two 1 MB messages share machine 0's 1 MB/s uplink, one of them also costing 0.8 s of the
    2-core host (not a bottleneck): each takes 2 s."""
    plain, costly = Rate(1 * MB, LAT), Rate(1 * MB, LAT, cpu_s_per_byte=0.8 / MB)
    rates = {k: {"intra": plain, "inter": costly if k == "exchange" else plain}
             for k in ("exchange", "all_to_all", "all_gather", "get", "put")}
    prog = [[Transfer("a", "exchange", "other", ((2, MB),), ()), Wait(("a",))],
            [Transfer("a", "put", "other", ((3, MB),)), Wait(("a",))],
            [Transfer("a", "exchange", "other", (), ((0, MB),)), Wait(("a",))], []]
    assert run(prog, "2x2", transfers=rates, host_cores=2.0) == pytest.approx([LAT + 2.0] * 3 + [0.0])


def test_machine_period_needs_every_op_to_match():
    """Rank x + M must run rank x's program shifted by M: a longer program, another op or a
    barrier over other ranks or of the other kind breaks the symmetry (period = N)."""
    from xfuser_swiftfusion.timeline import machine_period
    two = Topology.parse("2x1")
    assert machine_period([[Copy(1)], [Copy(1)]], two) == 1
    assert machine_period([[Barrier((0, 1))], [Barrier((1, 0))]], two) == 1
    assert machine_period([[Copy(1)], [Copy(1), Copy(1)]], two) == 2
    assert machine_period([[Copy(1)], [Copy(2)]], two) == 2
    assert machine_period([[Barrier((0, 1))], [Barrier((1,))]], two) == 2
    assert machine_period([[Barrier((0, 1))], [Barrier((0, 1), quiet=False)]], two) == 2


def test_a_message_alone_on_its_link_is_not_slowed_by_shared_ones():
    """Max-min fairness: ranks 0 and 1 share machine 0's uplink (2 s each), rank 2 has machine
    1's uplink to itself (1 s)."""
    to = lambda p: [Transfer("a", "put", "other", ((p, MB),)), Wait(("a",))]  # noqa: E731
    assert run([to(2), to(3), to(0), []], "2x2") == pytest.approx([LAT + 2.0, LAT + 2.0, LAT + 1.0, 0.0])


def test_the_host_waits_for_its_own_calls_and_the_device():
    """Two puts of 0.5 s of host call each, then a wait for the first: the host is done at
    1.0 s (its second call), not when the first put landed (0.5 s + 1 ms + 0.1 us)."""
    put = lambda h: Transfer(h, "put", "other", ((1, 1),))  # noqa: E731
    res = simulate([[put("a"), put("b"), Wait(("a",))], []], Topology.parse("1x2"),
                   profile(transfer_call_s=0.5), "bf16", 64)
    assert res.host_s[0] == pytest.approx(1.0)


def test_a_message_speeds_up_when_its_link_frees():
    """0.5 MB and 1 MB share machine 0's 1 MB/s uplink: both at half speed until the first
    ends (1 s), then the rest of the second at full speed (0.5 s more)."""
    to = lambda p, n: [Transfer("a", "put", "other", ((p, n),)), Wait(("a",))]  # noqa: E731
    assert run([to(2, MB // 2), to(3, MB), [], []], "2x2") == pytest.approx([LAT + 1.0, LAT + 1.5, 0.0, 0.0])
