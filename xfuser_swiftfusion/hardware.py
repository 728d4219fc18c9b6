"""Hardware profiles: the rates of one cluster that the cost model's timeline runs on.

A profile is what ``swiftfusion calibrate`` measures on a cluster (a JSON file, format below),
or a built-in one for planning before a cluster exists: ``p4de``, ``p5``, ``h100-ndr`` with
datasheet links and what this code costs on a GPU, measured (``gpu_costs.json``: a committed
GPU suite run, ``tools/gpu_costs.py``; p4de's A100 compute scaled from the H100's), their
``-datasheet`` twins with every figure from datasheets (kernels at FlashAttention's rate, 8 us
of host per call: the paper's regime, not this code's), ``cpu-emulated`` from
``cpu_profile.json`` (``scripts/calibrate_cpu.py``), and one-box profiles of PCIe GPUs cut into
islands (``l40s-2s``, ``rtx4090-2s``, ``a100-pcie-2s``, ``h100-pcie-2s``: ``BOXES``, datasheet
links, an island being the mesh's machine, ``intra`` inside it, ``inter`` across islands; with
this code's measured GPU costs, kernel rates scaled to the box's GPU, and ``-datasheet`` twins).
``get_profile(name_or_path)`` loads any.

Rates (docs/cost-model.md):

- ``transfers[kind][locality]`` (``kind``: ``ops.KINDS``; ``locality``: ``intra`` / ``inter``):
  ``bw`` bytes/s, within a machine per GPU and direction, across machines per machine link and
  direction (all its GPUs sending at once); ``latency_s`` per call (per put/get one-sided);
  ``cpu_s_per_byte``: host CPU time a byte costs (a shared host; 0 on GPUs). A collective's
  ``inter`` rate is measured with every machine in its group (each machine sending to all
  others at once); optional ``inter1`` (``FANOUT_1``): the same collective over every rank of
  two machines, which serves the transfers whose peers are on one other machine (``rate``);
- ``attention[dtype][D]``: measured ``(Lq, Lk, FLOP/s)`` points of one attend call per
  ``attention_bh`` rows of heads (B*h), interpolated log-log, clamped at the edges;
  ``merge_s_per_elem``: merging / finalizing one output element; ``chunk_s``: device time
  per query chunk of an attend call beyond its FLOPs (its state's merge or finalization,
  launches); ``attend_call_s``, ``transfer_call_s``: the host's cost of one call,
  ``merge_call_s``: of each query chunk of an attend call; ``copy_bw``: local copies;
- ``barrier_s`` / ``sync_s``: one barrier / sync once every rank arrived;
- ``host_cores``: None on GPUs (each rank its own device); on a shared host (the CPU
  emulation) the cores all ranks' compute and transfer CPU share, rates then per core;
- ``host_waits``: the host waits for each compute call (CPU) instead of queueing it (GPU);
- ``two_sided_fifo``: exchanges on one queue run one after another (NCCL, one stream per
  queue) instead of concurrently, one FIFO per peer (gloo);
- ``inter_gpu_bw``: one GPU's own cap on inter-machine traffic per direction (its NIC share);
- ``one_sided_depth``: transfers of one one-sided queue in flight at once (NVSHMEM's
  communicator: ``comm.nvshmem.STREAMS_PER_QUEUE`` streams per queue, one transfer each; the
  CPU emulation's proxy: ``shm._IN_FLIGHT``);
- ``baseline``: the compute costs of the baseline strategy (xFuser's USP, whose code, not
  ours, makes its attention calls) where they were measured apart (``attention``,
  ``attend_call_s``, ...); empty: ours;
- ``figures``: per figure, how it was obtained (measured, scaled and how, datasheet);
- ``launches``: the Torus strategies' attention launches its costs belong to (``"ring"``: one
  per ring step, as the CPU emulation and the committed GPU run make them; ``"stage"``: one
  per Torus stage and query entry, what those strategies make on CUDA): the programs the
  timeline runs on it;
- ``p2p``: the GPUs of one host reach each other peer-to-peer (False: GeForce cards; the
  one-sided strategy, NVSHMEM, is refused there); ``island_gpus``: a one-box profile's GPUs
  per island (``plan`` on one host of ``M`` GPUs then plans ``M / island_gpus`` islands);
- ``levels``: the rates of finer cuts that compete with the profile's own (``hwtopo.Cut``:
  NVLink-bridged pairs inside a socket island, or hosts x islands on a cluster), each
  ``{"gpus", "label", "intra_bw", "inter_bw", "inter_gpu_bw", "source"}``: the GPUs per
  machine of that cut, the bandwidths of ``transfers`` inside and across its machines and a
  GPU's own cap across them (``at_level``).

File format (``format: swiftfusion-hardware/2``; ``/1`` files, without ``chunk_s``,
``merge_call_s``, ``baseline``, ``figures``, ``launches``, load with those at their defaults): the fields
above by name, ``attention`` (and ``baseline.attention``) as ``{dtype: {D: [[Lq, Lk, flops],
...]}}``, ``transfers`` as ``{kind: {locality: {bw, latency_s, cpu_s_per_byte}}}``, and
``measured`` (how and where: command, topology, host, device, date; for the built-in GPU
profiles the run: GPU, commit, versions, date).
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .comm.nvshmem import STREAMS_PER_QUEUE
from .log import get_logger, log_once
from .strategies.ops import KINDS

logger = get_logger(__name__)

FORMAT = "swiftfusion-hardware/2"
FORMATS = ("swiftfusion-hardware/1", FORMAT)  # /1: the fields /2 added take their defaults
LOCALITIES = ("intra", "inter")
FANOUT_1 = "inter1"  # a collective's rate between two machines (module docstring)
CPU_PROFILE_PATH = Path(__file__).with_name("cpu_profile.json")
GPU_COSTS_PATH = Path(__file__).with_name("gpu_costs.json")
GPU_COSTS_FORMAT = "swiftfusion-gpu-costs/1"
LINK_ENV = "SWIFTFUSION_LINK_MBIT"  # set by the CPU cluster emulation on throttled links
HARDWARE_ENV = "SWIFTFUSION_HARDWARE"  # a profile name or a profile file


@dataclass(frozen=True)
class Rate:
    """One transfer kind at one locality (see the module docstring)."""

    bw: float
    latency_s: float
    cpu_s_per_byte: float = 0.0


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one cluster (module docstring)."""

    name: str
    transfers: dict[str, dict[str, Rate]]
    attention: dict[str, dict[int, tuple[tuple[int, int, float], ...]]]
    attention_bh: int
    barrier_s: float
    sync_s: float
    attend_call_s: float
    transfer_call_s: float
    merge_s_per_elem: float
    copy_bw: float
    host_cores: float | None = None
    host_waits: bool = False
    two_sided_fifo: bool = True
    inter_gpu_bw: float | None = None
    one_sided_depth: int = 1
    source: str = ""
    measured: dict = field(default_factory=dict)
    merge_call_s: float = 0.0
    chunk_s: float = 0.0
    baseline: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    launches: str = "ring"
    p2p: bool = True                 # GPUs of one host reach each other peer-to-peer
    island_gpus: int | None = None   # one box: GPUs per island (its "machine"); None: a cluster
    levels: tuple[dict, ...] = ()    # finer cuts' rates (module docstring)

    def at_level(self, gpus: int) -> "HardwareProfile | None":
        """The profile of the finer cut of ``gpus`` GPUs per machine (``levels``): its
        bandwidths in ``transfers`` (latencies kept, no ``inter1`` rate), ``inter_gpu_bw``,
        ``island_gpus`` and name; None where the profile has no rates for it."""
        lv = next((x for x in self.levels if int(x["gpus"]) == gpus), None)
        if lv is None:
            return None
        bw = {"intra": float(lv["intra_bw"]), "inter": float(lv["inter_bw"])}
        transfers = {k: {loc: replace(r, bw=bw[loc]) for loc, r in v.items() if loc in bw}
                     for k, v in self.transfers.items()}
        return replace(self, name=f"{self.name}@{lv['label']}", transfers=transfers,
                       inter_gpu_bw=lv.get("inter_gpu_bw", self.inter_gpu_bw),
                       island_gpus=gpus if self.island_gpus else None, levels=())

    def rate(self, kind: str, locality: str, fanout: int | None = None) -> Rate:
        """The rate of ``kind`` at ``locality``; across machines with ``fanout`` 1 (the
        transfer's peers on one other machine) the ``inter1`` rate where measured."""
        rates = self.transfers[kind]
        if locality == "inter" and fanout == 1 and FANOUT_1 in rates:
            return rates[FANOUT_1]
        return rates[locality]

    def flops(self, dtype: str, head_dim: int, lq: int, lk: int) -> float:
        """Attention FLOP/s of one call of ``lq`` queries x ``lk`` keys (per core on a shared
        host): the measured points of the nearest head dim, interpolated log-log."""
        table = self.attention.get(dtype) or self.attention["bf16" if dtype == "fp16" else dtype]
        d = min(table, key=lambda k: (abs(math.log(k / head_dim)), k))
        return _interpolate(table[d], lq, lk)

    def attend_s(self, dtype: str, head_dim: int, bh: int, q: tuple[int, ...],
                 kv: tuple[int, ...], finalize: bool) -> float:
        """Seconds of one attend call (``ops.Attend``) at full speed, without its host cost."""
        lq, lk = sum(q), sum(kv)
        t = len(q) * self.chunk_s
        if lk:
            t += 4 * bh * lq * lk * head_dim / self.flops(dtype, head_dim, lq, lk)
        merges = (lk > 0) + finalize
        return t + merges * bh * lq * head_dim * self.merge_s_per_elem

    def origin(self) -> str:
        """Where the profile's figures come from, in a few words."""
        m = self.measured
        if m.get("commit"):
            scaled = self.figures.get("attention", "").startswith("scaled")
            return (f"this code's costs measured on {m['gpu']} at commit {m['commit']}, {m['date']}"
                    + (", kernel rates scaled to this GPU" if scaled else "") + "; datasheet links")
        if m.get("command"):
            return f"calibrated on {m.get('device', '?')}, {m.get('date', '?')}"
        if m.get("cpu"):
            return f"measured on {m['cpu']}, {m.get('date', '?')}"
        if self.island_gpus:
            return f"datasheet rates, one box in islands of {self.island_gpus} GPUs"
        return "datasheet rates"

    def for_baseline(self) -> "HardwareProfile":
        """The profile the baseline strategy runs on: ``baseline``'s compute costs in place
        of ours where they were measured apart (module docstring)."""
        return replace(self, **self.baseline) if self.baseline else self

    def to_json(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        d["attention"] = table_to_json(self.attention)
        if self.baseline.get("attention"):
            d["baseline"] = {**self.baseline, "attention": table_to_json(self.baseline["attention"])}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "HardwareProfile":
        if d.get("format") not in FORMATS:
            raise ValueError(f"not a hardware profile of format {FORMAT!r} (got {d.get('format')!r}); "
                             "write one with swiftfusion calibrate")
        d = {k: v for k, v in d.items() if k != "format"}
        d["transfers"] = {k: {loc: Rate(**r) for loc, r in v.items()} for k, v in d["transfers"].items()}
        d["attention"] = table_from_json(d["attention"])
        d["levels"] = tuple(dict(x) for x in d.get("levels", ()))
        if d.get("baseline", {}).get("attention"):
            d["baseline"] = {**d["baseline"], "attention": table_from_json(d["baseline"]["attention"])}
        missing = [f"{k}/{loc}" for k in KINDS for loc in LOCALITIES
                   if loc not in d["transfers"].get(k, {})]
        if missing:
            raise ValueError(f"hardware profile lacks transfer rates {', '.join(missing)}")
        return cls(**d)


def table_to_json(table: dict) -> dict:
    """An ``attention`` table as JSON: ``{dtype: {"D": [[Lq, Lk, flops], ...]}}``."""
    return {dt: {str(D): [list(p) for p in pts] for D, pts in t.items()} for dt, t in table.items()}


def table_from_json(table: dict) -> dict:
    """``table_to_json``'s inverse."""
    return {dt: {int(D): tuple(tuple(p) for p in pts) for D, pts in t.items()}
            for dt, t in table.items()}


def _interpolate(points: tuple[tuple[int, int, float], ...], lq: int, lk: int) -> float:
    """FLOP/s at (lq, lk): an exact point, else bilinear in (log Lq, log Lk) over the grid the
    points span (missing corners: the nearest point), clamped at the edges."""
    grid = {(p[0], p[1]): p[2] for p in points}
    if (lq, lk) in grid:
        return grid[lq, lk]
    qs, ks = sorted({p[0] for p in points}), sorted({p[1] for p in points})

    def bracket(xs: list[int], x: int) -> tuple[int, int, float]:
        x = min(max(x, xs[0]), xs[-1])
        hi = next(i for i, v in enumerate(xs) if v >= x)
        lo = max(hi - 1, 0) if xs[hi] > x else hi
        f = 0.0 if lo == hi else math.log(x / xs[lo]) / math.log(xs[hi] / xs[lo])
        return xs[lo], xs[hi], f

    def at(q: int, k: int) -> float:
        if (q, k) in grid:
            return grid[q, k]
        return grid[min(grid, key=lambda p: abs(math.log(p[0] / q)) + abs(math.log(p[1] / k)))]

    q0, q1, fq = bracket(qs, lq)
    k0, k1, fk = bracket(ks, lk)
    log = lambda q, k: math.log(at(q, k))  # noqa: E731
    v = ((1 - fq) * (1 - fk) * log(q0, k0) + fq * (1 - fk) * log(q1, k0)
         + (1 - fq) * fk * log(q0, k1) + fq * fk * log(q1, k1))
    return math.exp(v)


# --- built-in GPU profiles -----------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """Datasheet figures of one GPU machine type (DESIGN.md section 6; ``hbm``: NVIDIA's
    datasheets of the GPU): ``nvlink`` bytes/s per GPU and direction within the machine,
    ``link`` per machine and direction across machines, ``nic`` one GPU's NIC share,
    ``flash`` FlashAttention's bf16 FLOP/s at D=128 on this GPU, ``hbm`` memory bytes/s,
    ``copy_bw`` the local copy rate of the datasheet profile."""

    gpu: str
    nvlink: float
    link: float
    nic: float
    flash: float
    hbm: float
    copy_bw: float
    source: str


MACHINES = {
    "p4de": Machine("A100", 230e9, 400e9 / 8, 100e9 / 8, 200e12, 2.039e12, 1.0e12,
                    "8x A100 NVSwitch (~230 GB/s per GPU), EFA 4 x 100 Gbps per machine (400 Gbps "
                    "= 50 GB/s per direction; a GPU's NIC 12.5 GB/s)"),
    "p5": Machine("H100", 370e9, 3200e9 / 8, 400e9 / 8, 600e12, 3.35e12, 1.2e12,
                  "8x H100 NVSwitch (~370 GB/s per GPU), EFA 32 x 100 Gbps per machine (3200 Gbps; "
                  "a GPU's NICs 50 GB/s)"),
    "h100-ndr": Machine("H100", 370e9, 8 * 48e9, 48e9, 600e12, 3.35e12, 1.2e12,
                        "8x H100 NVSwitch, NDR InfiniBand 400 Gbps per GPU (~48 GB/s)"),
}
FLASH_SOURCE = {"A100": "FlashAttention-2 ~200 TFLOP/s", "H100": "FlashAttention-3 ~600 TFLOP/s"}


@dataclass(frozen=True)
class Box:
    """Datasheet figures of one host of PCIe GPUs cut into islands (``hwtopo.py``): ``gpus``
    per host, ``island_gpus`` per island (the mesh's "machine"), ``intra`` bytes/s per GPU
    and direction inside an island, ``link`` per island and direction to the other islands,
    ``nic`` one GPU's share of it (its PCIe link), ``p2p`` whether the GPUs reach each other
    peer-to-peer (GeForce cards: no), ``flash`` attention FLOP/s (bf16, D=128); ``bridge``:
    bytes/s per direction of the NVLink bridge on pairs of GPUs (0: none), whose pairs then
    compete with the islands as machines (``levels``); ``sockets``: islands per host."""

    gpu: str
    gpus: int
    island_gpus: int
    intra: float
    link: float
    nic: float
    flash: float
    hbm: float
    p2p: bool
    source: str
    bridge: float = 0.0
    sockets: int = 2

    def levels(self) -> tuple[dict, ...]:
        """The NVLink pairs as machines (``HardwareProfile.levels``): NVLink inside a pair;
        across pairs each GPU's PCIe link (``nic``) and, for the share of a pair's traffic
        that leaves its socket (the other sockets' pairs among all others), the socket link
        shared by the socket's pairs: per pair and direction the lesser of the two."""
        if not self.bridge:
            return ()
        pairs = self.gpus // 2
        per_socket = pairs // self.sockets
        away = (pairs - per_socket) / (pairs - 1)
        inter = min(2 * self.nic, self.link / (per_socket * away))
        return ({"gpus": 2, "label": "NVLink pairs", "intra_bw": self.bridge, "inter_bw": inter,
                 "inter_gpu_bw": self.nic,
                 "source": (f"datasheet: NVLink bridge {self.bridge / 1e9:.0f} GB/s per direction "
                            f"inside a pair; across pairs min(2 x PCIe {self.nic / 1e9:.0f}, socket "
                            f"link {self.link / 1e9:.0f} / ({per_socket} pairs x {away:.2g} of the "
                            f"traffic leaving the socket)) = {inter / 1e9:.0f} GB/s per pair")},)


# PCIe 4.0 x16: 64 GB/s both ways (L40S, A100 PCIe datasheets), ~25 GB/s per direction
# delivered; PCIe 5.0 x16 (H100 PCIe): 128 GB/s both ways, ~50 delivered. The socket link
# (UPI / xGMI) is what GPU peer traffic gets across sockets: an estimate, not a datasheet
# figure. Attention at 60 % of the dense bf16 tensor peak (FlashAttention-2 on A100: 200 of
# 312 TFLOP/s).
_PCIE4, _PCIE5, _FA = 25e9, 50e9, 200 / 312
BOXES = {
    "l40s-2s": Box("L40S", 8, 4, _PCIE4, 40e9, _PCIE4, 362e12 * _FA, 864e9, True,
                   "8x L40S PCIe 4.0 x16 (64 GB/s both ways: ~25 GB/s per direction), 4 per "
                   "socket behind PCIe switches, no NVLink; socket link ~40 GB/s per direction "
                   "(estimate); bf16 dense 362 TFLOP/s"),
    "rtx4090-2s": Box("RTX 4090", 8, 4, 12.5e9, 25e9, 12.5e9, 165e12 * _FA, 1008e9, False,
                      "8x RTX 4090 PCIe 4.0 x16, 4 per socket, no NVLink and no peer-to-peer "
                      "(GeForce driver): every copy through host memory, ~12.5 GB/s per GPU "
                      "(estimate); socket link ~25 GB/s (estimate); bf16 dense 165 TFLOP/s"),
    "a100-pcie-2s": Box("A100", 8, 4, _PCIE4, 40e9, _PCIE4, 200e12, 1.935e12, True,
                        "8x A100 80GB PCIe, NVLink bridges on pairs (600 GB/s both ways: "
                        "the pairs' level, 4x2; in a socket's island of 4 the all-to-all crosses "
                        "PCIe 4.0, ~25 GB/s per direction), 4 per socket; socket link ~40 GB/s "
                        "(estimate); FlashAttention-2 ~200 TFLOP/s", bridge=300e9),
    "h100-pcie-2s": Box("H100 PCIe", 8, 4, _PCIE5, 64e9, _PCIE5, 756e12 * _FA, 2.0e12, True,
                        "8x H100 PCIe, NVLink bridges on pairs (600 GB/s both ways: the "
                        "pairs' level, 4x2; in a socket's island of 4 the all-to-all crosses "
                        "PCIe 5.0, ~50 GB/s per direction), 4 per socket; socket link ~64 GB/s "
                        "(estimate); bf16 dense 756 TFLOP/s", bridge=300e9),
}
# NVML's device names -> the box profile (hwtopo's detection picks it for auto)
BOX_OF_GPU = {"L40S": "l40s-2s", "RTX 4090": "rtx4090-2s", "A100 80GB PCIe": "a100-pcie-2s",
              "A100-PCIE": "a100-pcie-2s", "H100 PCIe": "h100-pcie-2s"}


def _box_measured(name: str, b: Box) -> HardwareProfile:
    """A box's links (datasheet, ``_box``) with this code's costs measured on a GPU
    (``gpu_costs.json``), kernel rates scaled by ``b.flash`` over the measured GPU's
    FlashAttention rate (host costs, which the CPU pays, are not): the regime of the code today."""
    sheet = _box(f"{name}-datasheet", b)
    costs = gpu_costs()
    run = costs["run"]
    ref = next((g for g in MACHINES_FLASH if g in run["gpu"]), "H100")
    f = b.flash / MACHINES_FLASH[ref]
    prof = measured_gpu_profile(name, MACHINES["p5" if ref == "H100" else "p4de"], costs, scale=f)
    figures = {**prof.figures, "transfers": sheet.figures["transfers"], "labelled": "datasheet links",
               "attention": (f"scaled: measured on {run['gpu']} at {run['commit']} x {f:.3g} ({b.gpu} "
                             f"{b.flash / 1e12:.0f} TFLOP/s, datasheet-derived, over "
                             f"{FLASH_SOURCE[ref]} on {ref})")}
    return replace(prof, transfers=sheet.transfers, inter_gpu_bw=b.nic, copy_bw=sheet.copy_bw,
                   p2p=b.p2p, island_gpus=b.island_gpus, figures=figures, levels=b.levels(),
                   source=(f"links {b.source} (datasheet); compute and host: this code on "
                           f"{run['gpu']} at commit {run['commit']} ({run['dir']}, {run['date']}), "
                           f"kernel rates x {f:.3g} for the {b.gpu}"))


def _box(name: str, b: Box) -> HardwareProfile:
    """A box's datasheet profile (``Box``): NCCL 15 us / NVSHMEM 3 us per message, 8 us of
    host per call, attention at ``b.flash`` (D=32 / 64 at 45 / 75 %)."""
    eff = {32: 0.45, 64: 0.75, 128: 1.0, 256: 1.0}
    attention = {dt: {D: ((1024, 1024, b.flash * e / (16 if dt == "fp32" else 1)),)
                      for D, e in eff.items()} for dt in ("bf16", "fp32")}
    two = {"intra": Rate(b.intra, 15e-6), "inter": Rate(b.link, 15e-6)}
    one = {"intra": Rate(b.intra, 3e-6), "inter": Rate(b.link, 3e-6)}
    how = f"datasheet: {b.source}"
    return HardwareProfile(
        name=name, attention=attention, attention_bh=16, attend_call_s=8e-6, transfer_call_s=8e-6,
        merge_s_per_elem=0.0, copy_bw=b.hbm / 2,
        transfers={"exchange": two, "all_to_all": two, "all_gather": two, "get": one, "put": one},
        barrier_s=20e-6, sync_s=10e-6, host_cores=None, host_waits=False, two_sided_fifo=True,
        inter_gpu_bw=b.nic, one_sided_depth=STREAMS_PER_QUEUE, p2p=b.p2p, island_gpus=b.island_gpus,
        levels=b.levels(), source=f"{b.source} (datasheet)",
        figures={"transfers": how, "attention": f"datasheet: {b.gpu} at {b.flash / 1e12:.0f} TFLOP/s",
                 "labelled": "datasheet"})
FP32_SCALE = 19.5 / 312  # A100 datasheet: FP32 19.5 TFLOP/s against BF16 tensor cores 312


def _links(m: Machine) -> dict:
    """A machine's transfer rates and the fields that go with them (datasheet, DESIGN.md
    section 6: NCCL 15 us and NVSHMEM 3 us per message, a barrier on stream ~10-50 us)."""
    two = {"intra": Rate(m.nvlink, 15e-6), "inter": Rate(m.link, 15e-6)}
    one = {"intra": Rate(m.nvlink, 3e-6), "inter": Rate(m.link, 3e-6)}
    return dict(transfers={"exchange": two, "all_to_all": two, "all_gather": two, "get": one, "put": one},
                barrier_s=20e-6, sync_s=10e-6, host_cores=None, host_waits=False, two_sided_fifo=True,
                inter_gpu_bw=m.nic, one_sided_depth=STREAMS_PER_QUEUE)


def _datasheet(name: str, m: Machine) -> HardwareProfile:
    """Every figure from datasheets: FlashAttention's bf16 rate at D=128 for every call (D=32
    / 64 at 45 / 75 %), 8 us of host per call, nothing measured (the paper's regime)."""
    eff = {32: 0.45, 64: 0.75, 128: 1.0, 256: 1.0}
    attention = {dt: {D: ((1024, 1024, m.flash * e / (16 if dt == "fp32" else 1)),)
                      for D, e in eff.items()} for dt in ("bf16", "fp32")}
    return HardwareProfile(
        name=name, attention=attention, attention_bh=16, attend_call_s=8e-6, transfer_call_s=8e-6,
        merge_s_per_elem=0.0, copy_bw=m.copy_bw,
        source=f"{m.source}, {FLASH_SOURCE[m.gpu]} (DESIGN.md section 6)", **_links(m))


@functools.cache
def gpu_costs(path: Path = GPU_COSTS_PATH) -> dict:
    """What this code costs on a GPU, derived from a committed GPU suite run
    (``tools/gpu_costs.py``, format ``GPU_COSTS_FORMAT``)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != GPU_COSTS_FORMAT:
        raise ValueError(f"{path}: not a {GPU_COSTS_FORMAT} file; write it with "
                         "python -m xfuser_swiftfusion.tools.gpu_costs RUN_DIR")
    return data


def _scaled(table: dict, f: float) -> dict:
    """An attention table (JSON form) with every rate times ``f``; fp32 where not measured at
    ``FP32_SCALE`` of bf16 (fp16 takes bf16's where not measured: ``HardwareProfile.flops``)."""
    out = {dt: {int(D): tuple((lq, lk, r * f) for lq, lk, r in pts) for D, pts in t.items()}
           for dt, t in table.items()}
    out.setdefault("fp32", {D: tuple((lq, lk, r * FP32_SCALE) for lq, lk, r in pts)
                            for D, pts in out["bf16"].items()})
    return out


def measured_gpu_profile(name: str, m: Machine, costs: dict, scale: float | None = None) -> HardwareProfile:
    """``m``'s datasheet links with the compute and host costs of ``costs`` (``gpu_costs``):
    kernel rates per launch shape, host per attend call, query chunk and transfer, device
    time per query chunk, and the baseline's (xFuser's USP) own calls. Measured on
    ``costs["run"]["gpu"]``; for another GPU the kernel rates are scaled by the ratio of
    FlashAttention's datasheet rates on the two (host costs, which the CPU pays, are not);
    ``scale``: that factor given (1: the costs were measured on ``m``'s GPU)."""
    run = costs["run"]
    measured_on = next((g for g in MACHINES_FLASH if g in run["gpu"]), m.gpu)
    f = MACHINES_FLASH[m.gpu] / MACHINES_FLASH[measured_on] if scale is None else scale
    ours, base = costs["ours"], costs["baseline"]
    how = f"measured on {run['gpu']} at {run['commit']} ({run['dir']})"
    if f != 1:
        how_rates = (f"scaled: {how} x {f:.3g} ({FLASH_SOURCE[m.gpu]} on {m.gpu} / "
                     f"{FLASH_SOURCE[measured_on]} on {measured_on}, DESIGN.md section 6)")
    else:
        how_rates = how
    figures = {
        "transfers": f"datasheet: {m.source} (DESIGN.md section 6); NCCL 15 us, NVSHMEM 3 us per message",
        "barrier_s": "datasheet: a barrier on stream ~10-50 us (DESIGN.md section 6)",
        "launches": f"{how}: the Torus strategies' launches of that run ({run.get('launches', 'ring')})",
        "attention": f"{how_rates}: {ours['how']['attention']}" + (
            "" if "fp32" in ours["attention"] else
            f"; fp32 at {FP32_SCALE:.4g} of bf16 (datasheet ratio, A100 FP32 19.5 / BF16 312 TFLOP/s)"),
        "chunk_s": f"{how}: {ours['how']['chunk_s']}",
        "attend_call_s": f"{how}: {ours['how']['attend_call_s']} (the host's; not scaled)",
        "merge_call_s": f"{how}: {ours['how']['merge_call_s']} (the host's; not scaled)",
        "transfer_call_s": f"{how}: {ours['how']['transfer_call_s']} (the host's; not scaled)",
        "copy_bw": (f"{how}: {costs['copy_how']}" if costs.get("copy_bw") else
                    f"datasheet: {m.gpu} HBM {m.hbm / 1e12:.3g} TB/s, a copy reads and writes each byte"),
        "baseline": (f"{'scaled: ' if f != 1 else ''}{base['how']}"
                     + (f", GPU time x {1 / f:.3g} as the kernel rates" if f != 1 else "")),
    }
    baseline = {"attention": _scaled(base["attention"], f), "attend_call_s": base["attend_call_s"],
                "merge_call_s": 0.0, "chunk_s": 0.0, "merge_s_per_elem": 0.0,
                "transfer_call_s": base["transfer_call_s"]}
    return HardwareProfile(
        name=name, attention=_scaled(ours["attention"], f), attention_bh=ours["bh"],
        attend_call_s=ours["attend_call_s"], transfer_call_s=ours["transfer_call_s"],
        merge_s_per_elem=0.0, copy_bw=costs.get("copy_bw") or m.hbm / 2, merge_call_s=ours["merge_call_s"],
        chunk_s=ours["chunk_s"], baseline=baseline, figures=figures,
        launches=run.get("launches", "ring"),
        source=(f"links {m.source}; compute and host: this code on {run['gpu']} at commit "
                f"{run['commit']} ({run['dir']}, {run['date']})"
                + (f", kernel rates x {f:.3g} for the {m.gpu}" if f != 1 else "")),
        measured=dict(run), **_links(m))


class _Profiles(Mapping):
    """Built-in profiles by name, each built at its first use (the measured ones read
    ``gpu_costs.json``)."""

    def __init__(self, builders: dict) -> None:
        self._builders, self._built = builders, {}

    def __getitem__(self, name: str) -> HardwareProfile:
        if name not in self._built:
            self._built[name] = self._builders[name]()
        return self._built[name]

    def __iter__(self):
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)


def _builtin(name: str) -> HardwareProfile:
    """Built-in profile ``name``: its machine's links, the committed run's costs."""
    return measured_gpu_profile(name, MACHINES[name], gpu_costs())


MACHINES_FLASH = {m.gpu: m.flash for m in MACHINES.values()}
GPU_PROFILES = _Profiles({
    **{name: functools.partial(_builtin, name) for name in MACHINES},
    **{f"{name}-datasheet": functools.partial(_datasheet, f"{name}-datasheet", m)
       for name, m in MACHINES.items()},
    **{name: functools.partial(_box_measured, name, b) for name, b in BOXES.items()},
    **{f"{name}-datasheet": functools.partial(_box, f"{name}-datasheet", b) for name, b in BOXES.items()},
})
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
    """The ``cpu-emulated`` profile from ``cpu_profile.json`` (``scripts/calibrate_cpu.py``:
    rates per rank with W ranks at once, W = 4 and 8) for ``world_size`` forked ranks;
    ``link_mbit``: tc-tbf rate of each machine's link (None: loopback only). Each rank is
    its own resource at the measured per-rank rates (the file has no per-core rates)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run scripts/calibrate_cpu.py to measure it")
    data = json.loads(path.read_text())
    here = host_cpu()
    if data.get("cpu") != here:
        log_once(logger, f"cpu-profile-host:{path}",
                 f"{path.name} was measured on {data.get('cpu', 'an unrecorded CPU')}, this host is "
                 f"{here}: attention rates can differ several times between CPUs, so predictions "
                 "and auto's choice may be off; run scripts/calibrate_cpu.py on this host "
                 "(or swiftfusion calibrate --emulate)")
    runs = data["runs"]
    w = min(runs, key=lambda k: (abs(int(k) - world_size), int(k)))
    m = runs[w]
    # rates measured with int(w) ranks sharing the host's cores: rescale to world_size ranks
    share = max(int(w), data["cores"]) / max(world_size, data["cores"])
    gloo, shm = m["gloo_bw"] * share, m["shm_bw"] * share
    link = {"two": math.inf, "one": math.inf}
    if link_mbit is not None:  # what each path gets of the link while ranks compute (probe)
        wire = link_mbit * 1e6 / 8
        eff = data["link_efficiency"]
        link = {"two": wire * eff["two_sided"], "one": wire * eff["one_sided"]}
    cpu = 1 / gloo  # communication CPU per byte: the old calibration's comm_cpu_bw, overlap 0
    two = {"intra": Rate(gloo, m["gloo_latency_s"], cpu),
           "inter": Rate(min(link["two"], gloo * gpus_per_node), m["gloo_latency_s"], cpu)}
    one = {"intra": Rate(shm, m["shm_latency_s"], cpu),
           "inter": Rate(min(link["one"], shm * gpus_per_node), m["shm_latency_s"], cpu)}
    base, heff = m["attn_flops"], {int(k): v for k, v in m["head_dim_efficiency"].items()}
    qeff = {int(k): v for k, v in m["query_len_efficiency"].items()}
    keff = {int(k): v for k, v in m.get("key_len_efficiency", {"1024": 1.0}).items()}
    attention = {dt: {D: tuple((lq, lk, r * share * e * qe * ke) for lq, qe in sorted(qeff.items())
                               for lk, ke in sorted(keff.items()))
                      for D, e in heff.items()} for dt, r in base.items()}
    return HardwareProfile(
        name="cpu-emulated" + (f"@{link_mbit:g}Mbit" if link_mbit else ""),
        transfers={"exchange": two, "all_to_all": two, "all_gather": two, "get": one, "put": one},
        attention=attention, attention_bh=16, barrier_s=m["barrier_s"], sync_s=m["barrier_s"],
        attend_call_s=m["attend_overhead_s"] / share, transfer_call_s=0.0,
        merge_s_per_elem=m["merge_s_per_elem"] / share, copy_bw=m["copy_bw"] * share,
        host_cores=None, host_waits=True, two_sided_fifo=False,
        source=data["command"],
        measured={"cpu": data.get("cpu"), "date": data.get("measured"), "world": int(w)})


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    """A profile file written by ``swiftfusion calibrate``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read hardware profile {p}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile {p} is not JSON: {exc}") from exc
    prof = HardwareProfile.from_json(data)
    return prof if prof.name else replace(prof, name=p.stem)


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


def is_path(name: str) -> bool:
    """Whether ``name`` names a profile file rather than a built-in profile."""
    return name not in PROFILES and (name.endswith(".json") or os.sep in name or Path(name).exists())


def get_profile(name: str, topology=None, link_mbit: float | None = None) -> HardwareProfile:
    """A built-in profile by name (``p4de``, ``p5``, ``h100-ndr``, ``cpu-emulated``) or a
    profile file (a path). ``cpu-emulated`` without ``link_mbit`` uses
    ``$SWIFTFUSION_LINK_MBIT``, the rate of the rank's own throttled link that the CPU cluster
    emulation sets (unset: loopback only)."""
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    if name == "cpu-emulated":
        from .topology import Topology
        topo = topology or Topology(1, 4)
        if link_mbit is None and os.environ.get(LINK_ENV):
            link_mbit = float(os.environ[LINK_ENV])
        return cpu_profile(topo.world_size, topo.gpus_per_node, link_mbit)
    if is_path(name):
        return _cached_file(str(Path(name).resolve()), Path(name).stat().st_mtime_ns)
    raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)} "
                     "or a profile file written by swiftfusion calibrate")


@functools.lru_cache(maxsize=8)
def _cached_file(path: str, mtime_ns: int) -> HardwareProfile:
    return load_profile(path)


__all__ = ["BOXES", "BOX_OF_GPU", "Box", "CPU_PROFILE_PATH", "FANOUT_1", "FORMAT", "GPU_PROFILES", "HARDWARE_ENV", "HardwareProfile",
           "LINK_ENV", "PROFILES", "Rate", "cpu_profile", "get_profile", "host_cpu", "is_path",
           "load_profile", "save_profile"]
