"""Per-layer host overhead: every strategy at a tiny shape, where attention costs almost nothing,
on an emulated cluster; what remains per call is the host's fixed cost (Python, transfers
issued, waits, barriers).

    python scripts/bench_host_overhead.py --topology 4x2 --calls 60 --json out.json

Per strategy: median and mean wall time per call over ``--calls`` calls (after ``--warmup``),
the slowest rank's per call (all ranks barrier before each call), and, where ``ctx.stats()``
has them, the host operations per call. Runs on any checkout of the package (the import paths
of the emulation moved once); pass ``--label`` to name the run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf

try:
    from xfuser_swiftfusion.emulation.launcher import run_emulated
except ImportError:  # checkouts before the emulation moved into its own package
    from xfuser_swiftfusion.launcher import run_emulated

OPS = ("transfers", "grouped_exchanges", "barriers", "attend_calls")


def _rank(strategies: list[str], heads: int, tokens: int, head_dim: int, warmup: int,
          calls: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=g) for _ in range(3))
    out = {}
    for strategy in strategies:
        with sf.init_sequence_parallel(strategy, heads, timeout_s=120) as ctx:
            for _ in range(warmup):
                ctx.attention(q, k, v)
            ctx.reset_stats()
            times = []
            for _ in range(calls):
                dist.barrier()
                t0 = time.perf_counter()
                ctx.attention(q, k, v)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's call
                times.append(t.item())
            stats = ctx.stats()
            out[strategy] = {"ran": ctx.strategy, "mesh": ctx.mesh.describe(),
                             "median_s": statistics.median(times), "mean_s": statistics.fmean(times),
                             **{k: stats[k] / stats["calls"] for k in OPS if k in stats}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="4x2")
    p.add_argument("--strategies", default="usp,tas,torus,swiftfusion")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8, help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--label", default=None, help="name of the run (default: git commit)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    rows = run_emulated(_rank, args.topology, args.strategies.split(","), args.heads, args.tokens,
                        args.head_dim, args.warmup, args.calls, timeout_s=1200)[0]
    print(f"host overhead per call, {label}, emulated {args.topology}, B1 H{args.heads} "
          f"S_local {args.tokens} D{args.head_dim} fp32, {args.calls} calls")
    print(f"{'strategy':<12} {'ran':<12} {'median ms':>9} {'mean ms':>8} " + " ".join(f"{k:>17}" for k in OPS))
    for s, r in rows.items():
        ops = " ".join(f"{r[k]:>17.1f}" if k in r else f"{'-':>17}" for k in OPS)
        print(f"{s:<12} {r['ran']:<12} {r['median_s'] * 1e3:>9.2f} {r['mean_s'] * 1e3:>8.2f} {ops}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "topology": args.topology, "rows": rows,
                       "command": " ".join(["scripts/bench_host_overhead.py", f"--topology {args.topology}",
                                            f"--calls {args.calls}", f"--warmup {args.warmup}"])},
                      f, indent=2)


if __name__ == "__main__":
    main()
