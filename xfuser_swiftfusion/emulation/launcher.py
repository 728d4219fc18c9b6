"""Emulated multi-machine clusters on one CPU host.

``run_emulated(fn, "2x4", *args)`` forks ``N*M`` rank processes from the calling process
(which has already imported torch, so start-up takes ~1 s instead of a torchrun per rank),
initialises a gloo process group in each, sets the topology override so that rank ``i``
belongs to machine ``i // M``, runs ``fn(*args)`` on every rank and returns the per-rank
results in rank order.

Invariants:
- every rank either returns a result or its traceback is reported; one failing rank
  terminates the others, and the whole run is bounded by ``timeout_s``;
- child processes are always reaped (also on timeout, Ctrl-C or an exception in the parent).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .netns import LinkSpec, Network, emulated_network, enter_machine
from ..topology import TOPOLOGY_ENV, Topology
from ..strategies import specs


class EmulationError(RuntimeError):
    """One or more emulated ranks failed, timed out or died."""


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str


# A rendezvous port below the kernel's ephemeral range (32768-60999 by default): a port the
# kernel hands out (bind to 0) may be taken by an outgoing connection (gloo's, the proxy's)
# between the probe and rank 0's bind (EADDRINUSE); ports below that range are never given out
# by the kernel on its own.
_PORTS = (20000, 32000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range (``_PORTS``)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {_PORTS[0]}-{_PORTS[1] - 1} on 127.0.0.1")


def _child(rank: int, topo: Topology, port: int, fn: Callable, args: tuple,
           conn, threads: int, env: dict[str, str], pg_timeout_s: float,
           net: Network | None = None, islands: bool = False) -> None:
    # A fresh process group per child; parent signal handlers must not run here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(topo.world_size),
        "LOCAL_RANK": str(rank % topo.gpus_per_node),
        "LOCAL_WORLD_SIZE": str(topo.gpus_per_node),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        TOPOLOGY_ENV: f"{topo.nodes}x{topo.gpus_per_node}",
    })
    if islands:  # one host: the machines are its islands, found from its (emulated) NVML
        import sys
        from .nvml import two_socket_pcie
        del os.environ[TOPOLOGY_ENV]
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(topo.world_size)})
        sys.modules["pynvml"] = two_socket_pcie(sockets=topo.nodes, per_socket=topo.gpus_per_node)
    torch.set_num_threads(threads)
    status: tuple[str, Any]
    try:
        master = "127.0.0.1"
        if net is not None:  # join my machine's namespace before any socket or thread exists
            master = os.environ["MASTER_ADDR"] = enter_machine(net, topo.node_of(rank))
        dist.init_process_group(
            "gloo", rank=rank, world_size=topo.world_size,
            init_method=f"tcp://{master}:{port}",
            timeout=timedelta(seconds=pg_timeout_s))
        try:
            status = ("ok", fn(*args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        status = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send_bytes(pickle.dumps(status))
    except Exception as exc:  # unpicklable result
        conn.send_bytes(pickle.dumps(("error", f"result of rank {rank} not picklable: {exc}")))
    conn.close()
    os._exit(0)


def run_emulated(fn: Callable, topology: str | Topology, *args: Any,
                 timeout_s: float = 120.0, threads_per_rank: int | None = None,
                 env: dict[str, str] | None = None, link: LinkSpec | None = None,
                 islands: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on an emulated ``NxM`` cluster; return per-rank results.

    ``link``: give every machine its own network namespace joined by a real link of
    ``link.rate_mbit`` each way (``netns.py``; needs root). Default: all ranks on loopback.
    ``islands``: the ``N`` machines are islands of one host instead (``N`` sockets of ``M``
    PCIe GPUs, ``nvml.two_socket_pcie``): no topology override, one ``LOCAL_WORLD_SIZE``, and
    every rank's ``pynvml`` the emulated host's, so detection finds the islands from the
    hardware (``hwtopo.py``); with ``link`` the inter-island link is shaped as above.

    Raises ``EmulationError`` naming every failed rank (with its traceback) if any rank
    raises, dies or does not finish within ``timeout_s``.
    """
    topo = Topology.parse(topology) if isinstance(topology, str) else topology
    world = topo.world_size
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world)
    # entry-point strategies load once here: ranks importing them concurrently after the fork
    # can meet half-initialised modules (xFuser's model modules import each other)
    specs()
    ctx = mp.get_context("fork")
    port = free_port()
    env = dict(env or {})
    pg_timeout = max(10.0, timeout_s)
    procs, conns = [], []
    network = contextlib.ExitStack()
    try:
        net = network.enter_context(emulated_network(topo.nodes, link)) if link else None
        for rank in range(world):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(rank, topo, port, fn, args, child_conn,
                                                 threads_per_rank, env, pg_timeout, net, islands),
                            daemon=True)
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        results: list[Any] = [None] * world
        done = [False] * world
        failures: list[RankFailure] = []

        def collect(wait_s: float) -> None:
            """Record the result or failure of every rank that reported within ``wait_s``."""
            for c in mp.connection.wait([c for r, c in enumerate(conns) if not done[r]],
                                        timeout=wait_s):
                r = conns.index(c)
                try:
                    kind, payload = pickle.loads(c.recv_bytes())
                except EOFError:
                    procs[r].join(timeout=1.0)  # reap it, so that its exit code is known
                    kind, payload = "error", f"died (exit code {procs[r].exitcode})"
                done[r] = True
                if kind == "ok":
                    results[r] = payload
                else:
                    failures.append(RankFailure(r, payload))

        deadline = time.monotonic() + timeout_s
        while not all(done) and not failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures += [RankFailure(r, f"did not finish within {timeout_s:.0f} s")
                             for r in range(world) if not done[r]]
                break
            collect(min(remaining, 0.5))
        if failures:
            # One failed rank: give the others a moment to report their own view
            # (their timeouts name the stage they stalled in), then stop them.
            grace = time.monotonic() + min(5.0, max(0.0, deadline - time.monotonic()))
            while not all(done) and time.monotonic() < grace:
                collect(0.2)
        if failures:
            failures.sort(key=lambda f: f.rank)
            lines = [f"emulated {topo} run failed on {len(failures)} of {world} ranks:"]
            lines += [f"--- rank {f.rank}: {f.message}" for f in failures]
            raise EmulationError("\n".join(lines))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in conns:
            c.close()
        network.close()  # after every rank is reaped
