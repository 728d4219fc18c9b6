"""Measure the CPU-emulation rates behind the built-in ``cpu-emulated`` profile; write
xfuser_swiftfusion/cpu_profile.json (``hardware.cpu_profile`` converts it per world size and link).

For one emulated cluster, ``swiftfusion calibrate --emulate NxM --link-mbit R`` measures every
rate the cost model uses on that topology (per transfer kind, per core, the attention calls
the schedules launch) into a profile file: the one to use for predictions there
(docs/cost-model.md).

Every quantity is measured with all W forked ranks doing the same thing at once (they share
the host's cores, as in a benchmark), medians of ``--reps`` repetitions, for W in ``--worlds``:

- ``attn_flops[dtype]``: ``kernels.attend`` on [1, 16, 1024, 128] Q/K/V, 4*B*h*Lq*Lk*D / time;
  ``head_dim_efficiency[D]``: bf16 throughput at D relative to D=128 (same Lq*Lk);
  ``query_len_efficiency[Lq]``: bf16 throughput at Lq (1024 keys, D=128) relative to Lq=1024
  (torch's CPU kernel tiles short query blocks by 64 rows: Torus stages run such calls);
  ``key_len_efficiency[Lk]``: bf16 throughput at Lk (Lq=1024, D=64) relative to Lk=1024
  (longer calls run faster: at L = 16384 the layer's calls have 4096-16384 keys);
- ``attend_overhead_s``, ``merge_s_per_elem``: attend against 16 keys at Lq=64 and Lq=4096
  (fit: overhead + merge * B*h*Lq*D);
- ``gloo_bw``/``gloo_latency_s``: P2PCommunicator.exchange between rank pairs (4 MiB / 4 B,
  both directions at once), bytes sent per second per rank;
- ``shm_bw``/``shm_latency_s``/``barrier_s``: ShmCommunicator.get of a peer's 4 MiB / 4 B
  symmetric buffer, barrier_all;
- ``copy_bw``: a 16 MiB ``copy_``;
- ``overlap``: attend alone (c), exchange alone (m), both at once (b):
  ``overlap = 1 - (b - max(c, m)) / min(c, m)`` (fraction of the shorter one hidden: 0 when
  ``b = c + m``, whichever is longer);
- ``link_efficiency``: on 4 emulated machines joined by ``--link-mbit`` links (``netns.py``,
  root), every rank pulls 9 blocks of 384 KiB from the other machines in the Torus order
  (shm proxy gets, one FIFO) or exchanges them (p2p, all posted at once) while it computes;
  received bytes/s per machine over the link's rate: ``one_sided`` and ``two_sided``.

Command: .venv/bin/python scripts/calibrate_cpu.py [--worlds 4,8] [--reps 7] [--link-mbit 80]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from xfuser_swiftfusion.comm import make_one_sided, make_two_sided
from xfuser_swiftfusion.cost_model import CPU_PROFILE_PATH, host_cpu
from xfuser_swiftfusion.kernels import attend, new_state
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.emulation.netns import LinkSpec

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _timed(fn, reps: int) -> float:
    """Median over repetitions of the slowest rank's seconds, every rank starting together
    (the host's cores are shared: this is the time until all ranks are done)."""
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        ts.append(dt.item())
    return statistics.median(ts)


H = 16  # heads per timed attend: each call long enough (~10-50 ms) that time slicing between
#         ranks sharing a core averages out (at 4 heads, single efficiencies came out at 0.8-1.5)


def _attend_time(lq: int, lk: int, d: int, dtype: str, reps: int, h: int = H) -> float:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, lq, d, generator=g).to(DT[dtype])
    k, v = (torch.randn(1, h, lk, d, generator=g).to(DT[dtype]) for _ in range(2))
    st = [new_state(q)]
    return _timed(lambda: attend([q], [(k, v)], st, scale=d ** -0.5), reps)


def _measure(reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    L, D = 1024, 128
    rate = {d: 4 * H * L * L * d / _attend_time(L, L, d, "bf16", reps) for d in (32, 64, 128)}
    flops = {"bf16": rate[D], "fp32": 4 * H * L * L * D / _attend_time(L, L, D, "fp32", reps)}
    eff = {d: r / rate[D] for d, r in rate.items()}
    q_rate = {lq: 4 * H * lq * L * D / _attend_time(lq, L, D, "bf16", reps) for lq in (L, 256, 512, 2048)}
    q_eff = {lq: r / q_rate[L] for lq, r in q_rate.items()}
    k_rate = {lk: 4 * H * L * lk * 64 / _attend_time(L, lk, 64, "bf16", reps) for lk in (L, 4096, 16384)}
    k_eff = {lk: r / k_rate[L] for lk, r in k_rate.items()}
    t_small, t_big = _attend_time(64, 16, 128, "bf16", reps), _attend_time(4096, 16, 128, "bf16", reps)
    merge = (t_big - t_small) / (H * (4096 - 64) * 128)
    overhead = max(t_small - merge * H * 64 * 128, 0.0)

    node_of = list(range(world))
    two = make_two_sided(rank=rank, world_size=world, node_of=node_of, timeout_s=60)
    big, tiny = torch.randn(1 << 20), torch.randn(1)  # 4 MiB fp32
    rbig, rtiny = torch.empty_like(big), torch.empty_like(tiny)
    ex = lambda s, r: two.exchange([(s, peer)], [(r, peer)], what="calibrate").wait()  # noqa: E731
    gloo_lat = _timed(lambda: ex(tiny, rtiny), reps)
    gloo_bw = big.numel() * 4 / max(_timed(lambda: ex(big, rbig), reps) - gloo_lat, 1e-9)

    one = make_one_sided("shm", rank=rank, world_size=world, node_of=node_of, timeout_s=60)
    # [source, destination] per size: across machines both sides of a get are symmetric
    sbig, stiny = one.symmetric_empty((2, 1 << 20), torch.float32), one.symmetric_empty((2, 1), torch.float32)
    get = lambda x: one.get(x[1], x[0], peer, queue="other", what="calibrate").wait()  # noqa: E731
    shm_lat = _timed(lambda: get(stiny), reps)
    shm_bw = big.numel() * 4 / max(_timed(lambda: get(sbig), reps) - shm_lat, 1e-9)
    barrier = _timed(lambda: one.barrier_all(what="calibrate"), reps)
    x16 = torch.randn(4 << 20)
    y16 = torch.empty_like(x16)
    copy_bw = x16.numel() * 4 / _timed(lambda: y16.copy_(x16), reps)

    # overlap: an exchange sized to take about as long as one attend, beside it
    c = _attend_time(L, L, D, "bf16", reps)
    n = torch.tensor([max(1, int(c * gloo_bw / 4))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)  # partners must agree on the message size
    n = int(n)
    s_ov, r_ov = torch.randn(n), torch.empty(n)
    m = _timed(lambda: ex(s_ov, r_ov), reps)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g).to(torch.bfloat16)
    st = [new_state(q)]

    def both():
        th = threading.Thread(target=ex, args=(s_ov, r_ov))
        th.start()
        attend([q], [(q, q)], st, scale=D ** -0.5)
        th.join()
    b = _timed(both, reps)
    overlap = min(1.0, max(0.0, 1 - (b - max(c, m)) / min(c, m)))
    one.barrier_all(what="calibrate end")
    one.close()
    two.close()
    return {"attn_flops": flops, "head_dim_efficiency": eff, "query_len_efficiency": q_eff,
            "key_len_efficiency": k_eff,
            "attend_overhead_s": overhead,
            "merge_s_per_elem": merge, "gloo_bw": gloo_bw, "gloo_latency_s": gloo_lat,
            "shm_bw": shm_bw, "shm_latency_s": shm_lat, "barrier_s": barrier, "copy_bw": copy_bw,
            "overlap": overlap, "overlap_probe_s": {"attend": c, "exchange": m, "both": b}}


def _link_probe(reps: int, rate_mbit: float) -> dict:
    """Received bytes/s per rank over the throttled link, relative to the link rate, while
    the rank computes (see the module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    node_of = list(range(world))
    n = 3 << 16  # 384 KiB of bf16
    ks = [k for _ in range(3) for k in range(1, world)]  # Q, K, V of every stage k
    one = make_one_sided("shm", rank=rank, world_size=world, node_of=node_of, timeout_s=120)
    two = make_two_sided(rank=rank, world_size=world, node_of=node_of, timeout_s=120)
    src = one.symmetric_empty((n,), torch.bfloat16)
    dst = one.symmetric_empty((len(ks), n), torch.bfloat16).unbind(0)  # symmetric: across machines
    send = torch.randn(n).to(torch.bfloat16)
    q = torch.randn(1, 4, 1024, 64).to(torch.bfloat16)

    def computing(issue) -> None:
        """``issue()``'s transfers, waited for while a thread computes beside them."""
        stop = threading.Event()

        def compute():
            st = [new_state(q)]
            while not stop.is_set():
                attend([q], [(q, q)], st, scale=0.125)
        th = threading.Thread(target=compute)
        th.start()
        try:
            for h in issue():
                h.wait()
        finally:
            stop.set()
            th.join()

    pulls = lambda: [one.get(d, src, (rank - k) % world, queue="other", what="link probe")  # noqa: E731
                     for d, k in zip(dst, ks)]
    exchanges = lambda: [two.exchange([(send, (rank + k) % world)], [(d, (rank - k) % world)],  # noqa: E731
                                      what="link probe") for d, k in zip(dst, ks)]
    wire = rate_mbit * 1e6 / 8
    out = {name: len(ks) * n * 2 / _timed(lambda f=f: computing(f), reps) / wire
           for name, f in (("one_sided", pulls), ("two_sided", exchanges))}
    one.barrier_all(what="link probe end")
    one.close()
    two.close()
    return out


def _median_over_ranks(results: list[dict]) -> dict:
    def med(vals):
        if isinstance(vals[0], dict):
            return {k: med([v[k] for v in vals]) for k in vals[0]}
        return statistics.median(vals)
    return med(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(CPU_PROFILE_PATH))
    ap.add_argument("--link-mbit", type=float, default=80.0, help="rate of the link probe")
    args = ap.parse_args()
    runs = {}
    for w in (int(x) for x in args.worlds.split(",")):
        runs[str(w)] = _median_over_ranks(run_emulated(_measure, f"{w}x1", args.reps, timeout_s=900))
        print(f"W={w}: " + json.dumps(runs[str(w)], indent=1), flush=True)
    link = _median_over_ranks(run_emulated(_link_probe, "4x1", args.reps, args.link_mbit,
                                           timeout_s=900, link=LinkSpec(args.link_mbit)))
    print(f"link efficiency at {args.link_mbit:g} Mbit/s: {link}", flush=True)
    data = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
            "cpu": host_cpu(), "cores": os.cpu_count(),
            "torch": torch.__version__, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "link_efficiency": link, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
