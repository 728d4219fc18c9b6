"""``swiftfusion check``: every strategy against single-device attention, on this cluster.

Every rank builds the same global inputs from a seed, runs the strategy on its shard and
compares its output rows with an fp64 softmax attention over the whole sequence (computed
locally, independently of any strategy code). Tolerances: fp32 1e-5, bf16 / fp16 2e-2.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class CheckCase:
    heads: int = 24
    seq_len: int = 1152          # global image tokens (divisible by the SP degree)
    head_dim: int = 64
    batch: int = 1
    dtype: str = "fp32"
    joint_tokens: int = 0
    joint_strategy: str = "front"
    seed: int = 0


@dataclass
class CheckRow:
    strategy: str
    ran_as: str
    mesh: str
    max_abs_err: float
    tolerance: float
    passed: bool
    inter_node_bytes: int
    error: str = ""


def global_inputs(case: CheckCase, device: torch.device) -> dict[str, torch.Tensor]:
    """Deterministic global q, k, v ``[B, H, L, D]`` and text tensors ``[B, H, Tj, D]``."""
    g = torch.Generator().manual_seed(case.seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    jshape = (case.batch, case.heads, case.joint_tokens, case.head_dim)
    dtype = DTYPES[case.dtype]
    make = lambda s: torch.randn(s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return {"q": make(shape), "k": make(shape), "v": make(shape),
            "jq": make(jshape), "jk": make(jshape), "jv": make(jshape)}


def reference_rows(x: dict[str, torch.Tensor], case: CheckCase, rank: int, world: int) -> torch.Tensor:
    """fp64 attention of this rank's rows (text queries + its image shard) over all keys."""
    S, Tj = case.seq_len // world, case.joint_tokens
    q_img = x["q"][:, :, rank * S:(rank + 1) * S]
    q = torch.cat([x["jq"], q_img], dim=2).double()        # [B, H, Tj + S, D]
    k = torch.cat([x["jk"], x["k"]], dim=2).double()       # [B, H, Tj + L, D]
    v = torch.cat([x["jv"], x["v"]], dim=2).double()
    o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(case.head_dim), dim=-1) @ v
    txt, img = o[:, :, :Tj], o[:, :, Tj:]
    if Tj == 0:
        return img
    return torch.cat([txt, img] if case.joint_strategy == "front" else [img, txt], dim=2)


def check_strategy(strategy: str, case: CheckCase, topology: str | None = None,
                   timeout_s: float | None = None) -> CheckRow:
    """Run one strategy on the current world (collective) and compare with the reference."""
    from ..context import init_sequence_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    x = global_inputs(case, device)
    if case.seq_len % world:
        raise ValueError(f"--seq-len {case.seq_len} is not divisible by the SP degree {world}")
    S = case.seq_len // world
    local = {n: x[n][:, :, rank * S:(rank + 1) * S] for n in ("q", "k", "v")}
    joint = {}
    if case.joint_tokens:
        joint = dict(joint_query=x["jq"], joint_key=x["jk"], joint_value=x["jv"],
                     joint_strategy=case.joint_strategy)
    tol = TOLERANCE[DTYPES[case.dtype]]
    ctx = init_sequence_parallel(strategy, case.heads, topology, timeout_s=timeout_s)
    try:
        out = ctx.attention(local["q"], local["k"], local["v"], **joint)
        err = (out.double() - reference_rows(x, case, rank, world)).abs().max().item()
        stats = ctx.stats()
        row = CheckRow(strategy, ctx.strategy, ctx.mesh.describe(), err, tol,
                       bool(err <= tol), stats["inter_node_bytes"])
    finally:
        ctx.close()
    # the worst rank decides
    errs = [None] * world
    dist.all_gather_object(errs, asdict(row))
    worst = max(errs, key=lambda r: r["max_abs_err"])
    return CheckRow(**{**worst, "passed": all(r["passed"] for r in errs)})


def run_checks(strategies: list[str], case: CheckCase, topology: str | None = None,
               timeout_s: float | None = None) -> list[CheckRow]:
    return [check_strategy(s, case, topology, timeout_s) for s in strategies]


def format_table(rows: list[CheckRow]) -> str:
    head = f"{'strategy':<12} {'ran as':<12} {'mesh':<34} {'max abs err':>12} {'tol':>8}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.strategy:<12} {r.ran_as:<12} {r.mesh:<34} {r.max_abs_err:>12.3e} "
                     f"{r.tolerance:>8.0e}  {'PASS' if r.passed else 'FAIL'}")
    return "\n".join(lines)
