"""Hardware profiles: the rates of one cluster that the cost model's timeline runs on.

A profile is what ``swiftfusion calibrate`` measures on a cluster (a JSON file, format below),
or a built-in one for planning before a cluster exists: ``p4de``, ``p5``, ``h100-ndr`` from
datasheet rates, ``cpu-emulated`` from ``cpu_profile.json`` (``scripts/calibrate_cpu.py``).
``get_profile(name_or_path)`` loads either.

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
  ``merge_s_per_elem``: merging / finalizing one output element; ``attend_call_s``,
  ``transfer_call_s``: the host's cost of one call; ``copy_bw``: local copies;
- ``barrier_s`` / ``sync_s``: one barrier / sync once every rank arrived;
- ``host_cores``: None on GPUs (each rank its own device); on a shared host (the CPU
  emulation) the cores all ranks' compute and transfer CPU share, rates then per core;
- ``host_waits``: the host waits for each compute call (CPU) instead of queueing it (GPU);
- ``two_sided_fifo``: exchanges on one queue run one after another (NCCL, one stream per
  queue) instead of concurrently, one FIFO per peer (gloo);
- ``inter_gpu_bw``: one GPU's own cap on inter-machine traffic per direction (its NIC share);
- ``one_sided_depth``: transfers of one one-sided queue in flight at once (NVSHMEM's
  communicator: ``comm.nvshmem.STREAMS_PER_QUEUE`` streams per queue, one transfer each; the
  CPU emulation's proxy: ``shm._IN_FLIGHT``).

File format (``format: swiftfusion-hardware/1``): the fields above by name, ``attention`` as
``{dtype: {D: [[Lq, Lk, flops], ...]}}``, ``transfers`` as ``{kind: {locality: {bw,
latency_s, cpu_s_per_byte}}}``, and ``measured`` (how and where: command, topology, host,
device, date).
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .comm.nvshmem import STREAMS_PER_QUEUE
from .log import get_logger, log_once
from .strategies.ops import KINDS

logger = get_logger(__name__)

FORMAT = "swiftfusion-hardware/1"
LOCALITIES = ("intra", "inter")
FANOUT_1 = "inter1"  # a collective's rate between two machines (module docstring)
CPU_PROFILE_PATH = Path(__file__).with_name("cpu_profile.json")
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
        t = 0.0
        if lk:
            t += 4 * bh * lq * lk * head_dim / self.flops(dtype, head_dim, lq, lk)
        merges = (lk > 0) + finalize
        return t + merges * bh * lq * head_dim * self.merge_s_per_elem

    def to_json(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        d["attention"] = {dt: {str(D): [list(p) for p in pts] for D, pts in t.items()}
                          for dt, t in self.attention.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "HardwareProfile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a hardware profile of format {FORMAT!r} (got {d.get('format')!r}); "
                             "write one with swiftfusion calibrate")
        d = {k: v for k, v in d.items() if k != "format"}
        d["transfers"] = {k: {loc: Rate(**r) for loc, r in v.items()} for k, v in d["transfers"].items()}
        d["attention"] = {dt: {int(D): tuple(tuple(p) for p in pts) for D, pts in t.items()}
                          for dt, t in d["attention"].items()}
        missing = [f"{k}/{loc}" for k in KINDS for loc in LOCALITIES
                   if loc not in d["transfers"].get(k, {})]
        if missing:
            raise ValueError(f"hardware profile lacks transfer rates {', '.join(missing)}")
        return cls(**d)


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


# --- built-in GPU profiles: datasheet rates, nothing fitted ------------------------------

def _gpu(name: str, nvlink: float, link: float, nic: float, flops_bf16: float, source: str,
         copy_bw: float) -> HardwareProfile:
    """``nvlink`` bytes/s per GPU and direction, ``link`` per machine and direction, ``nic``
    one GPU's NIC share; FlashAttention ``flops_bf16`` at D=128 (D=32 / 64 at 45 / 75 %)."""
    two = {"intra": Rate(nvlink, 15e-6), "inter": Rate(link, 15e-6)}
    one = {"intra": Rate(nvlink, 3e-6), "inter": Rate(link, 3e-6)}
    eff = {32: 0.45, 64: 0.75, 128: 1.0, 256: 1.0}
    attention = {dt: {D: ((1024, 1024, flops_bf16 * e / (16 if dt == "fp32" else 1)),)
                      for D, e in eff.items()} for dt in ("bf16", "fp32")}
    return HardwareProfile(
        name=name, transfers={"exchange": two, "all_to_all": two, "all_gather": two,
                              "get": one, "put": one},
        attention=attention, attention_bh=16, barrier_s=20e-6, sync_s=10e-6,
        attend_call_s=8e-6, transfer_call_s=8e-6, merge_s_per_elem=0.0, copy_bw=copy_bw,
        host_cores=None, host_waits=False, two_sided_fifo=True, inter_gpu_bw=nic,
        one_sided_depth=STREAMS_PER_QUEUE, source=source)


GPU_PROFILES = {
    "p4de": _gpu("p4de", 230e9, 400e9 / 8, 100e9 / 8, 200e12,
                 "8x A100 NVSwitch (~230 GB/s per GPU), EFA 4 x 100 Gbps per machine (400 Gbps = "
                 "50 GB/s per direction; a GPU's NIC 12.5 GB/s), FlashAttention-2 ~200 TFLOP/s "
                 "(DESIGN.md section 6)", 1.0e12),
    "p5": _gpu("p5", 370e9, 3200e9 / 8, 400e9 / 8, 600e12,
               "8x H100 NVSwitch (~370 GB/s per GPU), EFA 32 x 100 Gbps per machine (3200 Gbps; "
               "a GPU's NICs 50 GB/s), FlashAttention-3 ~600 TFLOP/s", 1.2e12),
    "h100-ndr": _gpu("h100-ndr", 370e9, 8 * 48e9, 48e9, 600e12,
                     "8x H100 NVSwitch, NDR InfiniBand 400 Gbps per GPU (~48 GB/s), "
                     "FlashAttention-3 ~600 TFLOP/s", 1.2e12),
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


__all__ = ["CPU_PROFILE_PATH", "FANOUT_1", "FORMAT", "GPU_PROFILES", "HARDWARE_ENV", "HardwareProfile",
           "LINK_ENV", "PROFILES", "Rate", "cpu_profile", "get_profile", "host_cpu", "is_path",
           "load_profile", "save_profile"]
