"""The soak run: many attention calls per strategy on an emulated cluster, constant memory
and bitwise-identical outputs.

Every rank builds the same seeded inputs, runs ``warmup`` calls (buffers, allocator and
caches reach their steady state), then records its RSS and symmetric-heap bytes, runs
``calls`` more calls on the SAME inputs, checks each output bitwise against the first one,
and records RSS and heap again. The first output is also compared with
``reference.rank_rows``, so "identical" cannot mean "identically wrong".

Pass criteria (per strategy, worst rank): RSS growth < 1 %, heap growth 0, 0 differing
outputs, error vs fp64 < 1e-5 (fp32). Used by ``tests/test_reliability.py`` (short soak)
and ``scripts/soak.py`` (long runs).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from . import reference

STRATEGIES = ("tas", "torus", "swiftfusion", "usp")
TOLERANCE = 1e-5
MAX_RSS_GROWTH = 0.01


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``, field 2, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_rank(strategy: str, calls: int, warmup: int, shape: tuple[int, int, int, int],
              joint_tokens: int, progress: bool) -> dict:
    """Runs on every rank. ``shape`` = global (B, H, L, D), text ``[B, H, joint_tokens, D]``
    in front; returns this rank's figures."""
    from tqdm import tqdm

    import xfuser_swiftfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, L, D = shape
    g = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    jq, jk, jv = (torch.randn(B, H, joint_tokens, D, generator=g) for _ in range(3))
    local = [reference.shard(x, rank, world) for x in (q, k, v)]
    joint = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="front") \
        if joint_tokens else {}
    ref = reference.rank_rows(q, k, v, rank, world, (jq, jk, jv), "front")
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
            "max_abs_err": reference.max_abs_err(first, ref)}


def summarize(rows: list[dict]) -> dict:
    """Worst rank of one strategy, and ``passed`` by the criteria above."""
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
    from xfuser_swiftfusion.emulation.launcher import run_emulated

    if "usp" in strategies:
        import xfuser_swiftfusion.integrations.xfuser.state  # noqa: F401  (import xFuser once, before forking)
    summaries = []
    for s in strategies:
        t0 = time.monotonic()
        rows = run_emulated(soak_rank, topology, s, calls, warmup, shape, joint_tokens, progress,
                            timeout_s=600 + 0.5 * calls)
        summaries.append(summarize(rows) | {"topology": topology, "shape": shape,
                                            "mesh": rows[0]["mesh"], "wall_s": time.monotonic() - t0})
    return summaries
