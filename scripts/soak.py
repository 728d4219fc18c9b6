"""Soak test: many attention calls per strategy on an emulated cluster, constant memory and
bitwise-identical outputs.

Every rank builds the same seeded inputs, runs ``--warmup`` calls (buffers, allocator and
caches reach their steady state), then records its RSS and symmetric-heap bytes, runs
``--calls`` more calls on the SAME inputs, checks each output bitwise against the first one,
and records RSS and heap again. The first output is also compared with an fp64 softmax
attention written here, so "identical" cannot mean "identically wrong".

    .venv/bin/python scripts/soak.py --calls 10000 --strategies tas,torus,swiftfusion,usp \\
        --json soak.json

Pass criteria (per strategy, worst rank): RSS growth < 1 %, heap growth 0, 0 differing outputs,
error vs fp64 < 1e-5 (fp32).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

STRATEGIES = ("tas", "torus", "swiftfusion", "usp")
TOLERANCE = 1e-5
MAX_RSS_GROWTH = 0.01


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``, field 2, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention, ``[B, H, Lq, D]`` queries over ``[B, H, L, D]`` keys."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def soak_rank(strategy: str, calls: int, warmup: int, shape: tuple[int, int, int, int],
              joint_tokens: int, progress: bool) -> dict:
    """Runs on every rank. ``shape`` = global (B, H, L, D); returns this rank's figures."""
    from tqdm import tqdm

    import xfuser_swiftfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, L, D = shape
    S = L // world
    g = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    jq, jk, jv = (torch.randn(B, H, joint_tokens, D, generator=g) for _ in range(3))
    mine = slice(rank * S, (rank + 1) * S)
    local = [x[:, :, mine] for x in (q, k, v)]
    joint = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="front") \
        if joint_tokens else {}
    ref = reference(torch.cat([jq, local[0]], 2), torch.cat([jk, k], 2), torch.cat([jv, v], 2))
    with sf.init_sequence_parallel(strategy, H, timeout_s=60) as ctx:
        first = ctx.attention(*local, **joint).clone()
        for _ in range(warmup - 1):
            ctx.attention(*local, **joint)
        rss0, heap0 = rss_bytes(), ctx.stats()["symmetric_heap_bytes"]
        differing, times = 0, []
        bar = tqdm(range(calls), desc=f"{strategy} rank {rank}", disable=not (progress and rank == 0),
                   mininterval=2.0)
        for _ in bar:
            t0 = time.perf_counter()
            out = ctx.attention(*local, **joint)
            times.append(time.perf_counter() - t0)
            differing += not torch.equal(out, first)
        rss1, heap1 = rss_bytes(), ctx.stats()["symmetric_heap_bytes"]
        ran_as, mesh = ctx.strategy, ctx.mesh.describe()
    return {"strategy": strategy, "ran_as": ran_as, "mesh": mesh, "rank": rank, "calls": calls,
            "rss_start": rss0, "rss_end": rss1, "heap_start": heap0, "heap_end": heap1,
            "differing_outputs": differing, "median_call_s": statistics.median(times),
            "max_abs_err": (first.double() - ref).abs().max().item()}


def summarize(rows: list[dict]) -> dict:
    """Worst rank of one strategy."""
    growth = max((r["rss_end"] - r["rss_start"]) / r["rss_start"] for r in rows)
    out = {"strategy": rows[0]["strategy"], "ran_as": rows[0]["ran_as"], "calls": rows[0]["calls"],
           "ranks": len(rows),
           "rss_start_mib": max(r["rss_start"] for r in rows) / 2**20,
           "rss_end_mib": max(r["rss_end"] for r in rows) / 2**20,
           "rss_growth_max": growth,
           "heap_start_bytes": max(r["heap_start"] for r in rows),
           "heap_end_bytes": max(r["heap_end"] for r in rows),
           "differing_outputs": sum(r["differing_outputs"] for r in rows),
           "median_call_ms": 1e3 * statistics.median(r["median_call_s"] for r in rows),
           "max_abs_err": max(r["max_abs_err"] for r in rows)}
    out["passed"] = bool(growth < MAX_RSS_GROWTH and out["heap_end_bytes"] == out["heap_start_bytes"]
                         and out["differing_outputs"] == 0 and out["max_abs_err"] < TOLERANCE)
    return out


def run_soak(strategies: list[str], calls: int, topology: str = "2x2", warmup: int = 20,
             shape: tuple[int, int, int, int] = (1, 2, 64, 16), joint_tokens: int = 3,
             progress: bool = False) -> list[dict]:
    """One emulated launch per strategy; returns one summary per strategy."""
    from xfuser_swiftfusion.launcher import run_emulated

    summaries = []
    for s in strategies:
        t0 = time.monotonic()
        rows = run_emulated(soak_rank, topology, s, calls, warmup, shape, joint_tokens, progress,
                            timeout_s=600 + 0.5 * calls)
        summaries.append(summarize(rows) | {"topology": topology, "shape": shape,
                                            "mesh": rows[0]["mesh"], "wall_s": time.monotonic() - t0})
    return summaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10_000, help="measured calls per strategy")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--topology", default="2x2", metavar="NxM")
    p.add_argument("--shape", default="1,2,64,16",
                   help="global B,H,L,D (H=2 on 2x2: Ulysses 2 x Ring 2, every stage runs)")
    p.add_argument("--joint-tokens", type=int, default=3)
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    if "usp" in args.strategies:
        import xfuser_swiftfusion.xfuser_state  # noqa: F401  (import xFuser once, before forking)
    shape = tuple(int(x) for x in args.shape.split(","))
    rows = run_soak(args.strategies.split(","), args.calls, args.topology, args.warmup, shape,
                    args.joint_tokens, progress=True)
    print(f"{'strategy':<12} {'calls':>6} {'RSS start/end MiB':>18} {'growth':>8} {'heap B':>8} "
          f"{'differing':>9} {'ms/call':>8} {'err':>9}  result")
    for r in rows:
        print(f"{r['strategy']:<12} {r['calls']:>6} {r['rss_start_mib']:>8.1f}/{r['rss_end_mib']:<9.1f} "
              f"{100 * r['rss_growth_max']:>7.3f}% {r['heap_end_bytes']:>8} {r['differing_outputs']:>9} "
              f"{r['median_call_ms']:>8.2f} {r['max_abs_err']:>9.2e}  {'PASS' if r['passed'] else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
