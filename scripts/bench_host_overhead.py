"""Per-layer host overhead: every strategy at a tiny shape, where attention costs almost nothing,
on an emulated cluster; what remains per call is the host's fixed cost (Python, transfers
issued, waits, barriers).

    python scripts/bench_host_overhead.py --topology 4x2 --calls 60 --json out.json

Every strategy's context is open for the whole run and their calls interleave in ``--rounds``
blocks, so a drift of the host's load reaches all of them alike. Per strategy: median and
mean wall time per call over ``--calls`` calls (after ``--warmup``), the slowest rank's per
call (all ranks barrier before each call); the CPU time per call of all ranks together (every
thread: compute, copy and proxy threads, gloo's; the timing barriers included); and, where
``ctx.stats()`` has them, the host operations per call. Runs on any checkout of the package
(the import paths of the emulation moved once); pass ``--label`` to name the run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.cost_model import host_cpu
from xfuser_swiftfusion.tools.quiet import quiet_libraries, quiet_rank

try:
    from xfuser_swiftfusion.emulation.launcher import run_emulated
except ImportError:  # checkouts before the emulation moved into its own package
    from xfuser_swiftfusion.launcher import run_emulated

OPS = ("transfers", "grouped_exchanges", "barriers", "attend_calls")
CROSS_NODE_ENV = "SWIFTFUSION_SHM_CROSS_NODE"


def _rank(strategies: list[str], heads: int, tokens: int, head_dim: int, warmup: int,
          calls: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    quiet_rank(dist.get_rank())
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=g) for _ in range(3))
    with contextlib.ExitStack() as stack:  # every strategy open at once: calls interleave
        ctxs = {s: stack.enter_context(sf.init_sequence_parallel(s, heads, timeout_s=120))
                for s in strategies}
        times: dict[str, list[float]] = {s: [] for s in strategies}
        cpu = {s: 0.0 for s in strategies}
        for s, ctx in ctxs.items():
            for _ in range(warmup):
                ctx.attention(q, k, v)
            ctx.reset_stats()
        per_round = max(1, calls // rounds)
        for _ in range(rounds):  # host load drifts: every strategy sees every part of the run
            for s, ctx in ctxs.items():
                cpu0 = time.process_time()
                for _ in range(per_round):
                    dist.barrier()
                    t0 = time.perf_counter()
                    ctx.attention(q, k, v)
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's call
                    times[s].append(t.item())
                cpu[s] += time.process_time() - cpu0
        out = {}
        for s, ctx in ctxs.items():
            total = torch.tensor([cpu[s]], dtype=torch.float64)
            dist.all_reduce(total)  # all ranks together
            stats, n = ctx.stats(), len(times[s])
            out[s] = {"ran": ctx.strategy, "mesh": ctx.mesh.describe(),
                      "median_s": statistics.median(times[s]), "mean_s": statistics.fmean(times[s]),
                      "cpu_s": total.item() / n, "calls": n,
                      **{k: stats[k] / stats["calls"] for k in OPS if k in stats}}
    return out


def main() -> None:
    quiet_libraries()  # before the ranks load xFuser: the table, not setup notices
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="4x2")
    p.add_argument("--strategies", default="usp,tas,torus,swiftfusion")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8, help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6,
                   help="the calls of each strategy run in this many blocks, strategies in turn")
    p.add_argument("--label", default=None, help="name of the run (default: git commit)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    cross_node = os.environ.get(CROSS_NODE_ENV, "proxy")
    load = [os.getloadavg()[0]]
    rows = run_emulated(_rank, args.topology, args.strategies.split(","), args.heads, args.tokens,
                        args.head_dim, args.warmup, args.calls, args.rounds, timeout_s=1200)[0]
    load.append(os.getloadavg()[0])
    cpu = f"{host_cpu()}, {os.cpu_count()} cores"
    print(f"host overhead per call, {label}, emulated {args.topology} ({cross_node} across "
          f"machines), B1 H{args.heads} S_local {args.tokens} D{args.head_dim} fp32, {args.calls} "
          f"calls; {cpu}, load {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'strategy':<12} {'ran':<12} {'median ms':>9} {'mean ms':>8} {'CPU ms':>7} "
          + " ".join(f"{k:>17}" for k in OPS))
    for s, r in rows.items():
        ops = " ".join(f"{r[k]:>17.1f}" if k in r else f"{'-':>17}" for k in OPS)
        print(f"{s:<12} {r['ran']:<12} {r['median_s'] * 1e3:>9.2f} {r['mean_s'] * 1e3:>8.2f} "
              f"{r['cpu_s'] * 1e3:>7.1f} {ops}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "topology": args.topology, "cross_node": cross_node,
                       "cpu": cpu, "load_1min": load, "rows": rows,
                       "command": " ".join([f"{CROSS_NODE_ENV}={cross_node}" if cross_node != "proxy" else "",
                                            "scripts/bench_host_overhead.py", f"--topology {args.topology}",
                                            f"--strategies {args.strategies}",
                                            f"--calls {args.calls}", f"--rounds {args.rounds}",
                                            f"--warmup {args.warmup}"]).strip()},
                      f, indent=2)


if __name__ == "__main__":
    main()
