"""Measure the CPU-emulation rates the cost model needs; write xfuser_swiftfusion/cpu_profile.json.

Every quantity is measured with all W forked ranks doing the same thing at once (they share
the host's cores, as in a benchmark), medians of ``--reps`` repetitions, for W in ``--worlds``:

- ``attn_flops[dtype]``: ``kernels.attend`` on [1, 4, 1024, 128] Q/K/V, 4*B*h*Lq*Lk*D / time;
  ``head_dim_efficiency[D]``: bf16 throughput at D relative to D=128 (same Lq*Lk);
- ``attend_overhead_s``, ``merge_s_per_elem``: attend against 16 keys at Lq=64 and Lq=4096
  (fit: overhead + merge * B*h*Lq*D);
- ``gloo_bw``/``gloo_latency_s``: P2PCommunicator.exchange between rank pairs (4 MiB / 4 B,
  both directions at once), bytes sent per second per rank;
- ``shm_bw``/``shm_latency_s``/``barrier_s``: ShmCommunicator.get of a peer's 4 MiB / 4 B
  symmetric buffer, barrier_all;
- ``copy_bw``: a 16 MiB ``copy_``;
- ``overlap``: attend alone (c), exchange alone (m), both at once (b):
  ``overlap = 1 - (b - max(c, m)) / m`` (fraction of the exchange's CPU work hidden).

Command: /work/venv/bin/python scripts/calibrate_cpu.py [--worlds 4,8] [--reps 7]
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
from xfuser_swiftfusion.cost_model import CPU_PROFILE_PATH
from xfuser_swiftfusion.kernels import attend, new_state
from xfuser_swiftfusion.launcher import run_emulated

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


def _attend_time(lq: int, lk: int, d: int, dtype: str, reps: int, h: int = 4) -> float:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, lq, d, generator=g).to(DT[dtype])
    k, v = (torch.randn(1, h, lk, d, generator=g).to(DT[dtype]) for _ in range(2))
    st = [new_state(q)]
    return _timed(lambda: attend([q], [(k, v)], st, scale=d ** -0.5), reps)


def _measure(reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    L, D = 1024, 128
    rate = {d: 4 * 4 * L * L * d / _attend_time(L, L, d, "bf16", reps) for d in (32, 64, 128)}
    flops = {"bf16": rate[D], "fp32": 4 * 4 * L * L * D / _attend_time(L, L, D, "fp32", reps)}
    eff = {d: r / rate[D] for d, r in rate.items()}
    t_small, t_big = _attend_time(64, 16, 128, "bf16", reps), _attend_time(4096, 16, 128, "bf16", reps)
    merge = (t_big - t_small) / (4 * (4096 - 64) * 128)
    overhead = max(t_small - merge * 4 * 64 * 128, 0.0)

    node_of = list(range(world))
    two = make_two_sided("p2p", rank=rank, world_size=world, node_of=node_of, timeout_s=60)
    big, tiny = torch.randn(1 << 20), torch.randn(1)  # 4 MiB fp32
    rbig, rtiny = torch.empty_like(big), torch.empty_like(tiny)
    ex = lambda s, r: two.exchange([(s, peer)], [(r, peer)], what="calibrate").wait()  # noqa: E731
    gloo_lat = _timed(lambda: ex(tiny, rtiny), reps)
    gloo_bw = big.numel() * 4 / max(_timed(lambda: ex(big, rbig), reps) - gloo_lat, 1e-9)

    one = make_one_sided("shm", rank=rank, world_size=world, node_of=node_of, timeout_s=60)
    sbig, stiny = one.symmetric_empty((1 << 20,), torch.float32), one.symmetric_empty((1,), torch.float32)
    get = lambda d, s: one.get(d, s, peer, queue="other", what="calibrate").wait()  # noqa: E731
    shm_lat = _timed(lambda: get(rtiny, stiny), reps)
    shm_bw = big.numel() * 4 / max(_timed(lambda: get(rbig, sbig), reps) - shm_lat, 1e-9)
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
    q = torch.randn(1, 4, L, D, generator=g).to(torch.bfloat16)
    st = [new_state(q)]

    def both():
        th = threading.Thread(target=ex, args=(s_ov, r_ov))
        th.start()
        attend([q], [(q, q)], st, scale=D ** -0.5)
        th.join()
    b = _timed(both, reps)
    overlap = min(1.0, max(0.0, 1 - (b - max(c, m)) / m))
    one.barrier_all(what="calibrate end")
    one.close()
    two.close()
    return {"attn_flops": flops, "head_dim_efficiency": eff, "attend_overhead_s": overhead,
            "merge_s_per_elem": merge, "gloo_bw": gloo_bw, "gloo_latency_s": gloo_lat,
            "shm_bw": shm_bw, "shm_latency_s": shm_lat, "barrier_s": barrier, "copy_bw": copy_bw,
            "overlap": overlap, "overlap_probe_s": {"attend": c, "exchange": m, "both": b}}


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
    args = ap.parse_args()
    runs = {}
    for w in (int(x) for x in args.worlds.split(",")):
        runs[str(w)] = _median_over_ranks(run_emulated(_measure, f"{w}x1", args.reps, timeout_s=900))
        print(f"W={w}: " + json.dumps(runs[str(w)], indent=1), flush=True)
    data = {"command": "/work/venv/bin/python " + " ".join(sys.argv), "cores": os.cpu_count(),
            "torch": torch.__version__, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "tbf_efficiency": 0.95, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
