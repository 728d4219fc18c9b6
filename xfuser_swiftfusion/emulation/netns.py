"""An emulated cluster with real, kernel-throttled links between machines (needs root).

Every emulated machine ``i`` is a network namespace ``<prefix>-m<i>`` whose only link,
``eth0`` (address ``10.77.0.<i+1>/24``, MTU 9000 like EFA's jumbo frames), is one end of a
veth pair; the other end, ``h<i>``, is a port of bridge ``br0`` in namespace ``<prefix>-br``.
Both ends carry a ``tbf`` qdisc at ``LinkSpec.rate_mbit``, so each machine's upload and
download are limited independently (a full-duplex NIC). Ranks of one machine share its
namespace: their traffic to each other goes over loopback (and /dev/shm), only traffic to
other machines crosses the throttled link. The root namespace is never touched.

Invariants:
- names carry the creating pid and a random token (``sfnet-<pid>-<token>``); everything a
  run creates is removed by ``destroy_network`` (namespaces take their veths, bridge and
  qdiscs with them), which ``emulated_network`` always calls, also on exceptions, Ctrl-C and
  SIGTERM; networks of dead creators (a SIGKILLed parent) are removed by the next run;
- inter-machine bytes are read from the kernel's qdisc counters (``qdisc_bytes``),
  independently of the communicators' own byte counters.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import asdict, dataclass
from typing import Iterator

from ..cost_model import LINK_ENV
from ..log import get_logger
from .procs import process_alive
from .proxy import PROXY_ADDR_ENV

logger = get_logger(__name__)

NETNS_ENV = "SWIFTFUSION_NETNS"
NAME_PREFIX = "sfnet-"
NETNS_DIR = "/var/run/netns"
DEV = "eth0"
MTU = 9000
_SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


class NetnsUnavailable(RuntimeError):
    """This host cannot build an emulated network (not root, or no ``ip netns`` / ``tc``)."""


@dataclass(frozen=True)
class LinkSpec:
    """One machine's link: ``rate_mbit`` in each direction, tbf ``burst`` and queue ``latency``;
    ``tcp_queue_kb``: the most one TCP socket of the machine may keep in its upload queue
    (``net.ipv4.tcp_limit_output_bytes`` in its namespace; None: the kernel's default, 4 MiB)."""

    rate_mbit: float
    burst_kbit: int = 256
    latency_ms: int = 100
    tcp_queue_kb: int | None = None

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"link rate must be positive, got {self.rate_mbit} Mbit/s")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


def add_link_argument(parser) -> None:
    """``--link-mbit RATE`` and ``--tcp-queue-kb KB`` for commands that emulate a cluster."""
    parser.add_argument("--link-mbit", type=float, metavar="RATE",
                        help="with --emulate: one network namespace per machine, links throttled "
                             "to RATE Mbit/s each way (needs root)")
    parser.add_argument("--tcp-queue-kb", type=int, metavar="KB", default=None,
                        help="with --link-mbit: per-socket limit of queued upload bytes "
                             "(tcp_limit_output_bytes; default: the kernel's 4 MiB)")


def link_from_args(args) -> LinkSpec | None:
    """The ``LinkSpec`` asked for by ``--link-mbit`` (None: all ranks on loopback)."""
    if not getattr(args, "link_mbit", None):
        return None
    return LinkSpec(args.link_mbit, tcp_queue_kb=args.tcp_queue_kb)


@dataclass(frozen=True)
class Network:
    """A created emulated network of ``nodes`` machines (picklable; passed to ranks by env)."""

    prefix: str
    nodes: int
    link: LinkSpec

    def netns(self, machine: int) -> str:
        return f"{self.prefix}-m{machine}"

    @property
    def creator(self) -> int:
        """Pid of the process that created the network (``sfnet-<pid>-<token>``)."""
        return int(self.prefix.removeprefix(NAME_PREFIX).split("-")[0])

    @property
    def bridge_netns(self) -> str:
        return f"{self.prefix}-br"

    def addr(self, machine: int) -> str:
        """The address of machine ``machine`` (its ``eth0``), reachable from every machine."""
        return f"{_SUBNET}.{machine + 1}"

    def to_env(self) -> str:
        return json.dumps({"prefix": self.prefix, "nodes": self.nodes, "link": asdict(self.link)})

    @classmethod
    def from_env(cls, text: str) -> "Network":
        d = json.loads(text)
        return cls(d["prefix"], d["nodes"], LinkSpec(**d["link"]))


def current_network() -> Network | None:
    """The emulated network this rank runs in (None outside ``run_emulated(..., link=)``)."""
    text = os.environ.get(NETNS_ENV)
    return Network.from_env(text) if text else None


# -- host capabilities and commands ----------------------------------------------------------

def netns_unavailable_reason() -> str | None:
    """Why an emulated network cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return ("emulated links need root (network namespaces and tc); run without link= "
                "for the un-throttled emulation (all ranks on loopback)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated links need the {tool!r} command (iproute2); run without link="
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'ip netns' is unavailable here ({probe.stderr.strip()}); run without link="
    return None


def _run(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def list_netns(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of existing namespaces starting with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def cleanup_stale() -> list[str]:
    """Remove namespaces left by creators that no longer run (e.g. a SIGKILLed parent)."""
    removed = []
    for name in list_netns():
        m = re.match(rf"{NAME_PREFIX}(\d+)-", name)
        if m and not process_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    if removed:
        logger.warning(f"removed {len(removed)} stale emulated-network namespaces: {removed}")
    return removed


# -- build / tear down -----------------------------------------------------------------------

def create_network(nodes: int, link: LinkSpec) -> Network:
    """Namespaces, veth pairs, bridge and tbf qdiscs for ``nodes`` machines (removed on error)."""
    reason = netns_unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    if not 1 <= nodes <= 250:
        raise ValueError(f"an emulated network holds 1..250 machines, got {nodes}")
    cleanup_stale()
    net = Network(f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}", nodes, link)
    tbf = ("tbf", "rate", f"{link.rate_mbit}mbit", "burst", f"{link.burst_kbit}kbit",
           "latency", f"{link.latency_ms}ms")
    br = net.bridge_netns
    try:
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i in range(nodes):
            ns, host = net.netns(i), f"h{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", br, "link", "add", host, "mtu", str(MTU), "type", "veth",
                 "peer", "name", DEV, "mtu", str(MTU), "netns", ns)
            _run("ip", "-n", br, "link", "set", host, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{net.addr(i)}/24", "dev", DEV)
            _run("ip", "-n", ns, "link", "set", DEV, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if link.tcp_queue_kb is not None:
                _run("ip", "netns", "exec", ns, "sysctl", "-qw",
                     f"net.ipv4.tcp_limit_output_bytes={link.tcp_queue_kb * 1024}")
            _run("tc", "-n", ns, "qdisc", "add", "dev", DEV, "root", *tbf)    # upload
            _run("tc", "-n", br, "qdisc", "add", "dev", host, "root", *tbf)   # download
    except BaseException:
        destroy_network(net)
        raise
    logger.info(f"emulated network {net.prefix}: {nodes} machines, {link.rate_mbit} Mbit/s "
                f"each way per machine")
    return net


def destroy_network(net: Network) -> None:
    """Delete every namespace of ``net`` (their veths, bridge and qdiscs go with them)."""
    for name in list_netns(net.prefix + "-"):
        res = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if res.returncode != 0:
            logger.warning(f"could not delete namespace {name}: {res.stderr.strip()}")


@contextlib.contextmanager
def emulated_network(nodes: int, link: LinkSpec) -> Iterator[Network]:
    """``create_network`` ... ``destroy_network``; SIGTERM in the main thread raises
    ``SystemExit`` meanwhile, so a terminated parent still removes its network."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        def _terminate(signum, frame):
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        net = create_network(nodes, link)
        try:
            yield net
        finally:
            destroy_network(net)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# -- ranks -----------------------------------------------------------------------------------

def enter_netns(name: str) -> None:
    """Move the calling process into namespace ``name``; it must be single-threaded (right
    after fork), since ``setns`` moves only the calling thread."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"enter_netns({name!r}) needs a single-threaded process, this one "
                           f"has {threads} threads (call it right after fork)")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def enter_machine(net: Network, machine: int) -> str:
    """In a freshly forked rank: join ``machine``'s namespace and set the environment gloo and
    the one-sided proxy read (interface, own address, network). Returns the master address."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's cleanup handler is not ours
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # a SIGKILLed parent takes its ranks along,
    if os.getppid() != net.creator:                # so nothing keeps its namespaces alive
        raise RuntimeError(f"the launcher (pid {net.creator}) died while this rank started")
    enter_netns(net.netns(machine))
    os.environ.update({"GLOO_SOCKET_IFNAME": DEV, PROXY_ADDR_ENV: net.addr(machine),
                       NETNS_ENV: net.to_env(), LINK_ENV: f"{net.link.rate_mbit:g}"})
    return net.addr(0)


# -- counters --------------------------------------------------------------------------------

def _qdisc_sent(ns: str, dev: str) -> int:
    stats = json.loads(_run("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev))
    roots = [q for q in stats if q.get("root")]
    if len(roots) != 1 or roots[0]["kind"] != "tbf":
        raise RuntimeError(f"expected one root tbf qdisc on {dev} in {ns}, got {stats}")
    return int(roots[0]["bytes"])


def qdisc_bytes(net: Network, direction: str = "out") -> dict[int, int]:
    """Bytes the kernel has sent through each machine's link qdisc since it was created,
    headers included: ``out`` = machine -> network (its ``eth0``), ``in`` = network -> machine
    (its bridge port). Callable from the parent or from any rank."""
    if direction not in ("out", "in"):
        raise ValueError(f"direction must be 'out' or 'in', got {direction!r}")
    if direction == "out":
        return {i: _qdisc_sent(net.netns(i), DEV) for i in range(net.nodes)}
    return {i: _qdisc_sent(net.bridge_netns, f"h{i}") for i in range(net.nodes)}
