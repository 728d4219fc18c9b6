"""Measure an emulated cluster's throttled inter-machine link (needs root; see netns.py).

    python scripts/emulate_cluster.py rates --rates 250,500 --mib 16 --reps 3

Two ranks on two machines (2x1) move ``--mib`` MiB across the link in five ways, interleaved,
``--reps`` times; prints the median time and the achieved rate per way:

- ``gloo 0->1``: one direction, ``P2PCommunicator`` on the default group;
- ``gloo 0<->1 one group``: both directions at once on one process group (gloo shares one
  socket per rank pair: DESIGN.md section 5 measured half the throughput each way);
- ``gloo all_to_all_single``: both at once through gloo's own collective;
- ``proxy get 0<-1``: one-sided get through the shm backend's proxy (comm/proxy.py);
- ``proxy get 0<->1``: both ranks get from each other at once.

The time of a way is the slowest rank's (issue to completion, after a barrier). The qdisc
bytes of the whole run are printed beside the communicators' counted bytes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from xfuser_swiftfusion.comm import make_one_sided, make_two_sided
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.emulation.netns import LinkSpec, current_network, qdisc_bytes

WAYS = ("gloo 0->1", "gloo 0<->1 one group", "gloo all_to_all_single",
        "proxy get 0<-1", "proxy get 0<->1")


def _rank(mib: int, reps: int) -> dict:
    me, other = dist.get_rank(), 1 - dist.get_rank()
    n = mib * 2 ** 20 // 4  # float32 elements
    kw = dict(rank=me, world_size=2, node_of=[0, 1], timeout_s=120.0)
    plain = make_two_sided(**kw)
    one = make_one_sided("shm", **kw)
    sym, got = (one.symmetric_empty((n,), torch.float32) for _ in range(2))  # got: across machines
    sym.fill_(float(me))                                                  # gets need it symmetric
    send, recv = torch.full((n,), float(me)), torch.empty(n)
    one.barrier_all(what="ready")
    before = qdisc_bytes(current_network()) if me == 0 else None

    def run(way: str) -> None:
        if way == "gloo 0->1":
            plain.exchange([(send, 1)] if me == 0 else [], [(recv, 0)] if me == 1 else [],
                           what=way).wait()
        elif way == "gloo all_to_all_single":  # chunk ``me`` stays, the other one crosses
            both, out = torch.cat([send, send]), torch.empty(2 * n)
            dist.all_to_all_single(out, both)
            plain.counter.count(other, n * 4)
        elif way == "gloo 0<->1 one group":
            plain.exchange([(send, other)], [(recv, other)], what=way).wait()
        elif way == "proxy get 0<-1":
            if me == 0:
                one.get(got, sym, 1, queue="other", what=way).wait()
        else:
            one.get(got, sym, other, queue="other", what=way).wait()

    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(reps):
        for way in WAYS:
            dist.barrier()
            t0 = time.perf_counter()
            run(way)
            mine = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[way].append(float(mine))
    one.barrier_all(what="done")
    counted = torch.tensor([plain.counter.inter_node_bytes + one.counter.inter_node_bytes], dtype=torch.int64)
    dist.all_reduce(counted)
    after = qdisc_bytes(current_network()) if me == 0 else None
    one.close()
    if me:
        return {}
    return {"times": times, "counted": int(counted),
            "qdisc_out": sum(after.values()) - sum(before.values())}


def rates(args: argparse.Namespace) -> None:
    nbytes = args.mib * 2 ** 20
    print(f"# {args.mib} MiB per transfer, median of {args.reps}, 2x1 emulated machines")
    print(f"{'rate':>6} {'way':<24} {'median s':>9} {'ideal s':>8} {'Mbit/s each way':>16}")
    for rate in args.rates:
        res = run_emulated(_rank, "2x1", args.mib, args.reps, link=LinkSpec(rate),
                           timeout_s=600)[0]
        ideal = nbytes / LinkSpec(rate).bytes_per_s
        for way in WAYS:
            med = statistics.median(res["times"][way])
            print(f"{rate:>6.0f} {way:<24} {med:>9.3f} {ideal:>8.3f} {nbytes * 8 / med / 1e6:>16.1f}")
        print(f"{rate:>6.0f} qdisc bytes out {res['qdisc_out']} vs counted {res['counted']} "
              f"(+{100 * (res['qdisc_out'] / res['counted'] - 1):.2f} %, includes setup traffic)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rates", help="measure transfer rates across the throttled link")
    r.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[250.0, 500.0],
                   help="link rates in Mbit/s, comma separated")
    r.add_argument("--mib", type=int, default=16)
    r.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    rates(args)


if __name__ == "__main__":
    main()
