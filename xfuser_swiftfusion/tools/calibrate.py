"""``swiftfusion calibrate``: measure this cluster's rates and write a hardware profile.

Runs on every rank at once, as a layer does (under torchrun on GPUs: NCCL and NVSHMEM through
the project's communicators; or ``--emulate NxM [--link-mbit R]`` on forked CPU ranks), every
figure the median over ``reps`` repetitions of the slowest rank's time:

- transfers, each kind the strategies use (``ops.KINDS``) within a machine and across
  machines (on one host cut into islands from NVML, ``hwtopo.py``: within an island and
  across islands; the profile then records its ``island_gpus`` and peer-to-peer): the grouped exchange (``TwoSided.exchange``), xFuser's collectives
  (``all_to_all_single``, ``all_gather_into_tensor``), one-sided ``get`` and ``put``
  (``OneSided``): every rank sends to the next rank of its machine / to its peer on the next
  machine and receives from the previous one; a tiny message gives the latency, a large one
  (sized to take ~0.3 s) the bandwidth: per GPU within a machine, per machine link across
  machines (all its GPUs at once); the collectives across machines run on each local index's
  ranks of every machine (each machine sending to all others at once) and, with 3 or more
  machines, on every rank of two machines (``inter1``: the rate of a group spanning two, as
  xFuser's Ulysses groups often do; its bytes across machines over the time); the host's cost
  of issuing a call; on a shared host (CPU ranks) the CPU time a byte costs (process CPU of
  every rank over the bytes moved);
- ``barrier_all`` and a machine's ``barrier`` / ``sync``;
- the local attention kernel (``kernels.attend``) at head dims x dtypes x query/key lengths
  (a grid, plus the exact calls the schedules launch for ``--workload``s), its cost per
  merged element and per call; local copies.

On a shared host (CPU ranks) compute rates are stored per core (``host_cores``), so the
timeline shares the cores among the ranks as the host does. Output: a table and the profile
file (``hardware.py``), for ``--hardware PATH`` / ``SWIFTFUSION_HARDWARE=PATH``.

``--links p4de|p5|h100-ndr``: one GPU instead, no peers (``calibrate_gpu.py``): this code's
costs on it and the links of that built-in profile.
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..hardware import FANOUT_1, LOCALITIES, MACHINES, HardwareProfile, Rate, host_cpu, save_profile
from ..strategies.ops import KINDS, Attend
from ..topology import Topology

COLLECTIVES = ("all_to_all", "all_gather")  # measured also between two machines (FANOUT_1)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRID_Q = (256, 1024, 4096)
GRID_K = (256, 1024, 4096, 16384)
TARGET_S = 0.3      # a bandwidth transfer's duration
ATTEND_FLOP = {"cpu": 2e9, "cuda": 2e11}  # FLOP of one timed attend call (CPU: ~20 ms)


@dataclass
class CalibrateConfig:
    head_dims: tuple[int, ...] = (32, 64, 128)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    workloads: tuple[tuple, ...] = ()   # (B, L, H, D, dtype): exact calls of every candidate
    reps: int = 3
    budget_s: float = 120.0
    quick: bool = False                 # tiny sizes and grid (tests)
    comm: str = "auto"
    topology: str | None = None
    timeout_s: float = 120.0


@dataclass
class Raw:
    """What the ranks measured (rank 0's copy, medians over ranks where per-rank)."""

    topology: str
    device: str
    device_type: str
    backend: str
    world: int
    cores: int
    transfers: dict = field(default_factory=dict)   # kind -> locality -> {bw, latency_s, cpu_s_per_byte}
    attention: dict = field(default_factory=dict)   # dtype -> D -> [(lq, lk, flops)]
    barrier_s: float = 0.0
    sync_s: float = 0.0
    attend_call_s: float = 0.0
    transfer_call_s: float = 0.0
    merge_s_per_elem: float = 0.0
    copy_bw: float = 0.0
    one_sided_depth: int = 1
    skipped: list = field(default_factory=list)
    elapsed_s: float = 0.0
    island_gpus: int | None = None      # one host cut into islands from NVML: GPUs per island
    p2p: bool = True                    # NVML: GPU peer-to-peer on between every pair of a host
    islands: str = ""                   # what NVML found (hwtopo's description)


# --- timing --------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(x: float, op=dist.ReduceOp.MAX) -> float:
    """``x`` reduced over every rank (on the rank's GPU under NCCL, which reduces no CPU
    tensors)."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) \
        else torch.device("cpu")
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


class _Clock:
    """Timed calls of every rank together; the budget shared (every rank decides alike)."""

    def __init__(self, device: torch.device, reps: int, budget_s: float) -> None:
        self.device, self.reps, self.budget_s = device, reps, budget_s
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return _reduce(time.monotonic() - self.t0)

    def time(self, fn, reps: int | None = None, cpu: bool = False) -> tuple[float, float]:
        """Median over repetitions of the slowest rank's seconds (after a warm-up), and the
        process CPU seconds of every rank summed (median)."""
        fn()
        _sync(self.device)
        walls, cpus = [], []
        for _ in range(reps or self.reps):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            _sync(self.device)
            wall, used = time.perf_counter() - t0, time.process_time() - c0
            walls.append(_reduce(wall))
            cpus.append(_reduce(used, dist.ReduceOp.SUM) if cpu else used)
        return statistics.median(walls), statistics.median(cpus)


# --- transfers -----------------------------------------------------------------------------

def peers(topo: Topology, rank: int) -> dict[str, tuple[int, int]]:
    """``rank``'s (next, previous) peer within its machine (``"intra"``; an island of one host
    where the topology came from the hardware) and on the next / previous machine at its
    own position (``"inter"``), where there is one."""
    M, N = topo.gpus_per_node, topo.nodes
    t, i = divmod(topo.slot_of(rank), M)
    at = lambda m, j: topo.rank_at((m % N) * M + j % M)  # noqa: E731
    out = {}
    if M > 1:
        out["intra"] = (at(t, i + 1), at(t, i - 1))
    if N > 1:
        out["inter"] = (at(t + 1, i), at(t - 1, i))
    return out


class _Transfers:
    """Every transfer kind within / across machines on this rank (module docstring)."""

    def __init__(self, topo: Topology, device: torch.device, clock: _Clock, cfg: CalibrateConfig,
                 one_sided: bool = True) -> None:
        from ..comm import make_one_sided, make_two_sided
        self.topo, self.device, self.clock, self.cfg = topo, device, clock, cfg
        rank, W, M, N = dist.get_rank(), topo.world_size, topo.gpus_per_node, topo.nodes
        self.rank = rank
        t, i = divmod(topo.slot_of(rank), M)   # machine (or island) t, its i-th rank
        machines = topo.machines()
        node_of = [topo.node_of(x) for x in range(W)]
        self.peers = peers(topo, rank)
        # collective groups: each machine's ranks, each local index across machines
        self.groups = {}
        for m in range(N):
            g = dist.new_group(sorted(machines[m]))
            if m == t:
                self.groups["intra"] = g
        for j in range(M):
            g = dist.new_group(sorted(machines[m][j] for m in range(N)))
            if j == i:
                self.groups["inter"] = g
        # with 3+ machines, collectives over every rank of two machines (2m, 2m + 1), the
        # shape of a Ulysses group spanning two (an odd machine out idles)
        self.pairs = N >= 3
        for m in range(N // 2 if self.pairs else 0):
            g = dist.new_group(sorted(machines[2 * m] + machines[2 * m + 1]))
            if t // 2 == m:
                self.groups[FANOUT_1] = g
        self.two = make_two_sided(rank=rank, world_size=W, node_of=node_of, timeout_s=cfg.timeout_s)
        self.machine = machines[t]
        self.one = None  # without GPU peer-to-peer there is no one-sided communicator
        if one_sided:
            self.one = make_one_sided(cfg.comm, rank=rank, world_size=W, node_of=node_of,
                                      timeout_s=cfg.timeout_s)
            self.one.prepare_groups(machines)
        self.shared_host = device.type == "cpu"

    def close(self) -> None:
        if self.one is not None:
            self.one.barrier_all(what="calibrate end")
            self.one.close()
        self.two.close()

    # a transfer of n elements (fp32 on CPU, bf16 on GPU: the sizes layers move), per kind
    def _op(self, kind: str, loc: str, n: int):
        dev, dtype = self.device, torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if kind in ("get", "put"):
            buf = self.one.symmetric_empty((2, n), dtype)
            buf.zero_()
            nxt, prv = self.peers[loc]
            if kind == "get":
                return lambda: self.one.get(buf[1], buf[0], prv, queue="other", what="calibrate").wait()
            return lambda: self.one.put(buf[1], buf[0], nxt, queue="other", what="calibrate").wait()
        if kind == "exchange":
            nxt, prv = self.peers[loc]
            s, r = torch.zeros(n, dtype=dtype, device=dev), torch.empty(n, dtype=dtype, device=dev)
            return lambda: self.two.exchange([(s, nxt)], [(r, prv)], what="calibrate").wait()
        group = self.groups.get(loc)
        if group is None:  # the machine left out of the pairs (FANOUT_1)
            return lambda: None
        G = dist.get_world_size(group)
        if kind == "all_to_all":
            s, r = torch.zeros(G * n, dtype=dtype, device=dev), torch.empty(G * n, dtype=dtype, device=dev)
            return lambda: dist.all_to_all_single(r, s, group=group)
        s, r = torch.zeros(n, dtype=dtype, device=dev), torch.empty(G * n, dtype=dtype, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(r, s, group=group)

    def _sent(self, kind: str, loc: str, n: int) -> int:
        """Elements one rank sends to others in one call."""
        if loc == FANOUT_1:  # what crosses machines: n to (from) each rank of the other
            return n * self.topo.gpus_per_node
        if kind in COLLECTIVES:
            return n * (dist.get_world_size(self.groups[loc]) - 1)
        return n

    def measure(self, kind: str, loc: str) -> dict:
        """``bw`` (per GPU within a machine, per machine link across), ``latency_s``,
        ``cpu_s_per_byte`` (shared host). The large transfer grows until it takes ~TARGET_S
        (every rank sees the same slowest time, so all size it alike)."""
        itemsize = 4 if self.device.type == "cpu" else 2
        lat, _ = self.clock.time(self._op(kind, loc, 1), self.clock.reps * 2)
        cap = 1 << (18 if self.cfg.quick else 22 if self.device.type == "cpu" else 26)
        target = TARGET_S / (10 if self.cfg.quick else 1)
        n = 1 << 12
        while True:
            t, _ = self.clock.time(self._op(kind, loc, n), 1)
            if n >= cap or t >= target / 2:
                break
            n = min(cap, n * max(2, min(16, int(target / max(t, 1e-6)))))
        t, cpu = self.clock.time(self._op(kind, loc, n), cpu=True)
        sent = self._sent(kind, loc, n) * itemsize
        per_rank = sent / max(t - lat, t / 2)
        N, M = self.topo.nodes, self.topo.gpus_per_node
        out = {"bw": per_rank * (1 if loc == "intra" else M), "latency_s": lat, "bytes": sent,
               "seconds": t}
        if self.shared_host:
            senders = N // 2 * 2 * M if loc == FANOUT_1 else self.topo.world_size
            out["cpu_s_per_byte"] = cpu / (sent * senders)
        return out

    def depth(self) -> int:
        """One-sided transfers one queue keeps moving at once: two gets of equal size from two
        other machines, back to back; the first done by ~half the time: one (FIFO), later:
        two (they share the link). Needs 3 machines; else 1."""
        N, M = self.topo.nodes, self.topo.gpus_per_node
        if N < 3 or self.one is None:
            return 1
        t, i = divmod(self.topo.slot_of(self.rank), M)
        n = 1 << (14 if self.cfg.quick else 20)
        buf = self.one.symmetric_empty((3, n), torch.float32)
        buf.zero_()
        peers = [self.topo.rank_at(((t + k) % N) * M + i) for k in (1, 2)]
        ratios = []
        for _ in range(self.clock.reps):
            self.one.barrier_all(what="calibrate depth")
            t0 = time.perf_counter()
            hs = [self.one.get(buf[1 + j], buf[0], p, queue="other", what="calibrate depth")
                  for j, p in enumerate(peers)]
            hs[0].wait()
            _sync(self.device)
            t1 = time.perf_counter() - t0
            hs[1].wait()
            _sync(self.device)
            ratios.append(t1 / (time.perf_counter() - t0))
        mean = _reduce(statistics.median(ratios), dist.ReduceOp.SUM) / dist.get_world_size()
        return 2 if mean > 0.75 else 1

    def issue_cost(self) -> float:
        """Host seconds to issue one transfer (tiny exchanges issued back to back)."""
        loc = "intra" if "intra" in self.peers else "inter"
        nxt, prv = self.peers[loc]
        s, r = torch.zeros(1, device=self.device), torch.empty(16, 1, device=self.device)

        def issue():
            hs = [self.two.exchange([(s, nxt)], [(r[j], prv)], what="calibrate") for j in range(16)]
            for h in hs:
                h.wait()
        t, _ = self.clock.time(issue)
        tiny, _ = self.clock.time(lambda: self.two.exchange([(s, nxt)], [(r[0], prv)], what="calibrate").wait())
        return max(t - tiny, 0.0) / 15

    def barriers(self) -> tuple[float, float]:
        if self.one is None:  # two-sided barriers stand in (no one-sided strategy runs here)
            b, _ = self.clock.time(dist.barrier, self.clock.reps * 2)
            return b, b
        b, _ = self.clock.time(lambda: self.one.barrier_all(what="calibrate"), self.clock.reps * 2)
        s, _ = self.clock.time(lambda: self.one.sync(self.machine, what="calibrate"), self.clock.reps * 2)
        return b, s


# --- attention -----------------------------------------------------------------------------

def _attend_fn(device, dtype: str, D: int, bh: int, q: tuple[int, ...], kv: tuple[int, ...]):
    from ..kernels import attend, new_state
    g = torch.Generator().manual_seed(0)
    make = lambda n: torch.randn(1, bh, n, D, generator=g).to(device=device, dtype=DTYPES[dtype])  # noqa: E731
    qs = [make(n) for n in q]
    kvs = [(make(n), make(n)) for n in kv]
    states = [new_state(x) for x in qs]
    return lambda: attend(qs, kvs, states, scale=D ** -0.5)


def _bh_for(device, lq: int, lk: int, D: int, bh: int | None = None) -> int:
    """Rows of heads of a timed call: the real ``bh`` on GPUs, else sized to ~ATTEND_FLOP."""
    fit = max(1, int(ATTEND_FLOP[device.type] / (4 * lq * lk * D)))
    return bh if bh is not None and device.type == "cuda" else min(fit, bh or fit, 64)


def _attention(clock: _Clock, cfg: CalibrateConfig, device, merge: float, call: float,
               skipped: list) -> dict:
    """FLOP/s of attend calls: the grid, then the exact calls of ``cfg.workloads``, each net of
    its merge and call cost (as ``HardwareProfile.attend_s`` adds them back)."""
    qs, ks = ((256, 1024), (256, 1024)) if cfg.quick else (GRID_Q, GRID_K)
    points = [(dt, D, (lq,), (lk,), None) for dt in cfg.dtypes for D in cfg.head_dims
              for lq in qs for lk in ks]
    points += _workload_calls(cfg)
    out: dict = {}
    for dt, D, q, kv, bh in points:
        if clock.elapsed() > cfg.budget_s:
            skipped.append(f"attend {dt} D{D} q{sum(q)} k{sum(kv)}")
            continue
        lq, lk = sum(q), sum(kv)
        b = _bh_for(device, lq, lk, D, bh)
        t, _ = clock.time(_attend_fn(device, dt, D, b, q, kv), max(1, clock.reps - 1))
        net = max(t - call - b * lq * D * merge, t * 0.05)
        out.setdefault(dt, {}).setdefault(D, {})[(lq, lk)] = 4 * b * lq * lk * D / net
    return {dt: {D: [(lq, lk, f) for (lq, lk), f in sorted(pts.items())] for D, pts in t.items()}
            for dt, t in out.items()}


def _workload_calls(cfg: CalibrateConfig) -> list[tuple]:
    """The distinct attend calls every candidate (strategy x Ulysses degree) launches for each
    workload ``(B, L, H, D, dtype)``: ``(dtype, D, q chunks, kv chunks, B*h)``."""
    if not cfg.workloads:
        return []
    from ..cost_model import Workload, _mesh, programs, ulysses_degrees
    from ..strategies.registry import modelled
    topo = Topology.parse(cfg.topology)
    calls = {}
    for B, L, H, D, dt in cfg.workloads:
        w = Workload(B, L - L % topo.world_size, H, D, dt)
        for deg in ulysses_degrees(topo, H):
            for spec in modelled():
                mesh, runs, w2 = _mesh(spec, topo, w, deg, False)
                for op in programs(runs, mesh, w2)[0]:
                    if isinstance(op, Attend) and op.kv:
                        calls[(dt, D, sum(op.q), sum(op.kv))] = (dt, D, op.q, op.kv, op.bh)
    return list(calls.values())


def _kernel_costs(clock: _Clock, device, dtype: str) -> tuple[float, float, float]:
    """(host cost of one attend call, seconds per merged output element, copy bytes/s)."""
    D, bh = 64, 8
    n = 16
    fns = [_attend_fn(device, dtype, D, 1, (16,), (16,)) for _ in range(n)]
    t, _ = clock.time(lambda: [f() for f in fns])
    call = t / n
    small, _ = clock.time(_attend_fn(device, dtype, D, bh, (64,), (16,)))
    big, _ = clock.time(_attend_fn(device, dtype, D, bh, (4096,), (16,)))
    merge = max(big - small, 0.0) / (bh * (4096 - 64) * D)
    x = torch.empty(4 << 20 if device.type == "cpu" else 64 << 20, device=device)
    y = torch.empty_like(x)
    c, _ = clock.time(lambda: y.copy_(x))
    return call, merge, x.numel() * 4 / c


# --- the ranks -----------------------------------------------------------------------------

def _rank_main(cfg: CalibrateConfig) -> dict | None:
    from ..distributed import init_distributed_from_env
    from ..topology import detect_topology
    device = init_distributed_from_env()
    topo = detect_topology(dist.get_world_size(), cfg.topology)
    cfg = replace(cfg, topology=str(topo))
    clock = _Clock(device, cfg.reps, cfg.budget_s)
    raw = Raw(str(topo), torch.cuda.get_device_name(device) if device.type == "cuda" else host_cpu(),
              device.type, dist.get_backend(), topo.world_size, len(os.sched_getaffinity(0)))
    from ..hwtopo import last_detection
    found = last_detection()
    if found is not None:
        raw.islands, raw.p2p = found.description, not found.p2p_off
        if found.hosts == 1 and found.islands_per_host > 1:
            raw.island_gpus = topo.gpus_per_node
    tr = _Transfers(topo, device, clock, cfg, one_sided=raw.p2p)
    if not raw.p2p:
        raw.skipped.append("one-sided get/put (no GPU peer-to-peer: swiftfusion is refused here)")
    try:
        for loc in LOCALITIES:
            if loc not in tr.peers:
                raw.skipped.append(f"{loc}-machine transfers (no such peer on {topo})")
                continue
            for kind in KINDS:
                if tr.one is not None or kind not in ("get", "put"):
                    raw.transfers.setdefault(kind, {})[loc] = tr.measure(kind, loc)
        if tr.pairs:  # every rank alike: the measurements are collective
            for kind in COLLECTIVES:
                raw.transfers[kind][FANOUT_1] = tr.measure(kind, FANOUT_1)
        raw.transfer_call_s = tr.issue_cost() if tr.peers else 0.0
        raw.barrier_s, raw.sync_s = tr.barriers()
        raw.one_sided_depth = tr.depth()
    finally:
        tr.close()
    dt = cfg.dtypes[0]
    raw.attend_call_s, raw.merge_s_per_elem, raw.copy_bw = _kernel_costs(clock, device, dt)
    raw.attention = _attention(clock, cfg, device, raw.merge_s_per_elem, raw.attend_call_s, raw.skipped)
    raw.elapsed_s = clock.elapsed()
    return raw.__dict__ if dist.get_rank() == 0 else None


# --- the profile ---------------------------------------------------------------------------

def build_profile(raw: dict, name: str, command: str, link_mbit: float | None = None) -> HardwareProfile:
    """A profile from what the ranks measured (on CPU ranks: compute per core, intra-machine
    transfers limited by the CPU they cost)."""
    topo = Topology.parse(raw["topology"])
    W, cpu = topo.world_size, raw["device_type"] == "cpu"
    cores = float(raw["cores"]) if cpu else None
    per_core = max(1.0, W / cores) if cpu else 1.0   # ranks per core while all computed
    measured = raw["transfers"]
    issue = raw["transfer_call_s"]  # the timeline adds it before each transfer's latency
    def link(m: dict) -> Rate:
        """A measured link's rate: its bandwidth, latency and (shared host) CPU per byte."""
        return Rate(m["bw"], max(m["latency_s"] - issue, 0.0),
                    m.get("cpu_s_per_byte", 0.0) if cpu else 0.0)

    transfers = {}
    for kind in KINDS:
        got = measured.get(kind, {})
        rates = {}
        for loc in LOCALITIES:
            m = got.get(loc) or got.get("inter" if loc == "intra" else "intra")
            if m is None:  # one rank: nothing to measure, nothing to move
                rates[loc] = Rate(math.inf, 0.0)
            elif cpu and loc == "intra" and loc in got:  # CPU-bound: the cores it takes
                rates[loc] = Rate(math.inf, max(m["latency_s"] - issue, 0.0),
                                  min(cores, W) / (W * m["bw"]))
            else:
                rates[loc] = link(m)
        if FANOUT_1 in got:
            rates[FANOUT_1] = link(got[FANOUT_1])
        transfers[kind] = rates
    attention = {dt: {int(D): tuple((lq, lk, f * per_core) for lq, lk, f in pts)
                      for D, pts in t.items()} for dt, t in raw["attention"].items()}
    return HardwareProfile(
        name=name, transfers=transfers, attention=attention, attention_bh=0,
        barrier_s=raw["barrier_s"], sync_s=raw["sync_s"], attend_call_s=raw["attend_call_s"],
        transfer_call_s=raw["transfer_call_s"], merge_s_per_elem=raw["merge_s_per_elem"] / per_core,
        copy_bw=raw["copy_bw"] * per_core, host_cores=cores, host_waits=cpu,
        two_sided_fifo="nccl" in raw["backend"], inter_gpu_bw=None,
        one_sided_depth=raw.get("one_sided_depth", 1),
        p2p=raw.get("p2p", True), island_gpus=raw.get("island_gpus"),
        source=f"swiftfusion calibrate on {raw['topology']} {raw['device']}"
               + (f" (one host in islands: {raw['islands']})" if raw.get("island_gpus") else ""),
        measured={"command": command, "topology": raw["topology"], "device": raw["device"],
                  "backend": raw["backend"], "host": socket.gethostname(), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "link_mbit": link_mbit,
                  "seconds": round(raw["elapsed_s"], 1), "skipped": raw["skipped"]})


def _si(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "CPU-bound"
    for f, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= f:
            return f"{x / f:.2f} {p}{unit}"
    return f"{x:.2f} {unit}"


def format_table(prof: HardwareProfile, raw: dict, link_mbit: float | None) -> str:
    """The measured rates, one line per transfer kind and locality, then the rest."""
    lines = [f"{'transfer':<12} {'where':<6} {'bandwidth':>14} {'latency':>10} {'CPU ns/B':>9}"
             + ("   vs link" if link_mbit else "")]
    wire = link_mbit * 1e6 / 8 if link_mbit else None
    for kind in KINDS:
        for loc in (*LOCALITIES, FANOUT_1):
            m = raw["transfers"].get(kind, {}).get(loc)
            if m is None:
                continue
            r = prof.transfers[kind][loc]
            bw = m["bw"]
            vs = f"   {100 * (bw / wire - 1):+.0f} %" if wire and loc != "intra" else ""
            per = "/s per machine" if loc != "intra" else "/s per rank"
            lines.append(f"{kind:<12} {loc:<6} {_si(bw, 'B') + per:>14} {m['latency_s'] * 1e6:>8.0f} us "
                         f"{r.cpu_s_per_byte * 1e9:>9.2f}{vs}")
    lines.append(f"barrier {prof.barrier_s * 1e6:.0f} us, sync {prof.sync_s * 1e6:.0f} us; one-sided queue "
                 f"depth {prof.one_sided_depth}; host cost per "
                 f"call: attend {prof.attend_call_s * 1e6:.0f} us, transfer {prof.transfer_call_s * 1e6:.0f} us; "
                 f"merge {raw['merge_s_per_elem'] * 1e9:.2f} ns/element; copies {_si(raw['copy_bw'], 'B/s')}")
    per_core = " per core" if prof.host_cores else ""
    for dt, t in prof.attention.items():
        cells = []
        for D in sorted(t):
            f = prof.flops(dt, D, 1024, 4096)
            cells.append(f"D{D} {f / 1e9:.0f}")
        lines.append(f"attention {dt} GFLOP/s{per_core} at 1024 x 4096: " + ", ".join(cells)
                     + f" ({sum(len(p) for p in t.values())} points)")
    if raw["skipped"]:
        lines.append(f"not measured: {'; '.join(raw['skipped'][:4])}"
                     + (f" and {len(raw['skipped']) - 4} more" if len(raw["skipped"]) > 4 else ""))
    if raw.get("island_gpus"):
        lines.append(f"one host in islands (intra: inside one, inter: across): {raw['islands']}")
    lines.append(f"{raw['elapsed_s']:.0f} s on {raw['topology']} ({raw['device']}, {raw['backend']})")
    return "\n".join(lines)


def parse_workload(text: str) -> tuple:
    """``B,L,H,D[,dtype]``."""
    parts = text.split(",")
    if len(parts) not in (4, 5):
        raise ValueError(f"--workload {text!r}: want B,L,H,D[,dtype]")
    return (*map(int, parts[:4]), parts[4] if len(parts) == 5 else "bf16")


def add_arguments(p) -> None:
    """Flags of ``swiftfusion calibrate`` besides the cluster flags (``--emulate``,
    ``--link-mbit``, ``--topology``)."""
    p.add_argument("--out", default="hardware.json", help="profile file to write")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--head-dims", default="32,64,128")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--workload", action="append", default=[], metavar="B,L,H,D[,dtype]",
                   help="also measure the exact attention calls the schedules launch for this "
                        "layer (repeatable)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=100.0,
                   help="seconds; attention points left after it are interpolated")
    p.add_argument("--comm", default="auto", help="one-sided communicator (auto: nvshmem on GPUs)")
    p.add_argument("--quick", action="store_true", help="small sizes and grid (a smoke test)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-wait timeout in seconds")
    g = p.add_argument_group("one GPU (calibrate_gpu.py): this code's costs on this GPU, the links "
                             "of a built-in profile")
    g.add_argument("--links", choices=sorted(MACHINES), default=None,
                   help="measure one GPU (no torchrun): kernel rates over the Torus launch shapes "
                        "and --dtypes, host cost per call and per transfer (the replay), copies, "
                        "xFuser USP's compute; links, barriers and NIC shares of this profile")
    g.add_argument("--allow-cpu", action="store_true",
                   help="with --links and no CUDA device: the CPU stand-ins, to try the command")


def _cmd_one_gpu(args) -> int:
    from .calibrate_gpu import calibrate_one_gpu
    if args.emulate:
        raise ValueError("--links measures one GPU in this process; it takes no --emulate")
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    prof, table = calibrate_one_gpu(args.links, args.out, name, tuple(args.dtypes.split(",")),
                                    args.quick, args.allow_cpu)
    save_profile(prof, args.out)
    print(table)
    print(f"wrote {args.out} (use: --hardware {args.out} or SWIFTFUSION_HARDWARE={args.out})")
    return 0


def cmd_calibrate(args) -> int:
    if args.links:
        return _cmd_one_gpu(args)
    from ..emulation.netns import link_from_args
    cfg = CalibrateConfig(tuple(int(x) for x in args.head_dims.split(",")),
                          tuple(args.dtypes.split(",")),
                          tuple(parse_workload(w) for w in args.workload), args.reps, args.budget,
                          args.quick, args.comm, args.emulate or args.topology, args.timeout)
    bad = [d for d in cfg.dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtypes: unknown {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    command = " ".join(["swiftfusion", *sys.argv[1:]]) if sys.argv[0].endswith("swiftfusion") \
        else " ".join(sys.argv)
    if args.emulate:
        from ..emulation.launcher import run_emulated
        raw = run_emulated(_rank_main, args.emulate, cfg, timeout_s=max(600.0, 4 * cfg.budget_s),
                           link=link_from_args(args))[0]
    else:
        raw = _rank_main(cfg)
        if raw is None:
            return 0
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    prof = build_profile(raw, name, command, args.link_mbit if args.emulate else None)
    save_profile(prof, args.out)
    print(format_table(prof, raw, args.link_mbit if args.emulate else None))
    print(f"wrote {args.out} (use: --hardware {args.out} or SWIFTFUSION_HARDWARE={args.out})")
    return 0


__all__ = ["CalibrateConfig", "add_arguments", "build_profile", "cmd_calibrate", "format_table",
           "parse_workload", "peers"]
