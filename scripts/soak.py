"""Soak test: many attention calls per strategy on an emulated cluster, constant memory and
bitwise-identical outputs.

Every rank builds the same seeded inputs, runs ``--warmup`` calls (buffers, allocator and
caches reach their steady state), then records its RSS and symmetric-heap bytes, runs
``--calls`` more calls on the SAME inputs, checks each output bitwise against the first one,
and records RSS and heap again. The first output is also compared with the fp64 reference
attention, so "identical" cannot mean "identically wrong". The run and its criteria live in
``tests/support/soak.py``.

    .venv/bin/python scripts/soak.py --calls 10000 --strategies tas,torus,swiftfusion,usp \\
        --json soak.json

Pass criteria (per strategy, worst rank): RSS growth < 1 %, heap growth 0, 0 differing outputs,
error vs fp64 < 1e-5 (fp32).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# tests/ first on the path: ``support`` is tests/support (xFuser's wheel installs a ``tests``
# package of its own, so the package is imported as ``support``, as the tests import it)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from xfuser_swiftfusion.tools.quiet import quiet_libraries  # noqa: E402
from support import soak  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()  # before the ranks load xFuser: the result, not setup notices
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10_000, help="measured calls per strategy")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--strategies", default=",".join(soak.STRATEGIES))
    p.add_argument("--topology", default="2x2", metavar="NxM")
    p.add_argument("--shape", default="1,2,64,16",
                   help="global B,H,L,D (H=2 on 2x2: Ulysses 2 x Ring 2, every stage runs)")
    p.add_argument("--joint-tokens", type=int, default=3)
    p.add_argument("--json", help="write the summaries here")
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    rows = soak.run_soak(args.strategies.split(","), args.calls, args.topology, args.warmup, shape,
                         args.joint_tokens, progress=True)
    print(f"{'strategy':<12} {'calls':>6} {'RSS start/end MiB':>18} {'growth':>8} {'heap B':>8} "
          f"{'differing':>9} {'ms/call':>8} {'err':>9}  result")
    for r in rows:
        print(f"{r['strategy']:<12} {r['calls']:>6} {r['rss_start_mib']:>8.1f}/{r['rss_end_mib']:<9.1f} "
              f"{100 * r['rss_growth_max']:>7.3f}% {r['heap_end_bytes']:>8} {r['differing_outputs']:>9} "
              f"{r['median_call_ms']:>8.2f} {r['max_abs_err']:>9.2e}  {'PASS' if r['passed'] else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
