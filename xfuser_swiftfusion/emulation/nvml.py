"""A stand-in for the ``pynvml`` module (nvidia-ml-py) describing an emulated host's GPUs.

The CPU emulation's host of several islands (``run_emulated(..., islands=True)``) and the
tests' fake boxes (DGX-1, NVSwitch, bridged pairs...) answer ``hwtopo.probe`` through it.

It answers the calls ``hwtopo.probe`` makes with the return types pynvml gives: handles,
``nvmlPciInfo_t``-like objects (``busId`` as bytes, 8-digit domain, upper-case hex), UUID
strings, ``NVMLError`` for a link that does not exist. Built from the box's layout: NVLink
edges (GPU pairs, or ``switch=True``: every GPU wired to NVSwitches), the PCIe common
ancestor of each pair (NVML's levels 10/20/30/40/50), P2P read status per pair.
"""
from __future__ import annotations

from types import SimpleNamespace

SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM = 10, 20, 30, 40, 50


class NVMLError(Exception):
    pass


class FakeNVML:
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 36
    NVMLError = NVMLError

    def __init__(self, n: int, ancestor, nvlinks=(), switch: bool = False, p2p=None,
                 name: str = "NVIDIA L40S", fail: str | None = None) -> None:
        """``ancestor(i, j)``: NVML level of the pair; ``nvlinks``: GPU pairs with one link
        each; ``p2p(i, j)``: peer-to-peer read OK (default: all); ``fail``: a method that raises."""
        self.n, self.ancestor, self.switch, self.name, self.fail = n, ancestor, switch, name, fail
        self.p2p = p2p or (lambda i, j: True)
        self.links = {i: [] for i in range(n)}  # GPU -> remote bus ids, one per link
        for a, b in nvlinks:
            self.links[a].append(self.bus(b))
            self.links[b].append(self.bus(a))
        if switch:
            for i in range(n):
                self.links[i] = [f"00000000:{0xC0 + k:02X}:00.0" for k in range(6)]
        self.inits = 0

    @staticmethod
    def bus(i: int) -> str:
        return f"00000000:{0x18 + 0x10 * i:02X}:00.0"

    def _check(self, what: str) -> None:
        if self.fail == what:
            raise NVMLError(f"{what}: NVML_ERROR_UNKNOWN")

    # -- the pynvml API used by hwtopo.probe
    def nvmlInit(self):
        self._check("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < self.n:
            raise NVMLError("NVML_ERROR_INVALID_ARGUMENT")
        return ("handle", i)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus(h[1]).encode(),
                               busIdLegacy=self.bus(h[1])[4:].encode())

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h[1]:08x}-aaaa-bbbb-cccc-{h[1]:012x}"

    def nvmlDeviceGetName(self, h):
        return self.name

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h[1]]):
            raise NVMLError("NVML_ERROR_NOT_SUPPORTED" if not self.links[h[1]] else
                            "NVML_ERROR_INVALID_ARGUMENT")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        self._check("nvmlDeviceGetNvLinkRemotePciInfo")
        b = self.links[h[1]][link]
        return SimpleNamespace(busId=b.encode(), busIdLegacy=b[4:].encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        self._check("nvmlDeviceGetTopologyCommonAncestor")
        i, j = a[1], b[1]
        return 0 if i == j else self.ancestor(min(i, j), max(i, j))

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if index == 2:  # NVLINK
            linked = self.switch or self.bus(b[1]) in self.links[a[1]]
            return 0 if linked else 5
        return 0 if self.p2p(min(a[1], b[1]), max(a[1], b[1])) else 5


def two_socket_pcie(p2p: bool = True, sockets: int = 2, per_socket: int = 4) -> FakeNVML:
    """PCIe GPUs, ``per_socket`` per socket (default 8 = 2 x 4), two per PCIe switch,
    switches of a socket under one root (PXB), sockets joined by the CPU interconnect (SYS);
    no NVLink (8 x L40S)."""
    def anc(i, j):
        if i // per_socket != j // per_socket:
            return SYSTEM
        return SINGLE if i // 2 == j // 2 else MULTIPLE
    return FakeNVML(sockets * per_socket, anc, p2p=(lambda i, j: p2p))


def bridged_pairs(sockets: int = 2, n: int = 8) -> FakeNVML:
    """PCIe GPUs with NVLink bridges on pairs (0,1), (2,3)...; n/sockets per socket, pairs
    of one socket on different host bridges (NODE) (A100 / H100 PCIe)."""
    per = n // sockets

    def anc(i, j):
        return SYSTEM if i // per != j // per else NODE
    return FakeNVML(n, anc, nvlinks=[(2 * k, 2 * k + 1) for k in range(n // 2)],
                    name="NVIDIA H100 PCIe")


def dgx1() -> FakeNVML:
    """DGX-1 (V100) hybrid cube mesh: two fully linked quads plus links i <-> i+4; pairs
    under PCIe switches, quads on two sockets."""
    quad = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    edges = quad + [(a + 4, b + 4) for a, b in quad] + [(i, i + 4) for i in range(4)]

    def anc(i, j):
        if i // 4 != j // 4:
            return SYSTEM
        return SINGLE if i // 2 == j // 2 else HOSTBRIDGE
    return FakeNVML(8, anc, nvlinks=edges, name="Tesla V100-SXM2-32GB")


def nvswitch() -> FakeNVML:
    """8 GPUs on NVSwitches (DGX A100 / H100), PCIe across two sockets."""
    return FakeNVML(8, lambda i, j: SYSTEM if i // 4 != j // 4 else NODE, switch=True,
                    name="NVIDIA H100 80GB HBM3")


def one_gpu() -> FakeNVML:
    return FakeNVML(1, lambda i, j: SYSTEM)
