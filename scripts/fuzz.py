"""Property-based fuzzing of every strategy against fp64 single-device attention.

For each topology (1x2, 2x2, 3x2, 4x2, 2x4, an equal share of launches), hypothesis draws
batches of cases (batch, heads,
local sequence length, head dim, dtype, joint text length 0..9 incl. lengths not divisible
by the SP degree, front/rear, contiguous ``[B, H, S, D]`` or a transposed ``[B, S, H, D]``
view); one emulated launch runs the whole batch on every strategy (a launch costs ~1-2 s,
so cases are batched). Every rank compares its output rows with an fp64 softmax attention
written here over the full sequence. Tolerances: fp32 1e-5, bf16/fp16 2e-2.

    .venv/bin/python scripts/fuzz.py --examples 200            # 200 launches
    .venv/bin/python scripts/fuzz.py --examples 50 --strategies tas,torus,swiftfusion,usp

``tests/test_fuzz.py`` runs a bounded number of launches of the same property in CI.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOPOLOGIES = ("1x2", "2x2", "3x2", "4x2", "2x4")
STRATEGIES = ("tas", "torus", "swiftfusion")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}

case_strategy = st.fixed_dictionaries({
    "B": st.integers(1, 2),
    "H": st.integers(1, 12),
    "S": st.integers(1, 6),            # tokens per rank (L = S * N * M)
    "D": st.sampled_from([4, 8, 16, 24, 64]),
    "dtype": st.sampled_from(sorted(DTYPES)),
    "Tj": st.integers(0, 9),           # joint (text) tokens
    "where": st.sampled_from(["front", "rear"]),
    "layout": st.sampled_from(["bhsd", "bshd"]),
    "seed": st.integers(0, 2**31 - 1),
})


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention of ``[B, H, Lq, D]`` queries over ``[B, H, L, D]`` keys."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def case_inputs(case: dict, world: int) -> dict[str, torch.Tensor]:
    """Global q, k, v ``[B, H, L, D]`` (possibly transposed ``[B, L, H, D]`` views) and text
    ``[B, H, Tj, D]``, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H, D, Tj, L = case["B"], case["H"], case["D"], case["Tj"], case["S"] * world
    dt = DTYPES[case["dtype"]]
    if case["layout"] == "bshd":  # [B, L, H, D] storage, viewed as [B, H, L, D]
        img = [torch.randn(B, L, H, D, generator=g).to(dt).transpose(1, 2) for _ in range(3)]
    else:
        img = [torch.randn(B, H, L, D, generator=g).to(dt) for _ in range(3)]
    txt = [torch.randn(B, H, Tj, D, generator=g).to(dt) for _ in range(3)]
    return dict(zip(("q", "k", "v", "jq", "jk", "jv"), (*img, *txt)))


def expected_rows(x: dict[str, torch.Tensor], case: dict, rank: int) -> torch.Tensor:
    """fp64 output rows of this rank in USP order: text rows front/rear, then its image rows."""
    S, Tj = case["S"], case["Tj"]
    q_mine = x["q"][:, :, rank * S:(rank + 1) * S]
    o = reference(torch.cat([x["jq"], q_mine], 2), torch.cat([x["jk"], x["k"]], 2),
                  torch.cat([x["jv"], x["v"]], 2))          # [B, H, Tj + S, D], text first
    return o if case["where"] == "front" else torch.cat([o[:, :, Tj:], o[:, :, :Tj]], 2)


def fuzz_rank(cases: list[dict], strategies: tuple[str, ...]) -> list[dict]:
    """Runs on every rank: every case on every strategy; one row per (case, strategy)."""
    import xfuser_swiftfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for i, case in enumerate(cases):
        x = case_inputs(case, world)
        S = case["S"]
        local = [x[n][:, :, rank * S:(rank + 1) * S] for n in ("q", "k", "v")]
        joint = dict(joint_query=x["jq"], joint_key=x["jk"], joint_value=x["jv"],
                     joint_strategy=case["where"]) if case["Tj"] else {}
        ref = expected_rows(x, case, rank)
        for name in strategies:
            with sf.init_sequence_parallel(name, case["H"], timeout_s=60) as ctx:
                out = ctx.attention(*local, **joint)
                ran_as = ctx.strategy
            shape_ok = tuple(out.shape) == tuple(ref.shape)
            err = (out.double() - ref).abs().max().item() if shape_ok else math.inf
            rows.append({"case": i, "strategy": name, "ran_as": ran_as, "rank": rank,
                         "err": err, "ok": shape_ok and err <= TOLERANCE[case["dtype"]]})
    return rows


def run_batch(topology: str, cases: list[dict], strategies: tuple[str, ...] = STRATEGIES) -> list[dict]:
    """One emulated launch; returns the failing rows (empty: every case passed on every rank)."""
    from xfuser_swiftfusion.launcher import run_emulated

    per_rank = run_emulated(fuzz_rank, topology, cases, strategies, timeout_s=300)
    return [r | {"topology": topology, "case_args": cases[r["case"]]}
            for rows in per_rank for r in rows if not r["ok"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=100, help="emulated launches (hypothesis examples)")
    p.add_argument("--cases-per-launch", type=int, default=4)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    args = p.parse_args(argv)
    strategies = tuple(args.strategies.split(","))
    if "usp" in strategies:
        import xfuser_swiftfusion.xfuser_state  # noqa: F401  (import xFuser once, before forking)
    stats = {"launches": 0, "cases": 0, "comparisons": 0, "per_topology": {}}
    from tqdm import tqdm
    bar = tqdm(total=args.examples, desc="fuzz launches")

    def prop(topology: str, cases: list[dict]) -> None:
        failing = run_batch(topology, cases, strategies)
        stats["launches"] += 1
        stats["cases"] += len(cases)
        stats["comparisons"] += len(cases) * len(strategies)
        stats["per_topology"][topology] = stats["per_topology"].get(topology, 0) + len(cases)
        bar.update(1)
        assert not failing, failing[:3]

    t0 = time.monotonic()
    for i, topology in enumerate(TOPOLOGIES):  # an equal share of launches per topology
        share = args.examples // len(TOPOLOGIES) + (i < args.examples % len(TOPOLOGIES))
        if share:
            @settings(max_examples=share, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(cases=st.lists(case_strategy, min_size=1, max_size=args.cases_per_launch))
            def on_topology(cases: list[dict]) -> None:
                prop(topology, cases)  # noqa: B023 - called right here, in this iteration

            on_topology()
    bar.close()
    print(f"fuzz: {stats['launches']} launches, {stats['cases']} cases, {stats['comparisons']} "
          f"case x strategy comparisons (every rank checked), cases per topology "
          f"{stats['per_topology']}, {time.monotonic() - t0:.0f} s: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
