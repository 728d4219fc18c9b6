"""Layer-level benchmark of every strategy on the emulated cluster, beside the cost model.

Per point (topology, B, L, H, D, dtype) and strategy, on every rank, strategies interleaved
within each repetition in an order rotated by one per repetition, medians over ``--reps``:

- ``latency``: one ``ctx.attention`` call, all ranks released by a barrier, time until the
  slowest rank is done (all-reduce MAX);
- ``compute``: the same local attention work without communication: the ``attend`` calls the
  strategy made in its last call (recorded by wrapping ``kernels.attend`` where the strategies
  look it up) replayed on local tensors of the same shapes, timed like ``latency``. xFuser's
  USP does not call ``attend``: its work (R ring steps of (L/P_r x L/P_r) queries x keys over
  H/P_u heads, each merged by LSE) is replayed through ``attend`` with those shapes;
- ``exposed`` = latency - compute;
- ``latency_cpu``/``compute_cpu``: process CPU seconds (all threads) summed over ranks, median;
  their difference is the CPU work communication adds (on a shared host it costs wall time);
- ``inter_bytes``: per rank per call, max over ranks, from ``ctx.stats()``; for a strategy
  on external groups (usp: xFuser's own collectives bypass our communicators) counted by
  ``mesh.counted_inter_node_elements`` instead; with ``--link-mbit`` also the kernel qdisc
  bytes sent by all machines per call (headers included);
- ``peak_rss``: the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs
  after the first call) during the strategy's second call, over its RSS before the first,
  max over ranks: what the strategy keeps between calls for this shape (symmetric/receive
  buffers, state xFuser builds for it) plus the call's transient peak, without the first
  call's one-time transient allocations. Every strategy first runs twice on a tiny shape
  (``warm_up``), so what a process pays once whichever strategy runs first (lazy imports,
  gloo pairs, the CPU kernel's set-up, xFuser's first-call state) is in no strategy's peak:
  before, usp (measured first) carried 5.6 MB of it at 4x1 L4096. These calls run
  with glibc's mmap threshold at 64 KiB, so freed large blocks go back to the OS and one
  strategy's garbage does not hide the next one's growth; the timed calls run with a 32 MiB
  threshold (glibc's own steady state), as a serving process would: at 64 KiB every large
  tensor is a fresh mmap with zero-filled page faults, which taxed the strategies with many
  small ops (swiftfusion on 4x2) by ~20 % and usp by ~5 % in the runs before this change.
  Pages of machine-mates' heap segments that a rank's puts/gets touch are mapped into its
  RSS too; they are another GPU's memory on a real cluster, so they are taken out
  (``_peer_heap_rss``, from /proc/self/smaps: constant during the second call, since the
  first one touched them all);
- ``predicted``: ``cost_model.predict`` with ``--hardware`` (default: the calibrated
  ``cpu-emulated`` profile at the link rate; a file from ``swiftfusion calibrate``, which
  ``auto`` then picks with too), for the strategy and Ulysses degree that ran (auto: its pick).

``--diffusers``: adds rows for diffusers' own context parallelism (``diffusers:ulysses``,
``diffusers:ring``, ``diffusers:unified``: ``compare_diffusers.diffusers_degrees`` on the
topology; a configuration invalid there is skipped and named): one call of diffusers'
``dispatch_attention_fn`` with a layer-level ``ParallelConfig`` (``compare_diffusers.
layer_config``) on the ``sf_cpu_lse`` backend (torch's CPU flash op, the kernel the strategies
run), inputs in diffusers' own ``[B, S, H, D]`` layout (contiguous copies made before any
measurement); ``compute`` replays its ``forward_op`` calls through ``attend`` as usp's are;
``inter_bytes``/``formula_total_bytes`` from ``compare_diffusers.modelled_diffusers_bytes``;
no cost-model prediction (``predicted`` ``-``).

``--quick``: no timing; every strategy against an fp64 reference and its inter-machine bytes
against ``counted_inter_node_elements`` on small shapes (CI).

Output: the table on stdout; without ``--quick`` also ``<out>.json`` (command, commit, CPU and
one row per point and strategy), the only stored result format (docs/benchmark-method.md).

``--islands``: each NxM topology is one host whose N islands (sockets of M PCIe GPUs) the
ranks find from an emulated NVML (``run_emulated(..., islands=True)``), the link between islands
shaped as the machines' is; ``--usp-splits``: usp also at every other Ulysses x Ring split
(``usp@U<d>``), each in a launch of its own (xFuser's state exists once per process), so those
rows are not interleaved with the others; with both and ``--link-mbit``, a second table sets
each strategy's latency beside its limit ``max(compute, bytes an island sends / link rate)``.

``--kv-pieces 1,4``: each strategy with that option (torus: the last Pull-KV stage's K/V in
P pieces, ``strategies/torus.py``) once per value, interleaved with the others, in rows named
``torus[P=4]`` (P = 1: plain ``torus``); each row's ``options`` in the JSON, its prediction
and its floor with them.

Command (see BENCHMARKS.md): .venv/bin/python scripts/bench_layer.py [--quick]
  [--topologies 4x1,4x2] [--seq 4096,8192] [--head-dims 64] [--batches 1] [--heads 16]
  [--reps 5] [--link-mbit 300] [--diffusers] [--islands] [--usp-splits] [--kv-pieces 1,4]
  [--out benchmarks/results/layer]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import xfuser_swiftfusion as sf
from xfuser_swiftfusion import kernels
from xfuser_swiftfusion.cost_model import BYTES, HARDWARE_ENV, Workload, get_profile, host_cpu, predict
from xfuser_swiftfusion.kernels import new_state
from xfuser_swiftfusion.emulation.shm import PREFIX, SHM_DIR
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.tools.quiet import quiet_libraries, quiet_rank
from xfuser_swiftfusion.emulation.netns import add_link_argument, link_from_args
from xfuser_swiftfusion.strategies import get, names, ring as ring_mod, tas as tas_mod, torus as torus_mod
from xfuser_swiftfusion.mesh import choose_mesh, counted_inter_node_elements
from xfuser_swiftfusion.topology import Topology
from xfuser_swiftfusion.tools import diffusers_backend
from xfuser_swiftfusion.tools.compare_diffusers import (DIFFUSERS_CONFIGS, PREFIX as DIFFUSERS,
                                                        diffusers_degrees, layer_config,
                                                        modelled_diffusers_bytes)

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


class AttendRecorder:
    """Wraps ``attend`` where the strategies look it up; keeps the calls of the last layer."""

    MODULES = (ring_mod, tas_mod, torus_mod)

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __enter__(self) -> "AttendRecorder":
        def rec(q_chunks, kv_chunks, states, **kw):
            self.calls.append(([tuple(q.shape) for q in q_chunks],
                               [tuple(k.shape) for k, _ in kv_chunks], q_chunks[0].dtype,
                               bool(kw.get("finalize"))))
            return kernels.attend(q_chunks, kv_chunks, states, **kw)
        for m in self.MODULES:
            m.attend = rec
        return self

    def __exit__(self, *exc) -> None:
        for m in self.MODULES:
            m.attend = kernels.attend


class DiffusersLayer:
    """diffusers' own context-parallel attention (``diffusers:<config>``) behind the part of
    the context interface this script uses. ``attention`` takes and returns ``[B, H, S, D]``
    (this rank's tokens) but hands diffusers contiguous ``[B, S, H, D]`` copies made by
    ``set_inputs`` outside the measurements, so no layout copy is timed for either engine."""

    def __init__(self, name: str, heads: int, topo: Topology) -> None:
        degrees = diffusers_degrees(name.removeprefix(DIFFUSERS), topo, heads, lse_backend=True)
        if degrees is None:
            raise ValueError(f"{name} cannot run with {heads} heads on {topo}")
        self.strategy, self.topology = name, topo
        self.ring, self.ulysses = degrees
        self.backend = diffusers_backend.register()
        self.config = layer_config(self.ring, self.ulysses)
        self.shapes: list[tuple[int, int, int, int, int]] = []  # (B, S, H, D, bytes) per call
        self.calls: list[tuple] = []  # the last call's forward_op work, in ``replay``'s format
        self._inputs: tuple | None = None

    def set_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Model-layout copies of ``q, k, v`` ``[B, H, S, D]``, used when these are passed."""
        # [B, H, S, D] -> [B, S, H, D], contiguous
        self._inputs = ((q, k, v), tuple(x.transpose(1, 2).contiguous() for x in (q, k, v)))

    def clear_inputs(self) -> None:
        self._inputs = None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        if self._inputs is not None and all(a is b for a, b in zip(self._inputs[0], (q, k, v))):
            args = self._inputs[1]
        else:
            args = tuple(x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] -> [B, S, H, D]
        calls = []
        op = diffusers_backend.forward_op

        def recorded(ctx, query, key, value, *a, **kw):
            # [B, S, H, D] -> [B, H, S, D] shapes, as ``attend`` takes them
            calls.append(([(query.shape[0], query.shape[2], query.shape[1], query.shape[3])],
                          [(key.shape[0], key.shape[2], key.shape[1], key.shape[3])],
                          query.dtype))
            return op(ctx, query, key, value, *a, **kw)
        diffusers_backend.forward_op = recorded
        try:
            out = dispatch_attention_fn(*args, backend=self.backend, parallel_config=self.config)
        finally:
            diffusers_backend.forward_op = op
        self.calls = [(qs, ks, dt, i == len(calls) - 1) for i, (qs, ks, dt) in enumerate(calls)]
        B, S, H, D = args[0].shape
        self.shapes.append((B, S, H, D, args[0].element_size()))
        return out.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D] (a view)

    def reset_stats(self) -> None:
        self.shapes.clear()

    def stats(self) -> dict:
        """Inter-machine bytes this rank sent since ``reset_stats``: the volume model."""
        return {"inter_node_bytes": modelled_diffusers_bytes(
            self.topology, self.ring, self.ulysses, self.shapes, dist.get_rank())}

    def total_bytes(self) -> int:
        """The volume model's bytes of every rank since ``reset_stats``."""
        return sum(modelled_diffusers_bytes(self.topology, self.ring, self.ulysses, self.shapes, p)
                   for p in range(self.topology.world_size))

    def close(self) -> None:
        pass


def usp_calls(mesh, B: int, L: int, H: int, D: int, dtype) -> list[tuple]:
    """xFuser's USP local work: R steps of [B, H/P_u, L/P_r, D] queries x keys, LSE-merged."""
    lq = L // mesh.ring
    shape = (B, H // mesh.ulysses, lq, D)
    return [([shape], [shape], dtype, i == mesh.ring - 1) for i in range(mesh.ring)]


def replay(calls: list[tuple]) -> callable:
    """A function running ``calls`` on local random tensors (no communication)."""
    g = torch.Generator().manual_seed(1)
    prepared = []
    for qs, ks, dtype, fin in calls:
        q = [torch.randn(s, generator=g).to(dtype) for s in qs]
        kv = [(torch.randn(s, generator=g).to(dtype),) * 2 for s in ks]
        prepared.append((q, kv, fin))

    def run() -> None:
        for q, kv, fin in prepared:
            kernels.attend(q, kv, [new_state(x) for x in q], scale=0.125, finalize=fin)
    return run


def timed_max(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def all_max(x: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def timed_cpu(fn) -> tuple[float, float]:
    """(``timed_max`` seconds, process CPU seconds of every thread summed over all ranks):
    the CPU work of communication threads (copy, proxy, gloo) shows in the second."""
    c0 = time.process_time()
    wall = timed_max(fn)
    return wall, all_max(time.process_time() - c0, dist.ReduceOp.SUM)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def malloc_for(memory: bool) -> None:
    """glibc malloc for measuring peak memory (``True``: blocks >= 64 KiB are mmapped and
    returned on free; the heap is trimmed first) or for timing (``False``: a 32 MiB mmap
    threshold, glibc's dynamic maximum, so freed blocks are reused as in a long-running
    process)."""
    libc = ctypes.CDLL("libc.so.6")
    if memory:
        libc.malloc_trim(0)
    threshold = 64 << 10 if memory else 32 << 20
    if not (libc.mallopt(_M_MMAP_THRESHOLD, threshold) and libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)):
        raise RuntimeError("mallopt failed: peak-memory and timing modes need glibc")


def _kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peer_heap_rss() -> int:
    """Resident bytes of other ranks' symmetric-heap segments mapped into this process."""
    mine = f"-r{dist.get_rank()}-b"
    total, peer = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's header
                path = line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                peer = (os.path.basename(path).startswith(PREFIX) and path.startswith(SHM_DIR)
                        and mine not in path)
            elif peer and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def reference(q, k, v) -> torch.Tensor:
    """fp64 softmax attention [B, H, Lq, D] x [B, H, L, D] (written here, independent)."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def split_name(s: str) -> tuple[str, int | None]:
    """``"usp@U2"`` -> ``("usp", 2)``: a strategy at a given Ulysses degree; plain names:
    ``(s, None)``, the default degree; options in brackets are not part of it
    (``"torus[P=4]"`` -> ``("torus", None)``, ``row_options``)."""
    name, _, deg = s.split("[")[0].partition("@U")
    return name, int(deg) if deg else None


ROW_OPTIONS = {"P": "kv_pieces"}  # a row name's bracketed option -> the strategy option


def row_name(name: str, options: dict) -> str:
    """``("torus", {"kv_pieces": 4})`` -> ``"torus[P=4]"``; options at their defaults (P = 1)
    leave the name plain."""
    short = {v: k for k, v in ROW_OPTIONS.items()}
    tags = [f"{short[k]}={v}" for k, v in options.items() if not (k == "kv_pieces" and v == 1)]
    return f"{name}[{','.join(tags)}]" if tags else name


def row_options(s: str) -> dict:
    """The strategy options of row name ``s``: ``"torus[P=4]"`` -> ``{"kv_pieces": 4}``."""
    _, _, tags = s.partition("[")
    return {ROW_OPTIONS[k]: int(v) for k, v in (t.split("=") for t in tags.rstrip("]").split(",") if t)}


TORUS_SCHEDULE = ("torus", "swiftfusion")  # strategies whose floor is link + compute / (T^2 P)


def add_limits(rows: list[dict], link_mbit: float, machines: int) -> dict:
    """Per row (one topology's, in place): ``split`` (``U<u>xR<r>``), ``link_s`` (the counted
    bytes of all machines over ``machines``, at the line rate: the strategies' traffic is the
    same from every machine), ``limit_s`` = max(compute, link): what a perfect overlap of its
    own communication with its own compute would take, ``latency_over_limit``,
    ``speedup_vs_usp`` (usp at its default split over this row; None without a usp row);
    Torus-schedule rows also ``floor_s`` = link + compute / (T^2 P) (T = ``machines``, P its
    ``kv_pieces``: the last Pull-KV stage's query block against the last piece of its K/V
    block precedes its output's push, docs/one-box.md; the timeline model on an ideal link
    gives this). Returns the summary: the fastest row, its latency / limit and its speedup
    over every usp split."""
    from xfuser_swiftfusion.emulation.netns import LinkSpec
    rate = LinkSpec(link_mbit).bytes_per_s
    base = next((r["latency_s"] for r in rows if r["strategy"] == "usp"), None)
    for r in rows:
        r["split"] = f"U{r['ulysses']}xR{r['world'] // r['ulysses']}"
        r["link_s"] = r["formula_total_bytes"] / machines / rate
        r["limit_s"] = max(r["compute_s"], r["link_s"])
        r["latency_over_limit"] = r["latency_s"] / r["limit_s"]
        r["speedup_vs_usp"] = base / r["latency_s"] if base is not None else None
        if r["ran"] in TORUS_SCHEDULE:
            P = r.get("options", {}).get("kv_pieces", 1)
            r["floor_s"] = r["link_s"] + r["compute_s"] / (machines ** 2 * P)
    best = min(rows, key=lambda r: r["latency_s"])
    return {"best": best["strategy"], "split": best["split"], "latency_s": best["latency_s"],
            "limit_s": best["limit_s"], "latency_over_limit": best["latency_over_limit"],
            "floor_s": best.get("floor_s"),
            "speedup_over_usp": {r["split"]: r["latency_s"] / best["latency_s"]
                                 for r in rows if r["ran"] == "usp"}}


def limits_table(rows: list[dict], link_mbit: float, machines: int) -> str:
    """``add_limits``'s figures as a table, fastest first, and the summary line."""
    summary = add_limits(rows, link_mbit, machines)
    out = ["| strategy | ran as | U x R | latency ms | compute ms | link ms | limit ms | "
           "latency / limit | speedup vs usp | floor ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["latency_s"]):
        floor = f"{r['floor_s'] * 1e3:.1f}" if "floor_s" in r else "-"
        speedup = f"{r['speedup_vs_usp']:.2f}" if r["speedup_vs_usp"] is not None else "-"
        out.append(f"| {r['strategy']} | {r['ran_as']} | {r['split']} | "
                   f"{r['latency_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | {r['link_s'] * 1e3:.1f} | "
                   f"{r['limit_s'] * 1e3:.1f} | {r['latency_over_limit']:.2f} | "
                   f"{speedup} | {floor} |")
    over = ", ".join(f"{x:.2f}x over usp {k}" for k, x in
                     sorted(summary["speedup_over_usp"].items(), key=lambda kv: kv[1]))
    out.append(f"\nfastest: {summary['best']} {summary['split']}, {summary['latency_over_limit']:.2f}x "
               f"its limit" + (f"; {over}" if over else ""))
    return "\n".join(out)


def warm_up(strategies: list[str], pt: dict) -> dict[str, object]:
    """Every strategy's context for ``pt``'s heads (strategies on external groups first: xFuser's
    USP state exists once per process, at usp's default degrees; auto then may pick usp only at
    those degrees, as inside an xFuser run), each run twice on 8 tokens per rank: the process's
    one-time costs are paid before any peak is measured."""
    x = torch.randn(1, pt["H"], 8, pt["D"]).to(DT[pt["dtype"]])
    ctxs = {}
    ours = [s for s in strategies if not s.startswith(DIFFUSERS)]
    for s in sorted(ours, key=lambda s: not get(split_name(s)[0]).external_groups) + [
            s for s in strategies if s.startswith(DIFFUSERS)]:
        if s.startswith(DIFFUSERS):
            ctxs[s] = ctx = DiffusersLayer(s, pt["H"], Topology.parse(pt["topo"]))
        else:
            name, ulysses = split_name(s)
            ctxs[s] = ctx = sf.init_sequence_parallel(name, pt["H"], ulysses_degree=ulysses,
                                                      timeout_s=600, options=row_options(s))
        for _ in range(2):
            ctx.attention(x, x, x)
    return ctxs


def _rank_main(points: list[dict], strategies: list[str], reps: int, quick: bool) -> list[dict]:
    from xfuser_swiftfusion.emulation.netns import current_network, qdisc_bytes
    rank, world = dist.get_rank(), dist.get_world_size()
    quiet_rank(rank)
    net = current_network()
    rows = []
    ctxs = warm_up(strategies, points[0])
    for pt in points:
        B, L, H, D, dt = pt["B"], pt["L"], pt["H"], pt["D"], pt["dtype"]
        g = torch.Generator().manual_seed(hash((B, L, H, D)) % 2**31)
        S = L // world
        mine = slice(rank * S, (rank + 1) * S)
        if quick:
            q, k, v = (torch.randn(B, H, L, D, generator=g).to(DT[dt]) for _ in range(3))
            ref = reference(q[:, :, mine], k, v)
            q, k, v = (x[:, :, mine].contiguous() for x in (q, k, v))
        else:
            q, k, v = (torch.randn(B, H, S, D, generator=g).to(DT[dt]) for _ in range(3))
        res = {s: {"lat": [], "comp": [], "lat_cpu": [], "comp_cpu": []} for s in strategies}
        for ctx in ctxs.values():
            if isinstance(ctx, DiffusersLayer):
                ctx.set_inputs(q, k, v)
        malloc_for(memory=True)
        for s in strategies:
            ctx = ctxs[s]
            ctx.reset_stats()
            rss0 = _kb("VmRSS") - _peer_heap_rss()
            qd0 = qdisc_bytes(net) if net and rank == 0 else None
            dist.barrier()  # no rank sends before rank 0 has read the counters
            with AttendRecorder() as recd:
                out = ctx.attention(q, k, v)
            dist.barrier()
            qd1 = qdisc_bytes(net) if net and rank == 0 else None
            r = res[s]
            r["inter_bytes"] = all_max(ctx.stats()["inter_node_bytes"])
            r["qdisc_bytes"] = sum(qd1.values()) - sum(qd0.values()) if qd0 is not None else None
            if isinstance(ctx, DiffusersLayer):
                r["ran_as"] = r["ran"] = s
                r["ulysses"], r["calls"] = ctx.ulysses, ctx.calls
                r["formula_total_bytes"] = ctx.total_bytes()
                if quick:
                    r["err"] = all_max((out.double() - ref).abs().max().item())
                    r["bytes_ok"] = None
            else:
                _describe_ours(r, ctx, recd, B, L, H, D, dt, out, ref if quick else None,
                               quick, rank)
            del out
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS (persistent buffers stay in it)
            ctx.attention(q, k, v)  # steady state: no one-time transient allocations in the peak
            r["peak_rss"] = all_max(_kb("VmHWM") - _peer_heap_rss() - rss0)
        _time_point(res, ctxs, strategies, q, k, v, reps, quick, rank, pt)
        rows += _rows(res, strategies, pt, reps, quick)
        for ctx in ctxs.values():
            if isinstance(ctx, DiffusersLayer):
                ctx.clear_inputs()
    for c in ctxs.values():
        c.close()
    return rows


def _describe_ours(r: dict, ctx, recd: AttendRecorder, B: int, L: int, H: int, D: int, dt: str,
                   out: torch.Tensor, ref: torch.Tensor | None, quick: bool, rank: int) -> None:
    """What one of our strategies (or xFuser's usp) ran, into ``r``: strategy, Ulysses degree,
    replayable work, byte counts (with ``quick`` also its error and byte check)."""
    # what ran: the context's strategy (after its fallback), or the pick of a strategy
    # that chooses per shape (auto: its impl records ``choices``), on the pick's mesh
    mesh, ran, r["ran_as"] = ctx.mesh, get(ctx.strategy), ctx.strategy
    inner = getattr(ctx._impl, "choices", None)
    if inner:
        name, ulysses = list(inner.values())[-1]
        P = list(getattr(ctx._impl, "picked", {None: {}}).values())[-1].get("kv_pieces", 1)
        r["ran_as"] = f"{ctx.strategy}->{name}{f'[P={P}]' if P != 1 else ''}U{ulysses}"
        mesh = choose_mesh(ctx.topology, H, get(name).placement, ulysses)
        ran = get(name).resolve(mesh, log=False)
    r["ran"], r["ulysses"] = ran.name, mesh.ulysses
    # external groups (xFuser's USP) do not call ``attend``: replay its work from the mesh
    r["calls"] = usp_calls(mesh, B, L, H, D, DT[dt]) if ran.external_groups else recd.calls
    counted = counted_inter_node_elements(mesh, B, L, H, D, ran.ring)
    r["formula_total_bytes"] = sum(counted) * BYTES[dt]  # all ranks: compare with qdisc
    if ran.external_groups:  # e.g. xFuser's USP: its collectives bypass our byte counters
        r["inter_bytes"] = max(counted) * BYTES[dt]
    if quick:
        r["err"] = all_max((out.double() - ref).abs().max().item())
        if ran.external_groups:
            r["bytes_ok"] = None
        else:
            want = counted[rank] * BYTES[dt]
            r["bytes_ok"] = all_max(ctx.stats()["inter_node_bytes"] != want) == 0


def _time_point(res: dict, ctxs: dict, strategies: list[str], q, k, v, reps: int, quick: bool,
                rank: int, pt: dict) -> None:
    """``reps`` interleaved repetitions of every strategy's latency and compute-only replay."""
    if quick:
        return
    malloc_for(memory=False)
    comp_fns = {s: replay(res[s]["calls"]) for s in strategies}
    it = range(reps)
    for i in (tqdm(it, desc=f"{pt}", leave=False) if rank == 0 else it):
        n = i % len(strategies)  # each repetition starts one strategy later: no strategy
        for s in strategies[n:] + strategies[:n]:  # always runs first or after the same one
            for kind, fn in (("lat", lambda: ctxs[s].attention(q, k, v)), ("comp", comp_fns[s])):
                wall, cpu = timed_cpu(fn)
                res[s][kind].append(wall)
                res[s][kind + "_cpu"].append(cpu)


def _rows(res: dict, strategies: list[str], pt: dict, reps: int, quick: bool) -> list[dict]:
    rows = []
    for s in strategies:
        r = res[s]
        row = {**pt, "strategy": s, "ran_as": r["ran_as"], "ran": r["ran"], "ulysses": r["ulysses"],
               "inter_bytes": r["inter_bytes"],
               "qdisc_bytes": r["qdisc_bytes"], "formula_total_bytes": r["formula_total_bytes"],
               "peak_rss": r["peak_rss"], **({"options": row_options(s)} if row_options(s) else {})}
        if quick:
            row |= {"err": r["err"], "bytes_ok": r["bytes_ok"]}
        else:
            row |= {"latency_s": statistics.median(r["lat"]),
                    "compute_s": statistics.median(r["comp"]), "reps": reps,
                    "latency_reps_s": r["lat"], "compute_reps_s": r["comp"],
                    "latency_cpu_s": statistics.median(r["lat_cpu"]),
                    "compute_cpu_s": statistics.median(r["comp_cpu"])}
            row["exposed_s"] = row["latency_s"] - row["compute_s"]
        rows.append(row)
    return rows


def _predict(rows: list[dict], topo: Topology, link_mbit: float | None,
             hardware: str = "cpu-emulated") -> None:
    prof = get_profile(hardware, topo, link_mbit)
    for r in rows:
        if "latency_s" not in r or r["strategy"].startswith(DIFFUSERS):  # no model of diffusers'
            continue
        w = Workload(r["B"], r["L"], r["H"], r["D"], r["dtype"])
        p = predict(r["ran"], topo, w, prof, r["ulysses"], options=r.get("options"))
        r["predicted_s"] = p.latency_s
        r["predicted_compute_s"] = p.compute_s
        r["error_pct"] = 100 * (p.latency_s - r["latency_s"]) / r["latency_s"]


def markdown(rows: list[dict], quick: bool) -> str:
    if quick:
        head = "| topo | B | L | H | D | dtype | strategy | ran as | max abs err vs fp64 | bytes = counted |\n|---|---|---|---|---|---|---|---|---|---|\n"
        return head + "".join(
            f"| {r['topo']} | {r['B']} | {r['L']} | {r['H']} | {r['D']} | {r['dtype']} | {r['strategy']} | "
            f"{r['ran_as']} | {r['err']:.2e} | {r['bytes_ok']} |\n" for r in rows)
    usp = {(r["topo"], r["B"], r["L"], r["H"], r["D"], r["link"]): r["latency_s"] for r in rows if r["strategy"] == "usp"}
    head = ("| topo | link Mbit | B | L | H | D | strategy | ran as | latency ms | compute ms | exposed ms | "
            "speedup vs usp | inter MB/rank | qdisc / formula MB (all machines) | peak RSS MB | predicted ms | error % |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    out = []
    for r in rows:
        base = usp.get((r["topo"], r["B"], r["L"], r["H"], r["D"], r["link"]))
        pred = (f"{r['predicted_s'] * 1e3:.1f} | {r['error_pct']:+.0f}" if "predicted_s" in r
                else "- | -")
        qd = (f"{r['qdisc_bytes'] / 1e6:.2f} / {r['formula_total_bytes'] / 1e6:.2f}"
              if r["qdisc_bytes"] is not None else "-")
        out.append(f"| {r['topo']} | {r['link'] or 'loopback'} | {r['B']} | {r['L']} | {r['H']} | {r['D']} | "
                   f"{r['strategy']} | {r['ran_as']} | {r['latency_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
                   f"{r['exposed_s'] * 1e3:.1f} | {base / r['latency_s'] if base else float('nan'):.2f} | "
                   f"{r['inter_bytes'] / 1e6:.2f} | {qd} | {r['peak_rss'] / 1e6:.1f} | "
                   f"{pred} |\n")
    return head + "".join(out)


def _commit() -> str:
    """The checked-out commit (``-dirty`` with uncommitted changes to the package or scripts):
    what produced a table."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=Path(__file__).parent).stdout.strip()
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "-dirty" if git("status", "--porcelain", "-uno", "--", "../xfuser_swiftfusion", ".") else "")


def main() -> int:
    quiet_libraries()  # before the ranks load xFuser: the tables, not setup notices
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="equivalence + byte counts only (CI)")
    ap.add_argument("--topologies", default=None)
    ap.add_argument("--seq", default=None, help="global sequence lengths")
    ap.add_argument("--head-dims", default=None)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=sorted(DT))
    ap.add_argument("--strategies", default=",".join(names()))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--diffusers", action="store_true",
                    help="add diffusers' ulysses / ring / unified rows (those valid per topology)")
    add_link_argument(ap)
    ap.add_argument("--hardware", default="cpu-emulated", metavar="NAME|PATH",
                    help="cost-model profile of the predictions and of auto's pick (a file: "
                         f"from swiftfusion calibrate; sets ${HARDWARE_ENV})")
    ap.add_argument("--out", default=None,
                    help="result path; .json is added (default: benchmarks/results/layer-<time>)")
    ap.add_argument("--islands", action="store_true",
                    help="each NxM topology is one host of N islands (sockets) of M GPUs, found "
                         "from its emulated NVML; --link-mbit shapes the link between islands")
    ap.add_argument("--usp-splits", action="store_true",
                    help="also usp at every other Ulysses x Ring split (usp@U<d>), each in a "
                         "launch of its own (xFuser's state exists once per process)")
    ap.add_argument("--kv-pieces", default=None, metavar="P,P,...",
                    help="each strategy with option kv_pieces (torus) once per value, rows "
                         "torus[P=<p>] (P = 1: torus)")
    a = ap.parse_args()
    if a.hardware != "cpu-emulated":
        get_profile(a.hardware)  # a bad name or file fails here, not in the ranks
        os.environ[HARDWARE_ENV] = a.hardware  # auto's profile in every forked rank
    if a.reps < 5 and not a.quick:
        ap.error("--reps must be >= 5 (medians)")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    topos = (a.topologies or ("2x2,4x1" if a.quick else "4x1,4x2")).split(",")
    seqs = ints(a.seq or ("96" if a.quick else "8192"))
    dims = ints(a.head_dims or ("32" if a.quick else "64"))
    heads = a.heads or (12 if a.quick else 16)
    dtype = a.dtype or ("fp32" if a.quick else "bf16")
    strategies = a.strategies.split(",")
    if a.kv_pieces:
        strategies = [row_name(s, {"kv_pieces": P}) if "kv_pieces" in get(split_name(s)[0]).program_options
                      else s for s in strategies for P in ints(a.kv_pieces)]
        strategies = list(dict.fromkeys(strategies))  # strategies without the option: once
    link = link_from_args(a)
    rows: list[dict] = []
    t0 = time.time()
    for topo_s in topos:
        topo = Topology.parse(topo_s)
        points = [dict(topo=topo_s, link=a.link_mbit, tcp_queue_kb=a.tcp_queue_kb, B=b, L=L - L % topo.world_size, H=heads, D=d, dtype=dtype)
                  for L in seqs for d in dims for b in ints(a.batches)]
        rows_here = strategies
        if a.diffusers:
            diffusers_backend.register()  # imports diffusers once, before the ranks fork
            valid = [c for c in DIFFUSERS_CONFIGS
                     if diffusers_degrees(c, topo, heads, lse_backend=True) is not None]
            skipped = [c for c in DIFFUSERS_CONFIGS if c not in valid]
            if skipped:
                print(f"{topo_s}: skipped diffusers' {', '.join(skipped)} with {heads} heads "
                      "(ulysses: heads % ranks == 0; unified: 1 < GPUs per machine < ranks, "
                      "heads % GPUs per machine == 0)", file=sys.stderr)
            rows_here = strategies + [DIFFUSERS + c for c in valid]
        load0 = os.getloadavg()
        res = run_emulated(_rank_main, topo, points, rows_here, a.reps, a.quick,
                           timeout_s=7200, link=link, islands=a.islands)[0]
        if a.usp_splits and "usp" in strategies:
            import math as _m
            g = _m.gcd(topo.world_size, heads)
            for d in [d for d in range(1, g) if g % d == 0]:
                res += run_emulated(_rank_main, topo, points, [f"usp@U{d}"], a.reps, a.quick,
                                    timeout_s=7200, link=link, islands=a.islands)[0]
        for r in res:
            r["world"] = topo.world_size
        for r in res:  # other processes on the host: 1-min load average before / after
            r["loadavg_1m"] = [round(load0[0], 1), round(os.getloadavg()[0], 1)]
        _predict(res, topo, a.link_mbit, a.hardware)
        rows += res
    cmd = " ".join([os.path.relpath(sys.executable), *sys.argv])
    md = markdown(rows, a.quick)
    print(f"`{cmd}` ({time.time() - t0:.0f} s)\n\n{md}")
    limits = {}   # per topology: add_limits' summary (the rows gain its fields)
    if a.islands and a.link_mbit and not a.quick:
        for topo_s in topos:
            print(f"\n{topo_s} as one host of islands, {a.link_mbit:g} Mbit/s between them:\n")
            here = [r for r in rows if r["topo"] == topo_s]
            print(limits_table(here, a.link_mbit, Topology.parse(topo_s).nodes))
            limits[topo_s] = add_limits(here, a.link_mbit, Topology.parse(topo_s).nodes)
    if a.quick:
        bad = [r for r in rows if r["bytes_ok"] is False or r["err"] > (1e-5 if dtype == "fp32" else 3e-2)]
        if bad:
            print(f"FAILED: {len(bad)} rows", file=sys.stderr)
            return 1
        return 0
    out = Path(a.out) if a.out else RESULTS / f"layer-{time.strftime('%Y%m%d-%H%M%S')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    path = out.with_suffix(".json")
    with open(path, "w") as f:
        json.dump({"command": cmd, "commit": commit, "cpu": host_cpu(), "rows": rows,
                   **({"limits": limits} if limits else {})}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
