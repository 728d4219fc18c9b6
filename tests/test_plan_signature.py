"""The plan cache's key, part by part: a part of the input that changes the computation but is
missing from ``strategies/planned.py::signature`` makes a later call run a plan compiled for
other inputs and return wrong attention without an error.

One context per strategy (tas, torus, swiftfusion) on an emulated 2x2 cluster runs one sequence
of calls; each call changes exactly one part of the signature from the call before (batch,
sequence, head dim, K/V heads, dtype, text length, text placement, scale, kind of
key mask), a few return to an earlier signature (a cached plan), and every output is compared
with the fp64 reference of ``support.reference`` (independent of the package) and must have the
query's dtype and the reference's shape. The device is the one part not varied (one device
here) and the query heads, fixed by the context (a query's shape is its keys' shape but
for the heads). Inputs are new random values at every call.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.emulation.launcher import run_emulated
from support.reference import max_abs_err, rank_rows

STRATEGIES = ("tas", "torus", "swiftfusion")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BASE = dict(B=2, H=4, Hkv=4, S=6, D=16, dtype=torch.float32, Tj=0, where="front", scale=None,
            mask=False, text_mask=False)
# (what changes, the change): each step applies to the previous step's case
STEPS = [
    ("base", {}),
    ("sequence", dict(S=5)),
    ("batch", dict(B=1)),
    ("head dim", dict(D=8)),
    ("K/V heads", dict(Hkv=2)),            # GQA: only K/V shapes change
    ("dtype", dict(dtype=torch.bfloat16)),
    ("dtype back", dict(dtype=torch.float32)),  # a cached plan
    ("text", dict(Tj=3)),
    ("text length", dict(Tj=5)),
    ("text placement", dict(where="rear")),
    ("scale", dict(scale=0.3)),
    ("scale again", dict(scale=0.7)),
    ("token mask", dict(mask=True)),
    ("text mask too", dict(text_mask=True)),
    ("text mask only", dict(mask=False)),
    ("no mask", dict(text_mask=False)),    # a cached plan (the "scale again" signature)
    ("text placement back", dict(where="front")),
    ("no text", dict(Tj=0)),
]


def cases() -> list[tuple[str, dict]]:
    out, case = [], dict(BASE)
    for name, change in STEPS:
        case = {**case, **change}
        out.append((name, case))
    return out


def _sequence_rank(strategies: tuple[str, ...]) -> list[tuple]:
    """Every step of ``cases()`` on one context per strategy: (strategy, step, error, dtype
    and shape right, tolerance); then the plans compiled before and after a repeated call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in strategies:
        with sf.init_sequence_parallel(name, BASE["H"], timeout_s=60) as ctx:
            for i, (step, c) in enumerate(cases()):
                B, H, Hkv, S, D, Tj, dtype = (c[k] for k in ("B", "H", "Hkv", "S", "D", "Tj", "dtype"))
                L = S * world
                g = torch.Generator().manual_seed(100 * i + 7)
                q = torch.randn(B, H, L, D, generator=g).to(dtype)
                k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
                jq = torch.randn(B, H, Tj, D, generator=g).to(dtype)
                jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g).to(dtype) for _ in range(2))
                mask = torch.rand(B, L, generator=g) > 0.3 if c["mask"] else None
                tmask = torch.rand(B, Tj, generator=g) > 0.4 if c["text_mask"] else None
                if tmask is not None:
                    tmask[:, 0] = True
                kw = dict(joint_query=jq, joint_key=jk, joint_value=jv,
                          joint_strategy=c["where"]) if Tj else {}
                mine = slice(rank * S, (rank + 1) * S)
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **kw,
                                    scale=c["scale"], key_mask=mask, joint_key_mask=tmask)
                ref = rank_rows(q, k, v, rank, world, (jq, jk, jv) if Tj else None, c["where"],
                                scale=c["scale"], key_mask=mask, joint_key_mask=tmask)
                ok = out.dtype == dtype and tuple(out.shape) == tuple(ref.shape)
                err = max_abs_err(out, ref) if ok else math.inf
                rows.append((name, step, err, ok, TOL[dtype], ctx.strategy))
            before = ctx.stats()["plans_compiled"]
            rows.append((name, "compiled", before, len({tuple(map(str, c.values())) for _, c in cases()})))
            ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **kw, scale=c["scale"],
                          key_mask=mask, joint_key_mask=tmask)
            rows.append((name, "repeat", before, ctx.stats()["plans_compiled"]))
    return rows


def test_every_part_of_the_plan_signature_changes_the_plan():
    """Fails when ``signature`` leaves out a part of the input the plan depends on (scale,
    text placement, shapes, dtype, text length, kind of key mask, K/V heads)."""
    failures = []
    for rank, rows in enumerate(run_emulated(_sequence_rank, "2x2", STRATEGIES, timeout_s=300)):
        steps = [r for r in rows if r[1] not in ("repeat", "compiled")]
        assert len(steps) == len(STRATEGIES) * len(STEPS)
        for name, step, err, ok, tol, ran in steps:
            if ran != name or not ok or not err <= tol:
                failures.append(f"rank {rank} {name} (ran as {ran}) after '{step}': "
                                f"{'wrong dtype or shape' if not ok else f'err {err:.3e} > {tol}'}")
        for name, _, compiled, distinct in (r for r in rows if r[1] == "compiled"):
            if compiled != distinct:  # one plan per signature (the returns hit the cache)
                failures.append(f"rank {rank} {name}: {compiled} plans for {distinct} signatures")
        for name, _, before, after in (r for r in rows if r[1] == "repeat"):
            if after != before:  # the same signature again runs its plan
                failures.append(f"rank {rank} {name}: a repeated call compiled ({before} -> {after})")
    assert not failures, "\n".join(failures)


def test_the_steps_change_one_part_at_a_time():
    """Each step differs from the one before in exactly the part it names."""
    seq = cases()
    for (_, prev), (step, case) in zip(seq, seq[1:]):
        changed = {k for k in case if case[k] != prev[k]}
        assert len(changed) == 1, (step, changed)


def test_signature_tells_apart_inputs_that_differ_in_one_part():
    """``signature`` directly, for the parts the sequence above cannot vary through a context:
    the device (a ``meta`` tensor stands for a second device) and the query heads alone."""
    from xfuser_swiftfusion.strategies.layout import Joint, KeyMask
    from xfuser_swiftfusion.strategies.planned import signature

    def sig(H=4, Hkv=4, dtype=torch.float32, device="cpu", scale=0.5, Tj=3, Tkv=3,
            where="front", tokens=True, text=False):
        x = lambda h, n: torch.empty(2, h, n, 8, dtype=dtype, device=device)  # noqa: E731
        joint = Joint(x(H, Tj), x(Hkv, Tkv), x(Hkv, Tkv), where) if Tj else None
        mask = KeyMask(torch.ones(2, 24, dtype=torch.bool) if tokens else None, 6,
                       torch.ones(2, Tkv, dtype=torch.bool) if text else None)
        return signature(x(H, 6), x(Hkv, 6), joint, scale, mask if tokens or text else None)

    base = sig()
    for part in (dict(H=8), dict(Hkv=2), dict(dtype=torch.bfloat16), dict(device="meta"),
                 dict(scale=0.25), dict(Tj=0), dict(Tj=4), dict(Tkv=4), dict(where="rear"),
                 dict(tokens=False), dict(text=True), dict(tokens=False, text=True)):
        assert sig(**part) != base, part
    assert sig(H=8, Tj=0) != sig(Tj=0)  # the query's heads alone
    assert sig() == base  # equal inputs: one key
