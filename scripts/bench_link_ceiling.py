"""What this host's emulated links carry with nothing else running (root): raw TCP goodput per
machine link, one machine sending to the next alone, and every machine sending to the next at
once (a ring: each link carries one stream out and one in). No torch, no gloo, no compute: the
ceiling any transport `calibrate` measures can reach on this host, beside the line rate.

Command: sudo .venv/bin/python scripts/bench_link_ceiling.py [--machines 2,4] [--link-mbit 80,160,2000]
  [--seconds 1.5]   (about 1 minute)
Result: benchmarks/results/link-ceiling.md (docs/cost-model.md, "Checks against measurements").
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

from xfuser_swiftfusion.emulation.netns import LinkSpec, emulated_network, enter_netns
from xfuser_swiftfusion.hardware import host_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import _commit  # noqa: E402

PORT, CHUNK, TIMEOUT_S = 5555, 1 << 20, 60.0


def _machine(net, i: int, peer: int | None, receives: bool, nbytes: int, w: int) -> None:
    """In a forked child: join machine ``i``, accept one stream of ``nbytes`` (``receives``),
    send ``nbytes`` to ``peer`` (None: send nothing), write the seconds taken to fd ``w``."""
    enter_netns(net.netns(i))
    srv = socket.create_server((net.addr(i), PORT), reuse_port=False)
    srv.settimeout(TIMEOUT_S)
    got = [0]

    def rx() -> None:
        conn, _ = srv.accept()
        conn.settimeout(TIMEOUT_S)
        buf = bytearray(CHUNK)
        while got[0] < nbytes:
            k = conn.recv_into(buf)
            if not k:
                break
            got[0] += k
        conn.sendall(b"x")

    th = threading.Thread(target=rx, daemon=True) if receives else None
    if th:
        th.start()
    time.sleep(0.5)                  # every server listens before any client connects
    t0 = time.perf_counter()
    if peer is not None:
        c = socket.create_connection((net.addr(peer), PORT), timeout=TIMEOUT_S)
        data = bytes(CHUNK)
        for _ in range(nbytes // CHUNK):
            c.sendall(data)
        if c.recv(1) != b"x":        # the receiver has every byte
            raise RuntimeError(f"machine {i}: machine {peer} closed before receiving all bytes")
    if th:
        th.join(TIMEOUT_S)
        if th.is_alive():
            raise TimeoutError(f"machine {i}: receiving from machine {(i - 1) % net.nodes} "
                               f"took over {TIMEOUT_S:.0f} s")
    os.write(w, f"{time.perf_counter() - t0}\n".encode())


def measure(machines: int, rate_mbit: float, seconds: float, ring: bool) -> list[float]:
    """Goodput (bytes/s) of each sending machine's link: machine 0 -> 1 alone, or each
    machine -> the next at once (``ring``)."""
    nbytes = max(1, int(rate_mbit * 1e6 / 8 * seconds) // CHUNK) * CHUNK
    senders = range(machines) if ring else range(1)
    with emulated_network(machines, LinkSpec(rate_mbit)) as net:
        kids = []
        for i in range(machines if ring else 2):
            r, w = os.pipe()
            peer = (i + 1) % machines if i in senders else None
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(r)
                    _machine(net, i, peer, ring or i == 1, nbytes, w)
                except BaseException as e:  # noqa: BLE001  (reported by the parent)
                    os.write(w, f"error {e!r}\n".encode())
                    code = 1
                os._exit(code)
            os.close(w)
            kids.append((i, pid, r))
        out = []
        for i, pid, r in kids:
            _, status = os.waitpid(pid, 0)
            text = os.read(r, 4096).decode().strip()
            os.close(r)
            if status != 0 or text.startswith("error"):
                raise RuntimeError(f"machine {i} at {rate_mbit:g} Mbit/s: {text or status}")
            if i in senders:
                out.append(nbytes / float(text))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="2,4")
    ap.add_argument("--link-mbit", default="80,160,2000")
    ap.add_argument("--seconds", type=float, default=1.5, help="line-rate seconds per stream")
    ap.add_argument("--out", default=None, help="also write the table to this .md")
    a = ap.parse_args()
    rows = ["| machines | link Mbit/s | one stream, % of line | every machine at once, % of line |",
            "|---:|---:|---:|---:|"]
    for n in map(int, a.machines.split(",")):
        for rate in map(float, a.link_mbit.split(",")):
            wire = rate * 1e6 / 8
            one = measure(n, rate, a.seconds, ring=False)[0] / wire * 100
            ring = [g / wire * 100 for g in measure(n, rate, a.seconds, ring=True)]
            rows.append(f"| {n} | {rate:g} | {one:.0f} | {min(ring):.0f} - {max(ring):.0f} |")
            print(rows[-1], flush=True)
    cmd = " ".join([os.path.relpath(sys.executable), *sys.argv])
    text = f"`{cmd}` ({host_cpu()}, commit {_commit()})\n\n" + "\n".join(rows) + "\n"
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
