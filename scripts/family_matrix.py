"""Every xFuser 0.7.0 model family under every strategy: the table behind the README's model
table, from the same runs as ``tests/test_families.py``.

    python scripts/family_matrix.py [--families wan,flux] [--json out.json]

Per family: xFuser's wrapper as its runner builds it, a tiny random diffusers model, one
forward per case (``usp``, ``tas``, ``torus``, ``swiftfusion``, ``auto`` on their own mesh,
then U2xR2 where the runner allows a ring) on emulated 2x2, against the plain diffusers model
on one process (fp32). Prints one markdown row per family: the strategies that ran with no
fallback, the largest relative error over all cases and ranks, and any fallback or error.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

from xfuser_swiftfusion.tools.quiet import quiet_libraries  # noqa: E402

quiet_libraries()  # before xFuser loads

from xfuser_swiftfusion.integrations import xfuser as xp  # noqa: E402

xp.install()
import xfuser  # noqa: E402,F401  (imported once in the parent: forked ranks inherit it)

from support import families  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import EmulationError, run_emulated  # noqa: E402


def _case(case: tuple) -> str:
    strategy, u, r = case
    return strategy if u is None else f"{strategy} U{u}xR{r}"


def family_row(name: str) -> dict:
    """Run every case of ``name`` on the emulated cluster; summarise over ranks."""
    fam = families.FAMILIES[name]
    with tempfile.TemporaryDirectory() as tmp:
        want, path, inputs = families.prepare(name, tmp)
        try:
            results = run_emulated(families.run_cases, families.TOPOLOGY, name,
                                   families.cases(name), want, path, inputs, timeout_s=600)
        except EmulationError as exc:
            return {"family": name, "runner": fam.runner, "wrapper": fam.wrapper, "ran": [],
                    "max_err": None, "problems": [str(exc).splitlines()[0]]}
    ran, errs, problems = [], [], []
    for case in families.cases(name):
        rows = [next(r for r in rank_rows if r["case"] == case) for rank_rows in results]
        bad = [r.get("error") or (f"fell back {r['fallbacks']}" if r["fallbacks"] else None)
               or (r["err"] if isinstance(r["err"], str) else None) for r in rows]
        bad = [b for b in bad if b]
        if bad:
            problems.append(f"{_case(case)}: {bad[0]}")
            continue
        ran.append(_case(case))
        errs.extend(r["err"] for r in rows)
    return {"family": name, "runner": fam.runner, "wrapper": fam.wrapper, "ran": ran,
            "max_err": max(errs) if errs else None, "problems": problems}


def main() -> None:
    # the table is the output, with every case's fallbacks and errors: no log lines at all
    logging.disable(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(families.FAMILIES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    print("| family | runner | wrapper | cases without fallback | max rel. error | fallbacks / errors |")
    print("|---|---|---|---|---:|---|")
    for name in args.families.split(","):
        row = family_row(name)
        rows.append(row)
        err = f"{row['max_err']:.1e}" if row["max_err"] is not None else "-"
        print(f"| {name} | {row['runner']} | `{row['wrapper']}` | {len(row['ran'])} "
              f"({', '.join(row['ran'])}) | {err} | {'; '.join(row['problems'])[:300] or 'none'} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
