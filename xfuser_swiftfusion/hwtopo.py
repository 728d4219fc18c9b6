"""Islands of GPUs inside one host, read from the hardware through NVML.

Inside one box the GPUs' links differ by class: NVLink (a bridge, a hybrid cube mesh, an
NVSwitch), a PCIe switch, the CPU's host bridge, the socket interconnect. The GPUs that
share fast links form an *island*; the islands of a host are its "machines" for the mesh
(Ulysses with the Torus schedule across them, Ring inside one).

Link class of a GPU pair, fastest first (``CLASSES``): ``nvlink`` (an active NVLink whose
remote end is the other GPU, or NVLink peer-to-peer through an NVSwitch), else NVML's common
PCIe ancestor (``nvmlDeviceGetTopologyCommonAncestor``): ``pix`` (one PCIe switch; also a
dual-GPU board), ``pxb`` (several switches), ``phb`` (the CPU's host bridge), ``node``
(host bridges of one NUMA node), ``sys`` (across sockets).

Islands (``islands``): the slowest tier (``TIER``: NVLink; one PCIe switch tree; the CPU's
host bridges; the sockets) among the host's GPU pairs is where the host is cut; the islands
are the connected components of the links of faster tiers. All pairs NVLink, or no faster
link at all (islands of one GPU): one island. Islands of unequal size cannot carry a mesh:
the host is then one island.

Competing levels (``island_cuts``, ``Cut``): a host with more than one tier below its slowest
(NVLink-bridged pairs < host bridges < sockets) can also be cut at each faster tier (the pairs
as machines). The slowest cut is the default, the finer ones alternatives, every cut a
refinement of the default; across hosts the hosts are the default cut and hosts x islands
(every host cut alike) the alternatives. The cost model chooses among them where its profile
has the rates of a cut (``HardwareProfile.levels``; ``auto``, ``plan``).

Each rank probes its own GPU against every GPU of the host (``probe``; NVML sees every GPU
whatever ``CUDA_VISIBLE_DEVICES`` hides, so a rank's GPU is found by UUID, or by its entry
in ``CUDA_VISIBLE_DEVICES``); ``detect_islands`` gathers the probes over the process group
(collective) and maps every rank to its island. NVML absent or failing on any rank: None,
and the caller keeps hostname detection (logged once).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

from .log import get_logger, log_once

logger = get_logger(__name__)

CLASSES = ("nvlink", "pix", "pxb", "phb", "node", "sys")  # fastest first
LABELS = {"nvlink": "NVLink", "pix": "PCIe switch", "pxb": "PCIe switches",
          "phb": "PCIe host bridge", "node": "NUMA node", "sys": "socket interconnect"}
# tiers of bandwidth: classes of one tier are not cut apart (a PCIe switch tree, PXB, is as
# fast as one switch; a host bridge and several of one NUMA node both cross the CPU's root)
TIER = {"nvlink": 0, "pix": 1, "pxb": 1, "phb": 2, "node": 2, "sys": 3}
# nvmlGpuTopologyLevel_t -> class (INTERNAL: two GPUs on one board)
_ANCESTOR = {0: "pix", 10: "pix", 20: "pxb", 30: "phb", 40: "node", 50: "sys"}
_NVLINK_MAX = 18  # NVML_NVLINK_MAX_LINKS


@dataclass
class GpuProbe:
    """One rank's GPU and its link class to every other GPU of its host.

    ``index``: NVML's index (PCI bus order, blind to ``CUDA_VISIBLE_DEVICES``); ``bus_id``:
    PCI bus id (``0000:3b:00.0``); ``links``: other GPU's bus id -> class (``CLASSES``);
    ``p2p``: other GPU's bus id -> whether CUDA peer-to-peer reads work (NVML P2P status)."""

    index: int
    bus_id: str
    name: str
    links: dict[str, str] = field(default_factory=dict)
    p2p: dict[str, bool] = field(default_factory=dict)
    index_of: dict[str, int] = field(default_factory=dict)  # every GPU's bus id -> NVML index


@dataclass(frozen=True)
class Cut:
    """One way to cut the job's ranks into machines: ``machine_of`` (rank -> machine),
    ``gpus`` per machine, and the level cut at in words (``LABELS``; ``network``: hosts)."""

    machine_of: tuple[int, ...]
    gpus: int
    level: str

    @property
    def machines(self) -> int:
        return len(set(self.machine_of))


@dataclass
class HostIslands:
    """What ``detect_islands`` found: every rank's host and island, and why. ``cuts``: the
    default cut (``machine_of``) first, then the finer ones that compete with it."""

    machine_of: list[int]           # rank -> machine (host x island), numbered by first rank
    hosts: int
    islands_per_host: int
    description: str
    p2p_off: list[tuple[int, int]]  # rank pairs of one host without CUDA peer-to-peer
    nvlink: bool
    gpu_names: tuple[str, ...] = ()  # NVML's names of the ranks' GPUs, distinct, in rank order
    cuts: tuple[Cut, ...] = ()


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _bus(pci: Any) -> str:
    """A PCI bus id from an ``nvmlPciInfo_t``, normalised (``0000:3b:00.0``, lower case)."""
    bus = _text(getattr(pci, "busIdLegacy", None) or pci.busId).lower()
    dom, _, rest = bus.partition(":")
    return f"{int(dom, 16):04x}:{rest}" if rest.count(":") == 1 else bus


def _uuid(x: str) -> str:
    return _text(x).lower().removeprefix("gpu-")


def _nvlink_peers(nvml, handle) -> set[str]:
    """Bus ids at the far end of ``handle``'s active NVLinks (GPUs or NVSwitches)."""
    peers = set()
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX))):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            peers.add(_bus(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
        except nvml.NVMLError:
            continue  # not supported / no such link
    return peers


# nvmlGpuP2PCapsIndex_t (nvml.h; pynvml 13.615 defines its READ constant as a tuple, ``0,``)
P2P_READ, P2P_NVLINK = 0, 2
P2P_STATUS_OK = 0


def _p2p(nvml, a, b, cap: int) -> bool | None:
    """Whether NVML reports peer-to-peer capability ``cap`` OK between ``a`` and ``b``
    (None: NVML cannot tell)."""
    try:
        return nvml.nvmlDeviceGetP2PStatus(a, b, cap) == P2P_STATUS_OK
    except nvml.NVMLError:
        return None


def my_gpu(handles: list, nvml, uuid: str | None = None, local_rank: int | None = None,
           visible: str | None = None) -> int:
    """NVML index of this rank's GPU: by ``uuid`` (the CUDA device's), else the
    ``local_rank``-th entry of ``visible`` (``$CUDA_VISIBLE_DEVICES``: indices or UUID
    prefixes), else NVML index ``local_rank``."""
    uuids = [_uuid(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    if uuid:
        want = _uuid(uuid)
        if want in uuids:
            return uuids.index(want)
        raise LookupError(f"the CUDA device's UUID {uuid} is not among NVML's GPUs")
    lr = int(local_rank or 0)
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if lr >= len(entries):
            raise LookupError(f"local rank {lr} but CUDA_VISIBLE_DEVICES={visible!r} lists "
                              f"{len(entries)} GPUs")
        e = entries[lr]
        if e.isdigit():
            return int(e)
        hits = [i for i, u in enumerate(uuids) if u.startswith(_uuid(e))]
        if len(hits) != 1:
            raise LookupError(f"CUDA_VISIBLE_DEVICES entry {e!r} matches {len(hits)} GPUs")
        return hits[0]
    if lr >= len(handles):
        raise LookupError(f"local rank {lr} but NVML sees {len(handles)} GPUs")
    return lr


def probe(nvml, uuid: str | None = None, local_rank: int | None = None,
          visible: str | None = None) -> GpuProbe:
    """This rank's GPU against every GPU of the host (``nvml``: the ``pynvml`` module or a
    stand-in with its API); ``uuid``/``local_rank``/``visible``: see ``my_gpu``."""
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        buses = [_bus(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
        me = my_gpu(handles, nvml, uuid, local_rank, visible)
        peers = [_nvlink_peers(nvml, h) for h in handles]
        gpus = set(buses)
        switched = [bool(p - gpus) for p in peers]  # an NVLink ends at a non-GPU: an NVSwitch
        out = GpuProbe(me, buses[me], _text(nvml.nvmlDeviceGetName(handles[me])),
                       index_of={b: i for i, b in enumerate(buses)})
        for j, h in enumerate(handles):
            if j == me:
                continue
            # NVLink: a link's far end is the other GPU, or NVML reports NVLink peer-to-peer
            # (NVSwitch, or a link whose far end NVML does not name); through NVSwitches
            # where NVML cannot tell either way, NVLink
            via = _p2p(nvml, handles[me], h, P2P_NVLINK)
            nvlink = (buses[j] in peers[me] or buses[me] in peers[j] or via is True
                      or (via is None and switched[me] and switched[j]))
            if nvlink:
                cls = "nvlink"
            else:
                try:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[me], h))
                except nvml.NVMLError:
                    level = 50  # unknown: the slowest class
                cls = _ANCESTOR.get(level, "sys")
            out.links[buses[j]] = cls
            out.p2p[buses[j]] = bool(_p2p(nvml, handles[me], h, P2P_READ))
        return out
    finally:
        nvml.nvmlShutdown()


def _pairs(probes: Sequence[GpuProbe]) -> dict[tuple[int, int], str]:
    """The link class of every pair of ``probes`` (two ranks on one GPU: NVLink)."""
    n = len(probes)

    def cls(a: int, b: int) -> str:
        if probes[a].bus_id == probes[b].bus_id:
            return "nvlink"
        return probes[a].links.get(probes[b].bus_id, "sys")

    return {(a, b): cls(a, b) for a in range(n) for b in range(a + 1, n)}


def _components(n: int, pairs: dict[tuple[int, int], str], below: int) -> list[list[int]]:
    """Connected components of the links of tiers below ``below`` (each in rank order, by
    first member)."""
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (a, b), c in pairs.items():
        if TIER[c] < below:
            parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for x in range(n):
        groups.setdefault(root(x), []).append(x)
    return list(groups.values())


def islands(probes: Sequence[GpuProbe]) -> tuple[list[list[int]], str | None, str]:
    """``(islands, cut, note)`` of one host's ranks: lists of indices into ``probes`` (each in
    rank order, islands by their first rank), the class the host is cut at (None: one
    island), and a note on why (module docstring). Two ranks on one GPU share its island."""
    n = len(probes)
    pairs = _pairs(probes)
    if not pairs:
        return [list(range(n))], None, "one GPU"
    slow = max(pairs.values(), key=CLASSES.index)
    if slow == "nvlink":
        return [list(range(n))], None, "every pair joined by NVLink"
    found = _components(n, pairs, TIER[slow])
    if len(found) == 1:
        return found, None, f"the faster links join every GPU (slowest: {LABELS[slow]})"
    if len(found) == n:
        return [list(range(n))], None, f"every pair through the {LABELS[slow]}: nothing faster to group"
    if len({len(g) for g in found}) != 1:
        sizes = " + ".join(str(len(g)) for g in found)
        return [list(range(n))], None, (f"islands of unequal size ({sizes}) across the "
                                        f"{LABELS[slow]}: one island")
    return found, slow, f"split at the {LABELS[slow]}"


def island_cuts(probes: Sequence[GpuProbe]) -> list[tuple[list[list[int]], str]]:
    """Every way to cut one host's ranks at a tier of its links, slowest tier first: ``(islands,
    class cut at)`` for each tier whose faster links group the ranks into 2 or more islands of
    one size, more than one rank each (``islands``' cut, where it has one, is among them);
    cuts that group alike are listed once, at the slower tier."""
    n = len(probes)
    pairs = _pairs(probes)
    out: list[tuple[list[list[int]], str]] = []
    for cls in sorted(set(pairs.values()), key=CLASSES.index, reverse=True):
        found = _components(n, pairs, TIER[cls])
        if (1 < len(found) < n and len({len(g) for g in found}) == 1
                and all(found != f for f, _ in out)):
            out.append((found, cls))
    return out


def _ranges(xs: list[int]) -> str:
    xs, out, i = sorted(xs), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _inner(members: list[GpuProbe]) -> str:
    """The slowest class inside one island, in words."""
    classes = [m.links.get(o.bus_id, "sys") for m in members for o in members if o is not m]
    return LABELS[max(classes, key=CLASSES.index)] if classes else "one GPU"


def host_islands(hostnames: Sequence[str], probes: Sequence[GpuProbe]) -> HostIslands:
    """Every rank's machine from its host and its probe (rank order). Hosts keep separating
    machines; on one host the islands are the machines; across hosts the network is the
    slowest level, so each host is one machine. ``cuts``: that cut, then the finer ones that
    compete with it (a host's faster tiers; hosts x islands where every host is cut alike)."""
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(hostnames):
        hosts.setdefault(h, []).append(r)
    machine_of = [0] * len(hostnames)
    parts, p2p_off, per_host = [], [], []
    nvlink = any(c == "nvlink" for p in probes for c in p.links.values())
    host_cuts = []  # per host: {GPUs per island: (islands as indices into its ranks, class)}
    for hi, (host, ranks) in enumerate(hosts.items()):
        found, cut, note = islands([probes[r] for r in ranks])
        per_host.append(len(found))
        host_cuts.append({len(g[0]): (g, c) for g, c in reversed(island_cuts([probes[r] for r in ranks]))})
        for a in ranks:
            for b in ranks:
                if a < b and probes[a].bus_id != probes[b].bus_id and not probes[a].p2p.get(probes[b].bus_id, False):
                    p2p_off.append((a, b))
        desc = []
        for isl in found:
            mem = [probes[ranks[i]] for i in isl]
            desc.append(f"GPUs {_ranges([m.index for m in mem])}: {_inner(mem)}")
        sizes = {len(i) for i in found}
        what = (f"{len(found)} islands of {sizes.pop()}" if len(found) > 1 else "1 island")
        parts.append((host, len(ranks), what, note, desc, found, ranks, cut))
    one_host = len(hosts) == 1
    islands_per_host = per_host[0] if one_host else 1
    if one_host:
        _, _, _, _, _, found, ranks, _ = parts[0]
        for k, isl in enumerate(found):
            for i in isl:
                machine_of[ranks[i]] = k
    else:
        for k, (_, ranks) in enumerate(hosts.items()):
            for r in ranks:
                machine_of[r] = k
    cuts = [Cut(tuple(machine_of), len(machine_of) // (max(machine_of) + 1),
                "network" if not one_host else LABELS.get(parts[0][7], "host"))]
    finer = sorted(set.intersection(*(set(c) for c in host_cuts)), reverse=True)
    for k in finer:   # every host cut alike into islands of k: hosts x islands
        if k >= cuts[0].gpus:
            continue
        alt = [0] * len(hostnames)
        for hi, (_, ranks) in enumerate(hosts.items()):
            for j, isl in enumerate(host_cuts[hi][k][0]):
                for i in isl:
                    alt[ranks[i]] = hi * len(ranks) + j
        cuts.append(Cut(tuple(alt), k, LABELS[host_cuts[0][k][1]]))
    lines = []
    for host, n, what, note, desc, *_ in parts:
        lines.append(f"{host}: {n} GPUs, {what} ({note}; {'; '.join(desc)})")
    head = f"{len(hostnames)} GPUs on {len(hosts)} host{'s' if len(hosts) > 1 else ''}"
    tail = "" if nvlink else "; no NVLink"
    if p2p_off:
        tail += f"; no GPU peer-to-peer between {len(p2p_off)} rank pairs (e.g. ranks {p2p_off[0]})"
    if not one_host and any(k > 1 for k in per_host):
        tail += "; across hosts the network is the slowest link: one machine per host"
    if len(cuts) > 1:
        tail += "; levels compete: " + ", ".join(
            f"{c.machines}x{c.gpus} (cut at the {c.level})" for c in cuts) + (
            " (the first built; the cost model chooses where its profile has each cut's rates)")
    return HostIslands(machine_of, len(hosts), islands_per_host,
                       f"{head}: " + " | ".join(lines) + tail, p2p_off, nvlink,
                       tuple(dict.fromkeys(p.name for p in probes)), tuple(cuts))



def _import_nvml():
    import pynvml  # nvidia-ml-py
    return pynvml


def _cuda_uuid() -> str | None:
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:  # noqa: BLE001  (no CUDA: fall back to CUDA_VISIBLE_DEVICES)
        pass
    return None


def local_probe() -> tuple[GpuProbe | None, str | None]:
    """``(probe, None)`` of this rank's GPU, or ``(None, why not)``."""
    try:
        nvml = _import_nvml()
    except ImportError as exc:
        return None, f"NVML is not available ({exc}; pip install nvidia-ml-py)"
    try:
        return probe(nvml, _cuda_uuid(), int(os.environ.get("LOCAL_RANK", "0") or 0),
                     os.environ.get("CUDA_VISIBLE_DEVICES")), None
    except Exception as exc:  # noqa: BLE001  (NVMLError_*: no driver, no GPU, not supported)
        return None, f"NVML failed ({type(exc).__name__}: {exc})"


def visible_islands() -> tuple[HostIslands | None, str | None]:
    """``(islands, None)`` of every GPU this process sees, one stand-in rank per GPU (as
    torchrun would start them), or ``(None, why not)``: what detection would find here
    (the GPU suite's env stage)."""
    try:
        nvml = _import_nvml()
        nvml.nvmlInit()
        try:
            count = nvml.nvmlDeviceGetCount()
        finally:
            nvml.nvmlShutdown()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        n = len([e for e in visible.split(",") if e.strip()]) if visible else count
        probes = [probe(nvml, None, lr, visible) for lr in range(n)]
    except ImportError as exc:
        return None, f"NVML is not available ({exc}; pip install nvidia-ml-py)"
    except Exception as exc:  # noqa: BLE001  (NVMLError_*)
        return None, f"NVML failed ({type(exc).__name__}: {exc})"
    return host_islands([socket.gethostname()] * n, probes), None


_LAST: list[HostIslands] = []


def last_detection() -> HostIslands | None:
    """What the latest topology detection in this process found from the hardware (None:
    nothing, or the latest detection did not read the hardware)."""
    return _LAST[-1] if _LAST else None


def forget() -> None:
    """A new topology detection starts: ``last_detection`` is None until it reads NVML."""
    _LAST.clear()


def p2p_refusal(found: HostIslands | None, strategy: str) -> str | None:
    """Why the one-sided ``strategy`` cannot run on the detected host (None: it can)."""
    if found is None or not found.p2p_off:
        return None
    a, b = found.p2p_off[0]
    return (f"{strategy} needs GPU peer-to-peer inside a host (NVSHMEM over PCIe or NVLink), and "
            f"NVML reports it off between the GPUs of ranks {a} and {b} ({len(found.p2p_off)} "
            f"rank pairs in all; e.g. GeForce cards): use torus (the same schedule over NCCL) "
            "or auto")


def detect_islands(world_size: int, group=None, hostnames: Sequence[str] | None = None
                   ) -> HostIslands | None:
    """Gather every rank's host and probe over ``group`` (collective) and map ranks to
    machines; None, logged once, where NVML is absent or fails on any rank."""
    import torch.distributed as dist
    mine = (socket.gethostname(), *local_probe())
    rows: list = [None] * world_size
    dist.all_gather_object(rows, mine, group=group)
    failed = [(r, why) for r, (_, p, why) in enumerate(rows) if p is None]
    if failed:
        r, why = failed[0]
        if dist.get_rank() == 0:
            import torch
            one_host = len({h for h, _, _ in rows}) == 1   # else hosts are the machines anyway
            log_once(logger, f"nvml-{why}", f"topology from hostnames, not the hardware: rank {r}: "
                     f"{why}", logging.WARNING if torch.cuda.is_available() and one_host
                     else logging.INFO)
        return None
    found = host_islands(hostnames or [h for h, _, _ in rows], [p for _, p, _ in rows])
    _LAST.append(found)
    return found


__all__ = ["CLASSES", "Cut", "GpuProbe", "HostIslands", "detect_islands", "forget", "host_islands",
           "island_cuts", "islands", "last_detection", "local_probe", "my_gpu", "p2p_refusal", "probe",
           "visible_islands"]
