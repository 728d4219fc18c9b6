"""Inter-machine goodput by fan-out on the emulated cluster (root): gloo's ``all_to_all_single``
beside ``batch_isend_irecv`` with the same peers, each rank sending to its peer of the same
local index on every other machine (the group ``calibrate`` measures ``all_to_all`` on), and
the same bytes sent to the next machine only (fan-out 1), per machine link, against the line
rate. On 2x2 a machine sends to 1 other machine at once, on 3x2 to 2, on 4x1 and 4x2 to 3.

Command: sudo .venv/bin/python scripts/bench_fanout.py [--topologies 2x2,3x2,4x1,4x2]
  [--link-mbit 80] [--kib 512,2048] [--reps 5]   (about 3 minutes)
Result: benchmarks/results/fanout-80mbit.md (docs/cost-model.md, "Checks against measurements").
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.emulation.netns import LinkSpec
from xfuser_swiftfusion.hardware import host_cpu
from xfuser_swiftfusion.tools import calibrate
from xfuser_swiftfusion.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import _commit  # noqa: E402


def _rank_main(topology: str, sizes: list[int], reps: int) -> list | None:
    """Per size: MB/s per machine link of each transport."""
    topo = Topology.parse(topology)
    rank, W, M, N = dist.get_rank(), topo.world_size, topo.gpus_per_node, topo.nodes
    t, i = divmod(rank, M)
    for j in range(M):   # every rank in new_group's calls, in the same order
        g = dist.new_group(list(range(j, W, M)))
        if j == i:
            group = g
    clock = calibrate._Clock(torch.device("cpu"), reps, budget_s=math.inf)
    out = []
    for n in sizes:                            # fp32 elements per peer
        send, recv = torch.zeros(N * n), torch.empty(N * n)   # [N peers * n]

        def a2a():
            dist.all_to_all_single(recv, send, group=group)

        def p2p():
            ops = []
            for k in range(1, N):
                to, frm = ((t + k) % N) * M + i, ((t - k) % N) * M + i
                ops += [dist.P2POp(dist.isend, send[k * n:(k + 1) * n], to),
                        dist.P2POp(dist.irecv, recv[k * n:(k + 1) * n], frm)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def ring():   # the same bytes to the next machine only: fan-out 1
            nxt, prv = ((t + 1) % N) * M + i, ((t - 1) % N) * M + i
            ops = [dist.P2POp(dist.isend, send[n:], nxt), dist.P2POp(dist.irecv, recv[n:], prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        rates = {}
        for name, fn in (("all_to_all_single", a2a), ("batch_isend_irecv", p2p), ("next machine", ring)):
            wall, _ = clock.time(fn)   # calibrate's timing: median of the slowest rank's
            rates[name] = n * 4 * (N - 1) * M / wall / 1e6   # bytes out of one machine
        out.append((n * 4, rates))
    return out if rank == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topologies", default="2x2,3x2,4x1,4x2")
    ap.add_argument("--link-mbit", type=float, default=80.0)
    ap.add_argument("--kib", default="512,2048", help="KiB per peer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the table here (.md)")
    a = ap.parse_args()
    line = a.link_mbit / 8
    sizes = [int(k) * 256 for k in a.kib.split(",")]
    cmd = " ".join([Path(sys.executable).name, *sys.argv])
    lines = [f"`{cmd}` ({host_cpu()}, commit {_commit()}); MB/s per machine link, line "
             f"{line:g} MB/s", "",
             "| cluster | machines each sends to | KiB per peer | all_to_all_single | batch_isend_irecv "
             "| the same bytes to the next machine only |", "|---|---:|---:|---:|---:|---:|"]
    for topology in a.topologies.split(","):
        res = run_emulated(_rank_main, topology, topology, sizes, a.reps, timeout_s=600,
                           link=LinkSpec(a.link_mbit))[0]
        fan = Topology.parse(topology).nodes - 1
        for nbytes, r in res:
            lines.append(f"| {topology} | {fan} | {nbytes // 1024} | "
                         + " | ".join(f"{r[k]:.2f} ({100 * r[k] / line:.0f} %)"
                                      for k in ("all_to_all_single", "batch_isend_irecv", "next machine")) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
