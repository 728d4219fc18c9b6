"""The emulated one-sided backend's TCP proxy alone: wall and CPU time of moving bytes between
two emulated machines (2x1, loopback, no rate limit), large and small transfers, gets and puts.

    python scripts/bench_proxy.py [--reps 9] [--label NAME] [--json out.json]

Each rep: rank r gets (or puts) ``n`` slots of ``size`` bytes from (to) the rank on the other
machine, waits for all, then one barrier. Medians of the wall time per rep (rank 0) and the
CPU time per rep of a rank (process time, every thread: copy threads and proxy handlers),
mean over both ranks. Run it on two checkouts (``PYTHONPATH=<other checkout>``) to compare
proxies side by side on one host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from xfuser_swiftfusion.comm import make_one_sided
from xfuser_swiftfusion.cost_model import host_cpu
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.topology import TOPOLOGY_ENV, Topology

SHAPES = ((4 << 20, 8), (16 << 10, 64))  # (bytes per transfer, transfers per rep)


def _rank(nbytes: int, n: int, reps: int, op: str) -> tuple[float, float, bool]:
    """(median wall s per rep, CPU s per rep, the got bytes are the peer's)."""
    topo = Topology.parse(os.environ[TOPOLOGY_ENV])
    me, world = dist.get_rank(), dist.get_world_size()
    comm = make_one_sided("shm", rank=me, world_size=world,
                          node_of=[topo.node_of(r) for r in range(world)], timeout_s=60)
    src = comm.symmetric_empty((n, nbytes // 4), torch.float32)
    dst = comm.symmetric_empty((n, nbytes // 4), torch.float32)
    src.fill_(me)
    peer = (me + world // 2) % world  # the rank on the other machine
    comm.barrier_all(what="ready")
    move = comm.get if op == "get" else comm.put
    times, cpu0 = [], time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        for h in [move(dst[i], src[i], peer, queue="other", what=op) for i in range(n)]:
            h.wait()
        comm.barrier_all(what="rep")
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / reps
    ok = bool((dst == peer).all()) if op == "get" else True
    comm.barrier_all(what="end")
    comm.close()
    return statistics.median(times), cpu, ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--label", default=None, help="name of the run (default: git commit)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    rows = []
    for nbytes, n in SHAPES:
        for op in ("get", "put"):
            res = run_emulated(_rank, "2x1", nbytes, n, args.reps, op, timeout_s=300)
            assert all(ok for _, _, ok in res), f"{op}: wrong bytes arrived"
            rows.append({"op": op, "bytes": nbytes, "transfers": n, "wall_s": res[0][0],
                         "cpu_s_per_rank": statistics.fmean(c for _, c, _ in res)})
            print(f"{label}: {op} {n} x {nbytes >> 10} KiB: wall {res[0][0] * 1e3:.1f} ms, "
                  f"CPU per rank {rows[-1]['cpu_s_per_rank'] * 1e3:.1f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "cpu": host_cpu(), "reps": args.reps, "rows": rows,
                       "command": f"scripts/bench_proxy.py --reps {args.reps}"}, f, indent=2)


if __name__ == "__main__":
    main()
