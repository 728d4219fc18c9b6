"""Plot layer-benchmark results (``scripts/bench_layer.py`` JSON) as latency normalised to usp,
one bar group per point, like the paper's layerwise figures; measured bars (median, whiskers:
interquartile range of the repetitions) with the cost model's prediction as markers.

Command: .venv/bin/python scripts/plot_benchmarks.py benchmarks/results/layer-*.json
  [--out benchmarks/layer.png]

The results folder holds JSON only: the plot goes to ``benchmarks/`` (default: the first
result's name with ``.png``). Strategies appear in the order the results list them; usp is the
baseline every bar is normalised to.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINE = "usp"  # xFuser's own USP: the bars are latency / its latency
PLOTS = Path(__file__).resolve().parent.parent / "benchmarks"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [r for f in a.results for r in json.load(open(f))["rows"] if "latency_s" in r]
    key = lambda r: (r["topo"], r["link"] or 0, r["B"], r["L"], r["D"])  # noqa: E731
    points = sorted({key(r) for r in rows})
    usp = {key(r): r for r in rows if r["strategy"] == BASELINE}
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))  # bench_layer's order
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(points)), 3.6))
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        for j, pt in enumerate(points):
            r = next((r for r in rows if key(r) == pt and r["strategy"] == s), None)
            if r is None or pt not in usp:
                continue
            base = usp[pt]["latency_s"]
            x = j + (i - (len(strategies) - 1) / 2) * width
            ax.bar(x, r["latency_s"] / base, width, color=f"C{i}", label=s if j == 0 else None)
            if len(r.get("latency_reps_s", ())) >= 4:  # interquartile range of the repetitions
                q1, _, q3 = statistics.quantiles(r["latency_reps_s"], n=4)
                ax.errorbar(x, r["latency_s"] / base, yerr=[[(r["latency_s"] - q1) / base],
                                                            [(q3 - r["latency_s"]) / base]],
                            fmt="none", ecolor="k", lw=0.8, capsize=2)
            ax.bar(x, r["compute_s"] / base, width * 0.4, color="k", alpha=0.35,
                   label="compute only" if (i, j) == (0, 0) else None)
            ax.plot(x, r["predicted_s"] / usp[pt]["predicted_s"], "kx",
                    label="model (normalised)" if (i, j) == (0, 0) else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"{t}\n{'%g Mbit' % ln if ln else 'loopback'}\nB{b} L{L} D{d}"
                        for t, ln, b, L, d in points], fontsize=8)
    ax.set_ylabel(f"latency / {BASELINE} latency")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Attention layer on the emulated cluster (median)")
    fig.tight_layout()
    out = Path(a.out) if a.out else PLOTS / (Path(a.results[0]).stem + ".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
