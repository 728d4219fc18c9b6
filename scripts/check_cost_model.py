"""The cost model against measurements on the emulated cluster: BENCHMARKS.md's 18 points of
"Is it faster than usp?" (H12, bf16; links throttled by tc tbf, needs root).

For each (topology, link rate) of those points: ``swiftfusion calibrate --emulate`` on this
host (with the exact attention calls of the points' layers), then ``scripts/bench_layer.py``'s
measurement of every strategy and ``auto`` (which picks with that profile) at the points, and
the model's prediction with that profile for what ran. Output: one row per point (predicted,
measured, error per strategy; auto's pick; the fastest measured; auto within 5 % of it) and
the summary against the targets: every prediction within +-15 %, auto within 5 % of the
fastest at >= 16 of 18 points, each calibrated link within +-15 % of its rate (per cluster its
fastest transfer kind, and every kind).

``--stored FILE...``: no run; the model with ``--hardware`` (default ``cpu-emulated``) against
measurements stored by ``bench_layer.py`` (their ``predicted_s``, the model of their commit,
shown beside it). Auto's pick then has a measured latency only where it is a strategy at its
default degree that was measured.

``--recalibrate FILE``: a check's ``.json`` (``--out``'s): calibrate each cluster again and
predict FILE's measured rows with the new profiles (a change to ``calibrate``, checked without
measuring again); auto's latency counts where the new profile picks what ran.

``--paper``: no run; SFU/USP and TAS/USP per attention layer predicted on ``--hardware``
(default ``p4de-datasheet``, datasheet rates: the paper's regime) at the paper's layerwise points (4 x 8 A100, 24 heads, its
default mesh U8 x R4: L 96k-192k at B=1 and B 1-4 at L=128k, for D 32, 64, 128), averaged as the
paper averages them, beside the paper's averages (docs/cost-model.md).

Command: sudo .venv/bin/python scripts/check_cost_model.py [--points 0,4] [--reps 5]
  [--out benchmarks/results/check-cost-model] [--resume]   (about 75 min on a quiet 2-core
  host; each group of points is kept in <out>.partial.jsonl as it completes, and --resume
  measures only the groups a run cut short did not)
  .venv/bin/python scripts/check_cost_model.py --stored benchmarks/results/layer-*.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_layer  # noqa: E402  (scripts/: the measurement of one point)

from xfuser_swiftfusion.cost_model import HARDWARE_ENV, Workload, get_profile, predict, recommend  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.emulation.netns import LinkSpec  # noqa: E402
from xfuser_swiftfusion.hardware import host_cpu, save_profile  # noqa: E402
from xfuser_swiftfusion.tools import calibrate  # noqa: E402
from xfuser_swiftfusion.topology import Topology  # noqa: E402

H, DTYPE = 12, "bf16"
POINTS = [  # (topology, link Mbit/s, B, L, D): BENCHMARKS.md "Is it faster than usp?", in order
    ("4x1", 80, 1, 16384, 64), ("4x2", 80, 1, 16384, 64), ("2x2", 80, 1, 16384, 64),
    ("3x2", 80, 1, 16380, 64), ("4x1", 80, 1, 4096, 64), ("4x1", 80, 1, 8192, 64),
    ("4x1", 80, 2, 8192, 64), ("4x1", 80, 4, 8192, 64), ("4x2", 80, 1, 4096, 64),
    ("4x2", 80, 1, 8192, 64), ("4x2", 80, 1, 16384, 32), ("4x2", 80, 1, 16384, 128),
    ("4x2", 80, 2, 8192, 64), ("4x2", 80, 4, 8192, 64), ("4x1", 160, 1, 16384, 64),
    ("4x2", 160, 1, 16384, 64), ("4x1", 2000, 1, 16384, 64), ("4x2", 2000, 1, 16384, 64)]
STRATEGIES = ("usp", "tas", "torus", "swiftfusion")
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# the paper's layerwise averages (shared/paper: \DefineEval), SFU and TAS over USP
PAPER = {"L=96k": (1.59, 1.41), "L=128k": (1.27, 1.14), "L=160k": (1.07, 1.11),
         "L=192k": (1.14, 1.06), "D=32": (1.12, 1.05), "D=64": (1.28, 1.16), "D=128": (1.32, 1.23),
         "B=1": (1.27, 1.14), "B=2": (1.27, 1.15), "B=4": (1.13, 1.04)}


def paper(hardware: str) -> str:
    """The paper comparison: each average over the layerwise points it covers (the L sweep at
    B=1, the B sweep at L=128k; a D average over both, 128k B=1 once)."""
    topo, prof = Topology(4, 8), get_profile(hardware)
    Ls = {"96k": 96 * 1024, "128k": 128 * 1024, "160k": 160 * 1024, "192k": 192 * 1024}
    pts = {}
    for D in (32, 64, 128):
        for name, L in Ls.items():
            for B in ((1, 2, 4) if name == "128k" else (1,)):
                w = Workload(B, L, 24, D)
                lat = {s: predict(s, topo, w, prof).latency_s for s in ("usp", "tas", "swiftfusion")}
                pts[(D, name, B)] = (lat["usp"] / lat["swiftfusion"], lat["usp"] / lat["tas"])
    groups = {f"L={n}": [k for k in pts if k[1] == n and k[2] == 1] for n in Ls}
    groups |= {f"D={d}": [k for k in pts if k[0] == d] for d in (32, 64, 128)}
    groups |= {f"B={b}": [k for k in pts if k[1] == "128k" and k[2] == b] for b in (1, 2, 4)}
    lines = [f"| average over | points | SFU/USP predicted | paper | off | TAS/USP predicted | paper | off |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for g, keys in groups.items():
        sfu = statistics.mean(pts[k][0] for k in keys)
        tas = statistics.mean(pts[k][1] for k in keys)
        ps, pt = PAPER[g]
        lines.append(f"| {g} | {len(keys)} | {sfu:.2f}x | {ps:.2f}x | {100 * (sfu / ps - 1):+.0f} % | "
                     f"{tas:.2f}x | {pt:.2f}x | {100 * (tas / pt - 1):+.0f} % |")
    each = ["", "| D | L | B | SFU/USP | TAS/USP |", "|---:|---|---:|---:|---:|"]
    each += [f"| {D} | {n} | {B} | {v[0]:.2f}x | {v[1]:.2f}x |" for (D, n, B), v in pts.items()]
    return "\n".join(lines + each)


def _groups(indices: list[int]) -> dict[tuple[str, float], list[int]]:
    out: dict = {}
    for i in indices:
        topo, link = POINTS[i][:2]
        out.setdefault((topo, float(link)), []).append(i)
    return out


def _calibrate(topo: str, link: float, idx: list[int], out_dir: Path, budget: float) -> tuple[str, dict]:
    """Profile of ``topo`` at ``link`` Mbit/s with the points' exact attention calls; its
    path and how close each transfer kind's inter-machine rate came to the link's."""
    cfg = calibrate.CalibrateConfig(
        workloads=tuple((POINTS[i][2], POINTS[i][3], H, POINTS[i][4], DTYPE) for i in idx),
        budget_s=budget, topology=topo)
    raw = run_emulated(calibrate._rank_main, topo, cfg, timeout_s=1800, link=LinkSpec(link))[0]
    path = out_dir / f"hw-{topo}-{link:g}mbit.json"
    prof = calibrate.build_profile(raw, path.stem, f"check_cost_model.py calibrate {topo} {link:g}", link)
    save_profile(prof, path)
    print(calibrate.format_table(prof, raw, link), flush=True)
    wire = link * 1e6 / 8
    return str(path), {k: 100 * (v["inter"]["bw"] / wire - 1)
                       for k, v in raw["transfers"].items() if "inter" in v}


def _measure(topo: str, link: float, idx: list[int], hardware: str, reps: int) -> list[dict]:
    os.environ[HARDWARE_ENV] = hardware  # auto's profile in every forked rank
    pts = [dict(topo=topo, link=link, tcp_queue_kb=None, B=POINTS[i][2], L=POINTS[i][3], H=H,
                D=POINTS[i][4], dtype=DTYPE) for i in idx]
    rows = run_emulated(bench_layer._rank_main, topo, pts, [*STRATEGIES, "auto"], reps, False,
                        timeout_s=7200, link=LinkSpec(link))[0]
    bench_layer._predict(rows, Topology.parse(topo), link, hardware)
    return rows


def _point_key(r: dict) -> tuple:
    return (r["topo"], float(r["link"]), r["B"], r["L"], r["D"])


def table(rows: list[dict], hardware_of: dict, stored: bool, repicked: bool = False
          ) -> tuple[str, dict]:
    """Markdown: one line per point; and the summary figures. ``repicked``: the profiles are
    not the ones auto ran with; its measured latency counts only where they pick what ran."""
    by: dict = {}
    for r in rows:
        by.setdefault(_point_key(r), {})[r["strategy"]] = r
    head = ("| cluster | link Mbit/s | B | L | D | " + " | ".join(
        f"{s} pred / meas ms (err)" for s in STRATEGIES)
        + " | auto's pick | auto meas ms | fastest | auto / fastest |\n|"
        + "---|" * (9 + len(STRATEGIES)) + "\n")
    lines, errs, within5, judged = [], [], 0, 0
    for key in sorted(by, key=lambda k: next((i for i, p in enumerate(POINTS)
                                               if (p[0], float(p[1]), *p[2:]) == k), 99)):
        rs = by[key]
        topo, link, B, L, D = key
        prof = get_profile(hardware_of[(topo, link)], Topology.parse(topo), link)
        w = Workload(B, L, H, D, DTYPE)
        cells = []
        for s in STRATEGIES:
            r = rs.get(s)
            if r is None:
                cells.append("-")
                continue
            p = predict(r.get("ran", s), Topology.parse(topo), w, prof, r.get("ulysses")).latency_s
            e = 100 * (p - r["latency_s"]) / r["latency_s"]
            errs.append(e)
            old = f"; stored {r['predicted_s'] * 1e3:.0f}" if stored and "predicted_s" in r else ""
            cells.append(f"{p * 1e3:.0f} / {r['latency_s'] * 1e3:.0f} ({e:+.0f} %{old})")
        pick = recommend(Topology.parse(topo), w, prof)
        measured = {s: r["latency_s"] for s, r in rs.items()}
        fastest = min(measured, key=measured.get)
        if "auto" in rs:   # what auto ran, measured
            auto_s, ran = rs["auto"]["latency_s"], rs["auto"]["ran_as"]
            if repicked and ran != f"auto->{pick.strategy}U{pick.ulysses}":
                auto_s, ran = None, f"{pick.strategy} U{pick.ulysses} (model; {ran} measured)"
        else:              # stored runs: the pick's own row, if it ran at its default degree
            row = rs.get(pick.strategy)
            auto_s = row["latency_s"] if row and row.get("ulysses", pick.ulysses) == pick.ulysses \
                and predict(pick.strategy, Topology.parse(topo), w, prof).ulysses == pick.ulysses else None
            ran = f"{pick.strategy} U{pick.ulysses} (model)"
        ratio = auto_s / measured[fastest] if auto_s else None
        if ratio is not None:
            judged += 1
            within5 += ratio <= 1.05
        lines.append(f"| {topo} | {link:g} | {B} | {L} | {D} | " + " | ".join(cells)
                     + f" | {ran} | {auto_s * 1e3 if auto_s else float('nan'):.0f} | {fastest} "
                     f"{measured[fastest] * 1e3:.0f} | "
                     + (f"{ratio:.2f}{' ok' if ratio <= 1.05 else ''}" if ratio else "not measured") + " |")
    summary = {"rows": len(errs), "within_15pct": sum(abs(e) <= 15 for e in errs),
               "median_abs_err_pct": statistics.median(abs(e) for e in errs) if errs else None,
               "max_abs_err_pct": max((abs(e) for e in errs), default=None),
               "points": len(by), "auto_judged": judged, "auto_within_5pct": within5}
    return head + "\n".join(lines) + "\n", summary


def links_summary(links: dict[str, dict[str, float]]) -> dict[str, str]:
    """Of ``{cluster: {kind: % off the link's rate}}``: the kinds within +-15 %, and the
    clusters whose fastest kind is (the link's rate as the best transport carries it; each kind
    is also held back by its own transport and by the host's CPU, ``bench_link_ceiling.py``)."""
    rec = [abs(v) for d in links.values() for v in d.values()]
    best = [max(d.values()) for d in links.values() if d]
    return {"links_within_15pct": f"{sum(v <= 15 for v in rec)}/{len(rec)}",
            "links_fastest_kind_within_15pct": f"{sum(abs(v) <= 15 for v in best)}/{len(best)}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=None, help="comma-separated indices into the 18 points")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calibrate-budget", type=float, default=100.0)
    ap.add_argument("--stored", nargs="+", metavar="FILE", help="bench_layer.py results instead of a run")
    ap.add_argument("--paper", action="store_true", help="the paper's layerwise points (no run)")
    ap.add_argument("--hardware", default=None,
                    help="--stored: the profile (default cpu-emulated); --paper: (default p4de-datasheet)")
    ap.add_argument("--out", default=str(RESULTS / "check-cost-model"))
    ap.add_argument("--recalibrate", metavar="FILE",
                    help="a check's .json: calibrate again, predict its measured rows (no measurement)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the groups of points that <out>.partial.jsonl holds from a run cut short")
    a = ap.parse_args()
    t0 = time.time()
    cmd = " ".join([os.path.relpath(sys.executable), *sys.argv])
    if a.paper:
        print(f"`{cmd}`\n\n{paper(a.hardware or 'p4de-datasheet')}")
        return 0
    if a.stored:
        a.hardware = a.hardware or "cpu-emulated"
        rows = [r for f in a.stored for r in json.load(open(f))["rows"]]
        keys = {(p[0], float(p[1]), *p[2:]) for p in POINTS}
        rows = [r for r in rows if _point_key(r) in keys and r["strategy"] in STRATEGIES]
        md, summary = table(rows, {k[:2]: a.hardware for k in map(_point_key, rows)}, True)
        print(f"`{cmd}`\n\n{md}\n{json.dumps(summary)}")
        return 0
    idx = [int(x) for x in a.points.split(",")] if a.points else list(range(len(POINTS)))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, hardware_of, links = [], {}, {}
    measured = json.load(open(a.recalibrate))["rows"] if a.recalibrate else None
    # each group's profile and rows, written as it completes: a run cut short keeps what it
    # measured, and --resume measures only the groups missing from it
    partial = out.with_suffix(".partial.jsonl")
    done = {}
    if a.resume and partial.exists():
        for line in partial.read_text().splitlines():
            g = json.loads(line)
            done[(g["topo"], g["link"])] = g
    elif partial.exists():
        partial.unlink()
    for (topo, link), group in _groups(idx).items():
        g = done.get((topo, link))
        if g is None or g["points"] != group:
            path, recovered = _calibrate(topo, link, group, out.parent, a.calibrate_budget)
            mine = [r for r in measured or () if (r["topo"], float(r["link"])) == (topo, link)]
            g = {"topo": topo, "link": link, "points": group, "profile": path, "links": recovered,
                 "rows": mine if measured else _measure(topo, link, group, path, a.reps)}
            with open(partial, "a") as f:
                f.write(json.dumps(g) + "\n")
        hardware_of[(topo, link)] = g["profile"]
        links[f"{topo}@{link:g}"] = g["links"]
        rows += g["rows"]
    md, summary = table(rows, hardware_of, False, repicked=measured is not None)
    summary.update(links_summary(links))
    links_md = "\n".join(f"- {k}: " + ", ".join(f"{kind} {v:+.0f} %" for kind, v in d.items())
                         for k, d in links.items())
    text = (f"`{cmd}` ({time.time() - t0:.0f} s, {host_cpu()}, commit {bench_layer._commit()})\n\n"
            f"{md}\ncalibrated inter-machine rate vs the link's, per transfer kind:\n{links_md}\n\n"
            f"{json.dumps(summary)}\n")
    print(text)
    out.with_suffix(".md").write_text(text)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"command": cmd, "commit": bench_layer._commit(), "cpu": host_cpu(),
                   "profiles": {f"{t}@{l:g}": p for (t, l), p in hardware_of.items()},
                   "links_pct": links, "summary": summary, "rows": rows}, f, indent=1)
    partial.unlink(missing_ok=True)
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
