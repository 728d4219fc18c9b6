"""The targets per benchmark point, from ``scripts/bench_layer.py`` JSON results, as a
markdown table on stdout (docs/benchmark-misses.md quotes it).

One row per point (topology, link, B, L, H, D), columns as the targets are stated:

- ``sf / usp``: usp latency / swiftfusion latency (medians), then the median of the
  per-repetition ratios ("paired": strategies run interleaved inside every repetition) and in
  how many repetitions swiftfusion was faster;
- ``torus / tas``: tas latency / torus latency (medians);
- ``hidden``: share of the link time that did not add to swiftfusion's latency,
  ``1 - exposed / link time`` with exposed = latency - compute-only, for two link times:
  ``line``, the formula's inter-machine bytes per machine at the link's line rate (both
  directions carry that much), and ``usp``, usp's own exposed time per inter-machine byte
  times swiftfusion's bytes: what the link and the emulated transport took for these bytes
  when nothing computed beside them (usp's all-to-alls are blocking; with a ring, 4x2, its
  K/V all-gather hides behind one ring step at most);
- ``qdisc``: bytes the kernel's qdiscs sent over the formula, max over strategies, in %;
- ``peak sf / usp``: peak RSS per rank, swiftfusion over usp;
- ``auto / best``: auto's latency over the fastest of usp, tas, torus, swiftfusion;
- ``model error``: range of (predicted - measured) / measured over the point's rows, in %.

Command: .venv/bin/python scripts/summarize_benchmarks.py benchmarks/results/layer-*.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from xfuser_swiftfusion.topology import Topology

STRATS = ("usp", "tas", "torus", "swiftfusion")  # the table's columns (usp: the baseline)


def _point_row(rows: dict[str, dict]) -> str:
    usp, tas, torus, sf = (rows[s] for s in STRATS)
    paired = [u / s for u, s in zip(usp["latency_reps_s"], sf["latency_reps_s"])]
    wins = sum(p > 1 for p in paired)
    link = usp["link"]
    if link:
        nominal = sf["formula_total_bytes"] / Topology.parse(usp["topo"]).nodes / (link * 1e6 / 8)
        measured = usp["exposed_s"] * sf["inter_bytes"] / usp["inter_bytes"]
        hidden = (f"{100 * (1 - sf['exposed_s'] / nominal):.0f}% of {nominal * 1e3:.0f} / "
                  f"{100 * (1 - sf['exposed_s'] / measured):.0f}% of {measured * 1e3:.0f} ms")
        qdisc = max(100 * (r["qdisc_bytes"] / r["formula_total_bytes"] - 1) for r in rows.values())
        qdisc_s = f"{qdisc:+.1f}%"
    else:
        hidden = qdisc_s = "-"
    best = min(rows[s]["latency_s"] for s in STRATS)
    auto = rows.get("auto")
    auto_s = f"{auto['latency_s'] / best:.2f}x ({auto['ran_as'].removeprefix('auto->')})" if auto else "-"
    errs = [r["error_pct"] for r in rows.values()]
    return (f"| {usp['topo']} | {link or 'loopback'} | {usp['B']} | {usp['L']} | {usp['D']} | "
            f"{usp['latency_s'] / sf['latency_s']:.2f}x ({statistics.median(paired):.2f}, {wins}/{len(paired)}) | "
            f"{tas['latency_s'] / torus['latency_s']:.2f}x | {hidden} | {qdisc_s} | "
            f"{sf['peak_rss'] / usp['peak_rss']:.2f}x | {auto_s} | {min(errs):+.0f}..{max(errs):+.0f}% |\n")


def summarize(paths: list[str]) -> str:
    points: dict[tuple, dict[str, dict]] = {}
    for p in paths:
        for r in json.load(open(p))["rows"]:
            key = (r["link"] or 0, r["topo"], r["B"], r["L"], r["H"], r["D"])
            points.setdefault(key, {})[r["strategy"]] = r
    head = ("| topo | link Mbit | B | L | D | sf / usp (paired, wins) | torus / tas | hidden (sf): line / usp | "
            "qdisc vs formula | peak sf / usp | auto / best | model error |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(_point_row(rows) for _, rows in sorted(points.items())
                          if all(s in rows for s in STRATS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_layer.py JSON files")
    print(summarize(ap.parse_args().results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
