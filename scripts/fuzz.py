"""Property-based fuzzing of every strategy against fp64 single-device attention.

For each topology (1x2, 2x2, 3x2, 4x2, 2x4, an equal share of launches), hypothesis draws
batches of cases (batch, heads, local sequence length, head dim, dtype, joint text length
0..9 incl. lengths not divisible by the SP degree, front/rear, contiguous ``[B, H, S, D]`` or
a transposed ``[B, S, H, D]`` view); one emulated launch runs the whole batch on every
strategy (a launch costs ~1-2 s, so cases are batched). Every rank compares its output rows
with the fp64 reference attention over the full sequence. Tolerances: fp32 1e-5, bf16/fp16
2e-2. The property, case generator and reference live in ``tests/support/``.

    .venv/bin/python scripts/fuzz.py --examples 200            # 200 launches
    .venv/bin/python scripts/fuzz.py --examples 50 --strategies tas,torus,swiftfusion,usp

``tests/test_fuzz.py`` runs a bounded number of launches of the same property in CI.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# tests/ first on the path: ``support`` is tests/support (xFuser's wheel installs a ``tests``
# package of its own, so the package is imported as ``support``, as the tests import it)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from xfuser_swiftfusion.tools.quiet import quiet_libraries  # noqa: E402
from support import fuzz  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()  # before the ranks load xFuser: the result, not setup notices
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=100, help="emulated launches (hypothesis examples)")
    p.add_argument("--cases-per-launch", type=int, default=4)
    p.add_argument("--strategies", default=",".join(fuzz.STRATEGIES))
    args = p.parse_args(argv)
    strategies = tuple(args.strategies.split(","))
    from tqdm import tqdm
    with tqdm(total=args.examples, desc="fuzz launches") as bar:
        stats = fuzz.explore(args.examples, args.cases_per_launch, strategies,
                             on_launch=lambda: bar.update(1))
    print(f"fuzz: {stats['launches']} launches, {stats['cases']} cases, {stats['comparisons']} "
          f"case x strategy comparisons (every rank checked), cases per topology "
          f"{stats['per_topology']}, {stats['wall_s']:.0f} s: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
