"""Latency model of one attention layer for every strategy, as the code runs it.

Inputs: topology (N machines x M GPUs), ``Workload`` (B, L, H, D, dtype), mesh degrees, and a
``HardwareProfile``. Output: ``Prediction`` (seconds per attention layer, with a breakdown).

What is modelled (one representative rank; schedules are symmetric, bytes use the rank with the
most inter-machine traffic). ``X = B*L*H*D / (N*M)`` elements per tensor per rank, ``e`` bytes
per element, ``h = H / P_u`` heads after the Ulysses all-to-all, ``c(Lq, Lk)`` one ``attend``:

- ``usp`` (xFuser's USP): blocking all-to-alls of Q, K, V over the contiguous Ulysses group, then
  torch's ``_templated_ring_attention`` over the strided Ring group, whose default rotation
  all-gathers K/V once (issued at step 0, waited at step 1: hidden only behind step 0), then
  the O all-to-all back.
- ``tas``: the same steps on the swapped placement; all-to-alls blocking (cross-machine), the
  two-sided ``PassRing`` overlaps each step's K/V pass with that step's compute:
  ``(R-1) * max(c, comm) + c``.
- ``torus``: intra-machine scatter (blocking), every inter-machine Q then K/V transfer issued at
  once (two-sided: one FIFO per peer, peers share the link fairly), then ``T`` Pull-Q stages
  (ring of U*S queries over K[t], re-traversed every stage), ``T-1`` Pull-KV stages (ring of
  T*U*S queries over K[t']; the last one per block of U*S queries, each remote block's output
  sent as soon as it is final, the local block last), Push-O sends overlapping the rest.
- ``swiftfusion``: the same stages over one-sided transfers: one FIFO get queue (stage k's data
  arrives in issue order), a ring-group barrier per Pull-KV stage, two global barriers, no
  per-message rendezvous.

Communication on a shared host (the CPU emulation) also costs CPU time that compute cannot
hide: ``comm_cpu_bw`` bytes/s of CPU work, of which ``1 - overlap`` is added to compute when it
runs concurrently. GPUs: ``comm_cpu_bw = inf``.

Inter-machine bytes per rank equal ``topology.counted_inter_node_elements`` (checked by
``inter_node_elements`` and tests/test_cost_model.py).

Zero-padded heads (``mesh.torus_mesh``, ``strategies/padded.py``): a strategy that needs the
Torus schedule, at the default degree, on a mesh that is not torus-ready runs on ``H'`` heads
as ``init_sequence_parallel`` runs it (unless ``pad_heads=False``): every term above uses
``H'`` (compute and bytes), and ``Prediction.heads`` is ``H'``.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path

from .log import get_logger, log_once
from .mesh import Mesh, choose_mesh, counted_inter_node_elements, torus_mesh
from .strategies.registry import StrategySpec, get, modelled
from .topology import Topology, TopologyError

logger = get_logger(__name__)

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
CPU_PROFILE_PATH = Path(__file__).with_name("cpu_profile.json")
LINK_ENV = "SWIFTFUSION_LINK_MBIT"  # set by the CPU cluster emulation on throttled links


@dataclass(frozen=True)
class HardwareProfile:
    """Per-GPU rates of one cluster type. Bandwidths are bytes/s per GPU per direction with
    every GPU of a machine sending at once (inter = machine link / GPUs per machine)."""

    name: str
    intra_bw: float            # two-sided, same machine
    inter_bw: float            # two-sided, other machine
    one_sided_intra_bw: float  # put/get, same machine
    one_sided_inter_bw: float  # put/get, other machine
    msg_latency_s: float       # per two-sided message (rendezvous + launch)
    put_latency_s: float       # per one-sided put/get
    barrier_s: float           # one barrier (global or ring group)
    attn_flops: dict[str, float]            # dtype -> attention FLOP/s at D=128
    head_dim_efficiency: dict[int, float]   # D -> throughput relative to D=128
    attend_overhead_s: float   # fixed cost per attend call (launch, chunk bookkeeping)
    merge_s_per_elem: float    # merging one output element (B*h*Lq*D) into a running state
    copy_bw: float             # local rearrangement copies, bytes/s
    comm_cpu_bw: float = math.inf  # CPU work per transferred byte (shared-host emulation)
    overlap: float = 1.0       # fraction of that CPU work hidden behind compute
    source: str = ""
    # Lq -> throughput relative to Lq = 1024 (the CPU kernel tiles queries by 64 rows below
    # Lq = 768, by 256 above); empty: no dependence on the query length
    query_len_efficiency: dict[int, float] = field(default_factory=dict)
    # Lk -> throughput relative to Lk = 1024 (Lq = 1024, D = 64: the CPU kernel's per-row-block
    # costs spread over more keys); empty: no dependence on the key length
    key_len_efficiency: dict[int, float] = field(default_factory=dict)

    def flops(self, dtype: str, head_dim: int, lq: int | None = None, lk: int | None = None) -> float:
        e = _nearest(self.head_dim_efficiency, head_dim)
        if lq and self.query_len_efficiency:
            e *= _nearest(self.query_len_efficiency, lq)
        if lk and self.key_len_efficiency:
            e *= _nearest(self.key_len_efficiency, lk)
        return self.attn_flops["bf16" if dtype == "fp16" else dtype] * e


def _nearest(table: dict[int, float], x: int) -> float:
    """``table[x]``, else the entry whose key is nearest to ``x`` on a log scale."""
    return table[x] if x in table else table[min(table, key=lambda k: abs(math.log(k / x)))]


def _gpu(name, intra, inter, flops_bf16, source, barrier=20e-6):
    return HardwareProfile(
        name=name, intra_bw=intra, inter_bw=inter, one_sided_intra_bw=intra,
        one_sided_inter_bw=inter, msg_latency_s=15e-6, put_latency_s=3e-6, barrier_s=barrier,
        attn_flops={"bf16": flops_bf16, "fp32": flops_bf16 / 16},
        head_dim_efficiency={32: 0.45, 64: 0.75, 128: 1.0, 256: 1.0},
        attend_overhead_s=8e-6, merge_s_per_elem=0.0, copy_bw=1.2e12 if "H100" in source else 1.0e12,
        source=source)


GPU_PROFILES = {
    "p4de": _gpu("p4de", 230e9, 400e9 / 8 / 8, 200e12,
                 "8x A100 NVSwitch (~230 GB/s per GPU), EFA 400 Gbps per machine = 6.25 GB/s per "
                 "GPU line rate, FlashAttention-2 ~200 TFLOP/s (DESIGN.md section 6)"),
    "p5": _gpu("p5", 370e9, 3200e9 / 8 / 8, 600e12,
               "8x H100 NVSwitch (~370 GB/s per GPU), EFA 3200 Gbps per machine = 50 GB/s per GPU, "
               "FlashAttention-3 ~600 TFLOP/s"),
    "h100-ndr": _gpu("h100-ndr", 370e9, 48e9, 600e12,
                     "8x H100 NVSwitch, NDR InfiniBand ~48 GB/s per GPU, FlashAttention-3 ~600 TFLOP/s"),
}
PROFILES = (*GPU_PROFILES, "cpu-emulated")


@functools.cache
def host_cpu() -> str:
    """This host's CPU as calibration depends on it: model name, family/model and the vector
    units torch's CPU attention uses (``amx_bf16``, ``avx512f``, ``avx2``). Read once."""
    fields, flags = {}, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "flags":
                    flags = set(val.split())
                    break
                fields.setdefault(key, val.strip())
    except OSError:
        return platform.processor() or platform.machine()
    units = [f for f in ("amx_bf16", "avx512f", "avx2") if f in flags]
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {', '.join(units) or 'no avx2'})")


def cpu_profile(world_size: int, gpus_per_node: int = 1, link_mbit: float | None = None,
                path: Path = CPU_PROFILE_PATH) -> HardwareProfile:
    """The calibrated CPU-emulation profile (``scripts/calibrate_cpu.py``) for ``world_size``
    forked ranks; ``link_mbit``: tc-tbf rate of each machine's link (None: loopback only)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run scripts/calibrate_cpu.py to measure it")
    data = json.loads(path.read_text())
    here = host_cpu()
    if data.get("cpu") != here:
        log_once(logger, f"cpu-profile-host:{path}",
                 f"{path.name} was measured on {data.get('cpu', 'an unrecorded CPU')}, this host is "
                 f"{here}: attention rates can differ several times between CPUs, so predictions "
                 "and auto's choice may be off; run scripts/calibrate_cpu.py on this host")
    runs = data["runs"]
    w = min(runs, key=lambda k: (abs(int(k) - world_size), int(k)))
    m = runs[w]
    # rates measured with int(w) ranks sharing the host's cores: rescale to world_size ranks
    share = max(int(w), data["cores"]) / max(world_size, data["cores"])
    inter, one_inter = m["gloo_bw"] * share, m["shm_bw"] * share
    if link_mbit is not None:  # what each path gets of the link while ranks compute (probe)
        wire = link_mbit * 1e6 / 8 / gpus_per_node
        eff = data["link_efficiency"]
        inter = min(inter, wire * eff["two_sided"])
        one_inter = min(one_inter, wire * eff["one_sided"])
    return HardwareProfile(
        name="cpu-emulated" + (f"@{link_mbit:g}Mbit" if link_mbit else ""),
        intra_bw=m["gloo_bw"] * share, inter_bw=inter,
        one_sided_intra_bw=m["shm_bw"] * share, one_sided_inter_bw=one_inter,
        msg_latency_s=m["gloo_latency_s"], put_latency_s=m["shm_latency_s"],
        barrier_s=m["barrier_s"],
        attn_flops={k: v * share for k, v in m["attn_flops"].items()},
        head_dim_efficiency={int(k): v for k, v in m["head_dim_efficiency"].items()},
        query_len_efficiency={int(k): v for k, v in m["query_len_efficiency"].items()},
        key_len_efficiency={int(k): v for k, v in m.get("key_len_efficiency", {}).items()},
        attend_overhead_s=m["attend_overhead_s"] / share, merge_s_per_elem=m["merge_s_per_elem"] / share,
        copy_bw=m["copy_bw"] * share, comm_cpu_bw=m["gloo_bw"] * share, overlap=m["overlap"],
        source=data["command"])


def get_profile(name: str, topology: Topology | None = None, link_mbit: float | None = None) -> HardwareProfile:
    """A shipped profile by name (``p4de``, ``p5``, ``h100-ndr``, ``cpu-emulated``).
    ``cpu-emulated`` without ``link_mbit`` uses ``$SWIFTFUSION_LINK_MBIT``, the rate of the
    rank's own throttled link that the CPU cluster emulation sets (unset: loopback only)."""
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    if name == "cpu-emulated":
        topo = topology or Topology(1, 4)
        if link_mbit is None and os.environ.get(LINK_ENV):
            link_mbit = float(os.environ[LINK_ENV])
        return cpu_profile(topo.world_size, topo.gpus_per_node, link_mbit)
    raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}")


@dataclass(frozen=True)
class Workload:
    """One attention layer: batch, global sequence length, heads, head dim, dtype."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str = "bf16"


@dataclass(frozen=True)
class Prediction:
    """Predicted latency of one attention layer on one rank (the critical one)."""

    strategy: str      # requested
    runs_as: str       # what init_sequence_parallel runs (torus/swiftfusion -> tas if not torus_ready)
    ulysses: int
    ring: int
    placement: str
    latency_s: float
    compute_s: float   # the same attend calls without communication
    inter_node_bytes: int  # per rank (max over ranks)
    breakdown: dict[str, float] = field(default_factory=dict)
    heads: int = 0     # heads it runs on: the workload's, or H' when zero-padded
    padded: bool = False  # runs on zero-padded heads (heads > the workload's)

    @property
    def exposed_comm_s(self) -> float:
        return self.latency_s - self.compute_s


class _Model:
    """Cost terms of one (mesh, workload, profile)."""

    def __init__(self, mesh: Mesh, w: Workload, p: HardwareProfile, one_sided: bool) -> None:
        self.mesh, self.w, self.p, self.one = mesh, w, p, one_sided
        W = mesh.world_size
        if w.seq_len % W:
            raise TopologyError(f"sequence length {w.seq_len} is not divisible by the SP degree {W}")
        self.S = w.seq_len // W
        self.X = w.batch * self.S * w.heads * w.head_dim   # elements per tensor per rank
        self.e = BYTES[w.dtype]
        self.h = w.heads // mesh.ulysses
        self.compute = 0.0

    # -- compute
    def attend(self, lq: int, lk: int) -> float:
        w, p = self.w, self.p
        t = (4 * w.batch * self.h * lq * lk * w.head_dim / p.flops(w.dtype, w.head_dim, lq, lk)
             + p.attend_overhead_s + w.batch * self.h * lq * w.head_dim * p.merge_s_per_elem)
        self.compute += t
        return t

    def copy(self, elements: float) -> float:
        return elements * self.e / self.p.copy_bw

    # -- communication: bytes over intra/inter links, one latency per batch of messages
    def xfer(self, intra_elems: float, inter_elems: float, messages: int = 1) -> float:
        p = self.p
        bi, bx = (p.one_sided_intra_bw, p.one_sided_inter_bw) if self.one else (p.intra_bw, p.inter_bw)
        lat = p.put_latency_s if self.one else p.msg_latency_s
        nbytes = (intra_elems + inter_elems) * self.e
        return lat * (messages if self.one else 1) + (intra_elems * self.e / bi + inter_elems * self.e / bx
                                                      if nbytes else 0.0)

    def cpu(self, elements: float) -> float:
        """Unhidden CPU time of transferring ``elements`` concurrently with compute."""
        return (1 - self.p.overlap) * elements * self.e / self.p.comm_cpu_bw

    def overlapped(self, c: float, m: float, elements: float) -> float:
        """A compute step of ``c`` with a transfer of ``m`` seconds running beside it."""
        return max(c, m) + self.cpu(elements)

    def peers(self, group: tuple[int, ...], x: int) -> tuple[int, int]:
        node = self.mesh.topology.node_of
        inter = sum(node(y) != node(x) for y in group)
        return len(group) - 1 - inter, inter

    def all_to_all(self, group: tuple[int, ...], x: int, tensors: int) -> tuple[float, float]:
        """Blocking all-to-all of ``tensors`` tensors of X elements: (seconds, inter elements)."""
        n_in, n_out = self.peers(group, x)
        chunk = self.X / len(group)
        t = sum(self.xfer(n_in * chunk, n_out * chunk, len(group) - 1) for _ in range(tensors))
        return t, tensors * n_out * chunk


def _critical_rank(mesh: Mesh, w: Workload, ring: str) -> tuple[int, list[int]]:
    per_rank = counted_inter_node_elements(mesh, w.batch, w.seq_len, w.heads, w.head_dim, ring)
    return max(range(len(per_rank)), key=per_rank.__getitem__), per_rank


def _ring_steps(m: _Model, group: tuple[int, ...], x: int, c: float, block: float,
                gather: bool) -> tuple[float, float]:
    """Ring of R steps, each computing ``c`` while K+V blocks of ``block`` elements move.
    ``gather`` (USP): one all-gather issued at step 0, waited at step 1. Returns
    (seconds, inter elements sent)."""
    R = len(group)
    if R == 1:
        return c, 0.0
    i = group.index(x)
    nxt = group[(i + 1) % R]
    node = m.mesh.topology.node_of
    inter = node(nxt) != node(x)
    step = lambda: m.xfer(0 if inter else 2 * block, 2 * block if inter else 0, 2)  # noqa: E731
    if gather:
        comm = sum(step() for _ in range(R - 1))
        t = m.overlapped(c, comm, 2 * block * (R - 1)) + (R - 1) * c
    else:
        t = sum(m.overlapped(c, step(), 2 * block) for _ in range(R - 1)) + c
    return t, 2 * block * (R - 1) * inter


def _ulysses_ring(m: _Model, x: int, gather: bool) -> tuple[float, dict]:
    """usp / tas: all-to-all Q, K, V; ring; all-to-all O (all blocking)."""
    mesh = m.mesh
    g, r = mesh.g_r_of(x)
    uly, ring = mesh.ulysses_groups[r], mesh.ring_groups[g]
    a2a_in, inter_in = m.all_to_all(uly, x, 3)
    lq = m.S * mesh.ulysses                                  # queries per rank after the all-to-all
    c = m.attend(lq, lq)
    for _ in range(mesh.ring - 1):
        m.attend(lq, lq)
    ring_t, ring_inter = _ring_steps(m, ring, x, c, m.X, gather)
    a2a_out, inter_out = m.all_to_all(uly, x, 1)
    copies = m.copy(8 * m.X)                                 # split/merge heads of Q, K, V, O
    bd = {"all_to_all_in": a2a_in, "ring": ring_t, "all_to_all_out": a2a_out, "copies": copies}
    return a2a_in + ring_t + a2a_out + copies, bd | {"inter_elems": inter_in + ring_inter + inter_out}


def _torus(m: _Model, x: int) -> tuple[float, dict]:
    """The Torus stages (torus: two-sided; swiftfusion: one-sided)."""
    mesh, p = m.mesh, m.p
    T, U, R = mesh.torus, mesh.ulysses_intra, mesh.ring
    t_, u_, _ = mesh.coords(x)
    ring = mesh.ring_groups[t_ * U + u_]
    blk = m.X / T                                            # one [U, B, h, S, D] block
    US = U * m.S
    bar = p.barrier_s if m.one else 0.0
    # steps 1-2: intra-machine Ulysses scatter of Q, K, V (blocking), local staging copies
    scatter = 3 * m.xfer((U - 1) * m.X / (T * U), 0, 3 * (U - 1)) + bar + m.copy(3 * m.X)
    t = scatter
    # step 3: every inter-machine transfer issued now; arrival time of stage k's Q and K/V
    q_el, kv_el = blk, 2 * blk
    unit = lambda el: m.xfer(0, el, U)  # noqa: E731
    if m.one:   # one FIFO queue: Q_1..Q_{T-1}, then KV_1..KV_{T-1}
        arr_q = {k: t + k * unit(q_el) for k in range(1, T)}
        arr_kv = {k: t + (T - 1) * unit(q_el) + k * unit(kv_el) for k in range(1, T)}
    else:       # one FIFO per peer, T-1 peers sharing the link: stages finish together
        arr_q = {k: t + (T - 1) * unit(q_el) for k in range(1, T)}
        arr_kv = {k: arr_q[k] + (T - 1) * unit(kv_el) for k in range(1, T)}
    link_free = max([t, *arr_kv.values()])

    def ring_pass(lq: int) -> float:
        c = m.attend(lq, US)
        for _ in range(R - 1):
            m.attend(lq, US)
        return _ring_steps(m, ring, x, c, blk, gather=False)[0]

    compute_start = t
    t += ring_pass(US)                                        # Pull-Q stage 1
    for k in range(1, T):                                     # Pull-Q stages 2..T
        t = max(t, arr_q[k]) + ring_pass(US)
    for k in range(1, T):                         # Pull-KV stages 1..T-2, local queries too
        t = max(t, arr_kv[k]) + bar + (ring_pass(T * US) if k < T - 1 else 0.0)
    push_done = link_free
    for _ in range(T - 1):   # last Pull-KV stage block by block, each output pushed when final
        t += ring_pass(US)
        push_done = max(t, push_done) + unit(blk)
    if T > 1:                                     # Push-O: local queries against the last block
        t += ring_pass(US)
    t += m.xfer((U - 1) * m.X / (T * U), 0, U - 1)           # intra-machine O return
    # CPU cost of the inter-machine transfers that ran beside compute
    t += m.cpu(4 * (T - 1) * blk)
    t = max(t, push_done) + bar + m.copy(2 * m.X)
    bd = {"scatter": scatter, "compute_window": t - compute_start,
          "inter_arrival_last": link_free - scatter, "inter_elems": 4 * (T - 1) * blk}
    return t, bd


def _run(spec: StrategySpec, topology: Topology, workload: Workload, profile: HardwareProfile,
         ulysses_degree: int | None, pad_heads: bool = True
         ) -> tuple[Mesh, StrategySpec, int, list[int], _Model, float, dict]:
    """Mesh, the spec that runs on it (after its fallback), critical rank, bytes per rank, and
    the model's latency and breakdown (the model's workload ``m.w`` has the heads it runs on:
    more than ``workload``'s when zero-padded)."""
    heads = workload.heads
    if spec.needs_torus:
        mesh, padded = torus_mesh(topology, heads, spec.placement, ulysses_degree, pad=pad_heads)
        workload = replace(workload, heads=padded)
    else:
        mesh = choose_mesh(topology, heads, spec.placement, ulysses_degree)
    runs = spec.resolve(mesh, log=False)
    x, per_rank = _critical_rank(mesh, workload, runs.ring)
    m = _Model(mesh, workload, profile, one_sided=runs.one_sided)
    if runs.schedule == "torus-stages":
        latency, bd = _torus(m, x)
    elif runs.schedule in ("ulysses-ring", "ulysses-gather"):
        latency, bd = _ulysses_ring(m, x, gather=runs.schedule == "ulysses-gather")
    else:
        raise ValueError(f"no cost model for strategy {spec.name!r} (schedule {runs.schedule!r})")
    return mesh, runs, x, per_rank, m, latency, bd


def predict(strategy: str, topology: Topology, workload: Workload, profile: HardwareProfile,
            ulysses_degree: int | None = None, pad_heads: bool = True) -> Prediction:
    """Latency of one attention layer for ``strategy`` with Ulysses degree ``ulysses_degree``
    (default ``gcd(N*M, H)``), as ``init_sequence_parallel`` runs it: on zero-padded heads
    where the Torus schedule needs them (``pad_heads``, default degree only), else with the
    spec's fallback."""
    spec = get(strategy)
    mesh, runs, x, per_rank, m, latency, bd = _run(spec, topology, workload, profile,
                                                   ulysses_degree, pad_heads)
    return Prediction(spec.name, runs.name, mesh.ulysses, mesh.ring, spec.placement, latency,
                      m.compute, per_rank[x] * BYTES[workload.dtype], bd, m.w.heads,
                      m.w.heads != workload.heads)


def inter_node_elements(strategy: str, topology: Topology, workload: Workload,
                        ulysses_degree: int | None = None, pad_heads: bool = True) -> float:
    """Inter-machine elements of the critical rank as the model's phase terms add them up."""
    bd = _run(get(strategy), topology, workload, GPU_PROFILES["p4de"], ulysses_degree,
              pad_heads)[-1]
    return bd["inter_elems"]


def ulysses_degrees(topology: Topology, heads: int) -> list[int]:
    """Ulysses degrees that divide ``gcd(N*M, H)`` (every one gives a valid mesh)."""
    g = math.gcd(topology.world_size, heads)
    return [d for d in range(1, g + 1) if g % d == 0]


def candidates(topology: Topology, workload: Workload, profile: HardwareProfile,
               pad_heads: bool = False) -> list[Prediction]:
    """Every (strategy, Ulysses degree) that runs as itself, predicted; with ``pad_heads``
    also each Torus-schedule strategy on zero-padded heads where its default mesh needs them
    (``Prediction.heads`` > the workload's; its ``ulysses`` is the padded mesh's)."""
    out = []
    for deg in ulysses_degrees(topology, workload.heads):
        for spec in modelled():
            pr = predict(spec.name, topology, workload, profile, deg)
            if pr.runs_as == spec.name:
                out.append(pr)
    if pad_heads:
        for spec in modelled():
            if spec.needs_torus:
                pr = predict(spec.name, topology, workload, profile, None, True)
                if pr.padded and pr.runs_as == spec.name:
                    out.append(pr)
    return out


def recommend(topology: Topology, workload: Workload, profile: HardwareProfile,
              usp_ulysses: int | None = None, external: bool = True,
              pad_heads: bool = False) -> Prediction:
    """The fastest candidate by the model; ties (within 0.1%) go to the earlier strategy in
    the registry's order and the larger Ulysses degree. Never predicted slower than the
    baseline (``usp`` at its default degree). ``usp_ulysses``: the only Ulysses degree a
    strategy on xFuser's existing groups may use (they are built already). ``external=False``:
    no strategy on groups built outside this package (no xFuser: diffusers' integration).
    ``pad_heads``: Torus-schedule strategies on zero-padded heads are candidates too (the
    caller must then build a pick with ``heads`` > H padded, ``strategies/padded.py``)."""
    specs = {s.name: s for s in modelled() if external or not s.external_groups}
    cands = [p for p in candidates(topology, workload, profile, pad_heads) if p.strategy in specs
             and (not specs[p.strategy].external_groups or usp_ulysses in (None, p.ulysses))]
    order = list(specs)
    baselines = [s for s in specs.values() if s.baseline]
    base = (predict(baselines[0].name, topology, workload, profile, usp_ulysses)
            if baselines else None)
    ref = base.latency_s if base is not None else min(p.latency_s for p in cands)
    best = min(cands, key=lambda p: (round(p.latency_s / ref, 3), order.index(p.strategy),
                                     -p.ulysses))
    return best if base is None or best.latency_s <= base.latency_s else base


__all__ = ["HardwareProfile", "Workload", "Prediction", "PROFILES", "GPU_PROFILES", "get_profile",
           "cpu_profile", "predict", "candidates", "recommend", "ulysses_degrees",
           "inter_node_elements"]
