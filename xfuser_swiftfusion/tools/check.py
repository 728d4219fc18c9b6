"""``swiftfusion check``: every strategy against single-device attention, on this cluster.

Every rank builds the same global inputs from a seed, runs the strategy on its shard and
compares its output rows with an fp64 softmax attention over the whole sequence (computed
locally, independently of any strategy code). Tolerances: fp32 1e-5, bf16 / fp16 2e-2.
A case may have grouped-query K/V (``heads_kv``) and a key-padding mask (``masked_keys``).
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
    heads_kv: int = 0            # K/V heads (grouped-query attention, dividing heads); 0: heads
    masked_keys: int = 0         # key padding: the last image keys (and the last text key) masked

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads


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
    """Deterministic global q ``[B, H, L, D]``, k, v ``[B, H_kv, L, D]``, text jq ``[B, H, Tj, D]``,
    jk, jv ``[B, H_kv, Tj, D]``; with ``masked_keys``, bool key masks ``mask`` ``[B, L]`` and
    ``jmask`` ``[B, Tj]`` (True = attend)."""
    g = torch.Generator().manual_seed(case.seed)
    B, H, Hkv, L, Tj, D = (case.batch, case.heads, case.kv_heads, case.seq_len, case.joint_tokens,
                           case.head_dim)
    dtype = DTYPES[case.dtype]
    make = lambda *s: torch.randn(s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = {"q": make(B, H, L, D), "k": make(B, Hkv, L, D), "v": make(B, Hkv, L, D),
         "jq": make(B, H, Tj, D), "jk": make(B, Hkv, Tj, D), "jv": make(B, Hkv, Tj, D)}
    if case.masked_keys:
        x["mask"] = torch.arange(L, device=device).expand(B, L) < L - case.masked_keys
        x["jmask"] = torch.arange(Tj, device=device).expand(B, Tj) < Tj - 1
    return x


def reference_rows(x: dict[str, torch.Tensor], case: CheckCase, rank: int, world: int) -> torch.Tensor:
    """fp64 attention of this rank's rows (text queries + its image shard) over all keys
    (K/V head ``i // (H / H_kv)`` for query head ``i``; masked keys left out)."""
    S, Tj = case.seq_len // world, case.joint_tokens
    q_img = x["q"][:, :, rank * S:(rank + 1) * S]
    head = torch.arange(case.heads, device=q_img.device) // (case.heads // case.kv_heads)
    q = torch.cat([x["jq"], q_img], dim=2).double()              # [B, H, Tj + S, D]
    k = torch.cat([x["jk"], x["k"]], dim=2).double()[:, head]    # [B, H, Tj + L, D]
    v = torch.cat([x["jv"], x["v"]], dim=2).double()[:, head]
    scores = q @ k.transpose(-1, -2) / math.sqrt(case.head_dim)  # [B, H, Tj + S, Tj + L]
    if "mask" in x:
        keep = torch.cat([x["jmask"], x["mask"]], dim=1)[:, None, None, :]  # [B, 1, 1, Tj + L]
        scores = scores.masked_fill(~keep, float("-inf"))
    o = torch.softmax(scores, dim=-1) @ v
    txt, img = o[:, :, :Tj], o[:, :, Tj:]
    if Tj == 0:
        return img
    return torch.cat([txt, img] if case.joint_strategy == "front" else [img, txt], dim=2)


def rank_call(x: dict[str, torch.Tensor], case: CheckCase, rank: int, world: int
              ) -> tuple[tuple[torch.Tensor, ...], dict]:
    """``ctx.attention``'s arguments on ``rank``: its shard of q, k, v ``[B, H(_kv), S, D]``
    and the keywords (text tensors, key masks)."""
    if case.seq_len % world:
        raise ValueError(f"--seq-len {case.seq_len} is not divisible by the SP degree {world}")
    S = case.seq_len // world
    local = tuple(x[n][:, :, rank * S:(rank + 1) * S] for n in ("q", "k", "v"))
    kwargs: dict = {}
    if case.joint_tokens:
        kwargs = dict(joint_query=x["jq"], joint_key=x["jk"], joint_value=x["jv"],
                      joint_strategy=case.joint_strategy)
    if "mask" in x:
        kwargs["key_mask"] = x["mask"]
        if case.joint_tokens:
            kwargs["joint_key_mask"] = x["jmask"]
    return local, kwargs


def check_strategy(strategy: str, case: CheckCase, topology: str | None = None,
                   timeout_s: float | None = None) -> CheckRow:
    """Run one strategy on the current world (collective) and compare with the reference."""
    from ..context import init_sequence_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    x = global_inputs(case, device)
    local, kwargs = rank_call(x, case, rank, world)
    tol = TOLERANCE[DTYPES[case.dtype]]
    ctx = init_sequence_parallel(strategy, case.heads, topology, timeout_s=timeout_s)
    try:
        out = ctx.attention(*local, **kwargs)
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
