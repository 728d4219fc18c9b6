"""The fuzzing property: every strategy equals the fp64 reference on drawn cases.

A case is a dict (batch ``B``, heads ``H``, tokens per rank ``S``, head dim ``D``, dtype,
joint text length ``Tj`` 0..9 incl. lengths not divisible by the SP degree, text ``where``
front/rear, ``layout`` contiguous ``[B, H, S, D]`` or a transposed ``[B, S, H, D]`` view,
``seed``). One emulated launch runs a batch of cases on every strategy (a launch costs ~1-2 s)
and every rank compares its output rows ``[B, H, Tj + S, D]`` with ``reference.rank_rows``.
Tolerances: fp32 1e-5, bf16/fp16 2e-2.

Used by ``tests/test_fuzz.py`` (bounded, CI) and ``scripts/fuzz.py`` (long runs).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import reference

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


def expected_rows(x: dict[str, torch.Tensor], case: dict, rank: int, world: int) -> torch.Tensor:
    """fp64 output rows ``[B, H, Tj + S, D]`` of ``rank`` in USP order (text front/rear)."""
    return reference.rank_rows(x["q"], x["k"], x["v"], rank, world,
                               (x["jq"], x["jk"], x["jv"]), case["where"])


def fuzz_rank(cases: list[dict], strategies: tuple[str, ...]) -> list[dict]:
    """Runs on every rank: every case on every strategy; one row per (case, strategy)."""
    import xfuser_swiftfusion as sf

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for i, case in enumerate(cases):
        x = case_inputs(case, world)
        local = [reference.shard(x[n], rank, world) for n in ("q", "k", "v")]
        joint = dict(joint_query=x["jq"], joint_key=x["jk"], joint_value=x["jv"],
                     joint_strategy=case["where"]) if case["Tj"] else {}
        ref = expected_rows(x, case, rank, world)
        for name in strategies:
            with sf.init_sequence_parallel(name, case["H"], timeout_s=60) as ctx:
                out = ctx.attention(*local, **joint)
                ran_as = ctx.strategy
            shape_ok = tuple(out.shape) == tuple(ref.shape)
            err = reference.max_abs_err(out, ref) if shape_ok else math.inf
            rows.append({"case": i, "strategy": name, "ran_as": ran_as, "rank": rank,
                         "err": err, "ok": shape_ok and err <= TOLERANCE[case["dtype"]]})
    return rows


def run_batch(topology: str, cases: list[dict], strategies: tuple[str, ...] = STRATEGIES) -> list[dict]:
    """One emulated launch; returns the failing rows (empty: every case passed on every rank)."""
    from xfuser_swiftfusion.emulation.launcher import run_emulated

    per_rank = run_emulated(fuzz_rank, topology, cases, strategies, timeout_s=300)
    return [r | {"topology": topology, "case_args": cases[r["case"]]}
            for rows in per_rank for r in rows if not r["ok"]]


def explore(examples: int, cases_per_launch: int = 4, strategies: tuple[str, ...] = STRATEGIES,
            on_launch: Callable[[], None] | None = None) -> dict:
    """``examples`` hypothesis-drawn launches, an equal share per topology, fresh examples
    each run (no database, not derandomized). Raises on the first failing launch (after
    hypothesis shrinks it); returns the counts: launches, cases, comparisons, per topology."""
    if "usp" in strategies:
        import xfuser_swiftfusion.integrations.xfuser.state  # noqa: F401  (import xFuser once, before forking)
    stats: dict = {"launches": 0, "cases": 0, "comparisons": 0, "per_topology": {}}

    def prop(topology: str, cases: list[dict]) -> None:
        failing = run_batch(topology, cases, strategies)
        stats["launches"] += 1
        stats["cases"] += len(cases)
        stats["comparisons"] += len(cases) * len(strategies)
        stats["per_topology"][topology] = stats["per_topology"].get(topology, 0) + len(cases)
        if on_launch is not None:
            on_launch()
        assert not failing, failing[:3]

    t0 = time.monotonic()
    for i, topology in enumerate(TOPOLOGIES):
        share = examples // len(TOPOLOGIES) + (i < examples % len(TOPOLOGIES))
        if share:
            @settings(max_examples=share, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(cases=st.lists(case_strategy, min_size=1, max_size=cases_per_launch))
            def on_topology(cases: list[dict]) -> None:
                prop(topology, cases)  # noqa: B023 - called right here, in this iteration

            on_topology()
    return stats | {"wall_s": time.monotonic() - t0}
