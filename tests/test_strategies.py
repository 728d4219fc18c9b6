"""Every strategy equals single-device attention on every topology it accepts.

The reference is ``support.reference`` (fp64 softmax attention over the gathered sequence),
independent of the package. One emulated launch per topology runs a list of cases x strategies.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion import plan
from xfuser_swiftfusion.emulation.launcher import run_emulated
from support.reference import attention, max_abs_err, rank_rows

STRATS = ("usp", "tas", "torus", "swiftfusion")
TOL = {"fp32": 1e-5, "bf16": 2e-2}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases_on_rank(cases):
    """Runs on every rank: returns [(case, strategy, ran_as, max_err, inter_bytes)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for case in cases:
        B, H, L, D, dt, Tj, where = (case[k] for k in ("B", "H", "L", "D", "dtype", "Tj", "where"))
        g = torch.Generator().manual_seed(hash((B, H, L, D, Tj)) % 2**31)
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(DT[dt]) for _ in range(3))
        jq, jk, jv = (torch.randn(B, H, Tj, D, generator=g).to(DT[dt]) for _ in range(3))
        S = L // world
        mine = slice(rank * S, (rank + 1) * S)
        ref_all = rank_rows(q, k, v, rank, world, (jq, jk, jv), where)
        joint = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=where) if Tj else {}
        for name in case["strategies"]:
            ctx = sf.init_sequence_parallel(name, H, timeout_s=60)
            try:
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **joint)
                err = max_abs_err(out, ref_all)
                rows.append((case["id"], name, ctx.strategy, err, ctx.stats()["inter_node_bytes"],
                             tuple(out.shape) == tuple(ref_all.shape)))
            finally:
                ctx.close()
    return rows


def _case(i, B=1, H=8, L=48, D=32, dtype="fp32", Tj=0, where="front", strategies=STRATS):
    return dict(id=i, B=B, H=H, L=L, D=D, dtype=dtype, Tj=Tj, where=where, strategies=strategies)


# Per topology: cases covering fp32/bf16, B 1/2, D 32/64/128, joint front/rear (text lengths
# not divisible by the SP degree), and head counts where gcd(N*M, H) limits the Ulysses degree
# (ring > 1 inside machines, or the Torus fallback to tas when the ring must cross machines).
MATRIX = {
    "1x4": [_case(0, H=8), _case(1, H=2, dtype="bf16", Tj=5), _case(2, B=2, H=6, D=64, Tj=7, where="rear")],
    "2x2": [_case(0, H=8), _case(1, H=2, D=128, Tj=7), _case(2, B=2, H=6, dtype="bf16", Tj=3, where="rear"),
            _case(3, H=1, D=64)],
    "4x1": [_case(0, H=4, D=64, Tj=7), _case(1, H=6, dtype="bf16", where="rear", Tj=2), _case(2, B=2, H=2)],
    "2x4": [_case(0, H=8, Tj=7), _case(1, H=6, D=64, dtype="bf16"), _case(2, B=2, H=4, Tj=9, where="rear")],
    "4x2": [_case(0, H=8, dtype="bf16", Tj=7), _case(1, H=4, D=64, Tj=5, where="rear"), _case(2, H=2, B=2)],
    "3x2": [_case(0, H=6, Tj=7), _case(1, H=12, D=128, dtype="bf16", Tj=4, where="rear"),
            _case(2, H=4, B=2)],
}


@pytest.mark.parametrize("topo", sorted(MATRIX))
def test_equivalence_matrix(topo):
    cases = MATRIX[topo]
    per_rank = run_emulated(_cases_on_rank, topo, cases, timeout_s=600)
    by_case = {c["id"]: c for c in cases}
    failures = []
    for rank, rows in enumerate(per_rank):
        for cid, name, ran_as, err, _, shape_ok in rows:
            c = by_case[cid]
            if not shape_ok or not err <= TOL[c["dtype"]]:
                failures.append(f"rank {rank} case {c} {name} (ran as {ran_as}): err {err:.3e}")
    assert not failures, "\n".join(failures)
    assert len(per_rank[0]) == sum(len(c["strategies"]) for c in cases)


def test_fallback_paths_are_taken():
    """3x2 with 1 head: U1xR6, the ring crosses machines, and no padded H' <= 2 fits 3 machines:
    torus/swiftfusion run tas (tests/test_any_machine_count.py: padded heads elsewhere)."""
    rows = run_emulated(_cases_on_rank, "3x2", [_case(0, H=1, strategies=("torus", "swiftfusion"))],
                        timeout_s=120)[0]
    assert [r[2] for r in rows] == ["tas", "tas"]
    assert all(r[3] <= 1e-5 for r in rows)


# --- byte counters: payload bytes equal the per-GPU formula (paper appendix / M) ------------

@pytest.mark.parametrize("topo", ["2x2", "3x2", "4x2"])
def test_inter_node_bytes_equal_formula(topo):
    N, M = map(int, topo.split("x"))
    B, H, L, D = 2, 24, N * M * 8, 32
    case = _case(0, B=B, H=H, L=L, D=D, strategies=("tas", "torus", "swiftfusion"))
    per_rank = run_emulated(_cases_on_rank, topo, [case], timeout_s=300)
    # paper: SFU with P_u >= N moves 4 (N-1) BLHD / N^2 elements per machine; per GPU / M; fp32
    formula = 4 * (N - 1) * B * L * H * D / N**2 / M * 4
    for rank, rows in enumerate(per_rank):
        for _, name, ran_as, err, inter, _ in rows:
            assert ran_as == name and err <= 1e-5
            assert inter == formula, f"rank {rank} {name}: {inter} bytes, formula {formula}"


# --- stage-level: partial outputs after every ring call match the keys seen so far -------

def _stage_errors(strategy):
    """Wrap the schedule's ring calls; after each, every touched Q chunk's running output
    must equal fp64 attention over exactly the K/V blocks it has seen so far. Also returns
    the Q chunks attended after the last K/V block arrived, and T * U."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, L, D = 1, 12, 16 * world, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    S = L // world
    ctx = sf.init_sequence_parallel(strategy, H, timeout_s=60)
    impl, mesh = ctx._impl, ctx.mesh
    t, u, r = mesh.coords(rank)
    T, U, R = mesh.torus, mesh.ulysses_intra, mesh.ring
    h = H // (T * U)
    heads = slice((t * U + u) * h, (t * U + u + 1) * h)
    tokens = lambda x: slice(x * S, (x + 1) * S)  # noqa: E731  global rank -> its tokens
    seen: dict[tuple[int, int], set[int]] = {}
    errors, stages, chunks = [], [], []
    io = impl.io
    original = io.ring

    def ring(q_chunks, states, a, *, scale, what, **kw):
        """The layer's ring call, then (a step of the plan: it runs where the ring's work
        does) the check of every touched chunk's running output."""
        original(q_chunks, states, a, scale=scale, what=what, **kw)
        stages.append(what)
        chunks.append((what, len(q_chunks)))
        owners = {io.q_block(a2)[b].data_ptr(): (a2, b) for a2 in range(T) for b in range(U)}
        for chunk, st in zip(q_chunks, states):
            a2, b = owners[chunk.data_ptr()]
            seen.setdefault((a2, b), set()).add(a)
            kv_ranks = [mesh.rank_of(a3, b3, r3) for a3 in sorted(seen[(a2, b)])
                        for b3 in range(U) for r3 in range(R)]

            def check(st=st, kv_ranks=kv_ranks, a2=a2, b=b, what=what):
                kk = torch.cat([k[:, heads, tokens(x)] for x in kv_ranks], 2)
                vv = torch.cat([v[:, heads, tokens(x)] for x in kv_ranks], 2)
                qq = q[:, heads, tokens(mesh.rank_of(a2, b, r))]
                errors.append((what, max_abs_err(st.acc / st.l.unsqueeze(-1),
                                                 attention(qq, kk, vv, scale))))

            plan.call(check)

    io.ring = ring
    try:
        out = ctx.attention(q[:, :, tokens(rank)], k[:, :, tokens(rank)], v[:, :, tokens(rank)])
    finally:
        ctx.close()
    final = max_abs_err(out, rank_rows(q, k, v, rank, world))
    last = [i for i, (what, _) in enumerate(chunks) if what.startswith(f"Pull-KV stage {T - 1},")]
    after_last_pull = sum(n for _, n in chunks[last[0]:])
    return stages, errors, final, after_last_pull, T * U


@pytest.mark.parametrize("strategy", ["torus", "swiftfusion"])
@pytest.mark.parametrize("topo", ["3x2", "2x4"])
def test_stage_partial_outputs(strategy, topo):
    for stages, errors, final, after_last_pull, TU in run_emulated(_stage_errors, topo, strategy,
                                                                   timeout_s=120):
        assert stages[0] == "Pull-Q stage 1" and stages[-1] == "Push-O"
        assert any(s.startswith("Pull-KV") for s in stages)
        assert errors and max(e for _, e in errors) <= 1e-5, errors
        assert final <= 1e-5
        # the local queries met every earlier K/V block in its own Pull-KV stage: after the
        # last block arrives only the T*U query chunks are left (Algorithm 1: 2(T-1)U)
        assert after_last_pull == TU, (after_last_pull, TU)


def _inference_mode_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 16 * world, 16, generator=g) for _ in range(3))
    mine = slice(rank * 16, (rank + 1) * 16)
    ctx = sf.init_sequence_parallel("swiftfusion", 8, timeout_s=60)
    try:
        with torch.inference_mode():  # diffusers pipelines run under inference mode
            outs = [ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine]) for _ in range(2)]
    finally:
        ctx.close()
    return max(max_abs_err(o, rank_rows(q, k, v, rank, world)) for o in outs)


def test_swiftfusion_under_inference_mode():
    assert max(run_emulated(_inference_mode_rank, "2x2", timeout_s=120)) <= 1e-5


# --- outputs are the caller's: the next call must not change them ---------------------------

def _two_calls_rank(strategies):
    """Every strategy called twice (different inputs, B = 1, with and without text tokens);
    both outputs checked after the second call. Returns [(strategy, Tj, err1, err2)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    H, S, D = 8, 8, 16
    mine = slice(rank * S, (rank + 1) * S)
    rows = []
    for name in strategies:
        ctx = sf.init_sequence_parallel(name, H, timeout_s=60)
        try:
            for Tj in (0, 3):
                g = torch.Generator().manual_seed(Tj)
                ins = [[torch.randn(1, H, n, D, generator=g) for n in (S * world,) * 3 + (Tj,) * 3]
                       for _ in range(2)]
                outs = []
                for q, k, v, jq, jk, jv in ins:
                    joint = dict(joint_query=jq, joint_key=jk, joint_value=jv,
                                 joint_strategy="rear") if Tj else {}
                    outs.append(ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **joint))
                errs = [max_abs_err(o, rank_rows(q, k, v, rank, world, (jq, jk, jv), "rear"))
                        for o, (q, k, v, jq, jk, jv) in zip(outs, ins)]
                rows.append((name, Tj, *errs))
        finally:
            ctx.close()
    return rows


def test_outputs_stay_valid_after_the_next_call():
    """torus/swiftfusion keep their receive buffers across calls: the output must not be a
    view of one (at B = 1 without text rows a permute-reshape of it would be)."""
    for rank, rows in enumerate(run_emulated(_two_calls_rank, "2x2", STRATS + ("auto",), timeout_s=300)):
        for name, Tj, err1, err2 in rows:
            assert err2 <= 1e-5, f"rank {rank} {name} Tj={Tj}: second call err {err2:.2e}"
            assert err1 <= 1e-5, f"rank {rank} {name} Tj={Tj}: first output changed by the second call (err {err1:.2e})"


# --- swiftfusion's symmetric heap: what the README promises per attention shape ------------

def _heap_growth_rank():
    """swiftfusion's heap growth at the first call of each shape (B, H, S, D, Tj), and T."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, S, D = 2, 8, 8, 16
    mine = slice(rank * S, (rank + 1) * S)
    ctx = sf.init_sequence_parallel("swiftfusion", H, timeout_s=60)
    rows = []
    try:
        for Tj in (0, 3):
            g = torch.Generator().manual_seed(Tj)
            q, k, v = (torch.randn(B, H, S * world, D, generator=g) for _ in range(3))
            jq, jk, jv = (torch.randn(B, H, Tj, D, generator=g) for _ in range(3))
            joint = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy="front") if Tj else {}
            before = ctx.stats()["symmetric_heap_bytes"]
            for _ in range(2):  # the second call of a shape reuses the first one's buffers
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], **joint)
            err = max_abs_err(out, rank_rows(q, k, v, rank, world, (jq, jk, jv)))
            rows.append(((B, H, S, D, Tj), ctx.stats()["symmetric_heap_bytes"] - before, err))
        return ctx.mesh.torus, rows
    finally:
        ctx.close()


@pytest.mark.parametrize("topo", ["4x1", "2x2"])
def test_swiftfusion_heap_per_shape(topo):
    """(2 + 2 (T-1)/T) X + 2 X' per rank (X: one rank's Q, X': with the text rows): staged
    and working K/V, pulled K/V, and two slot grids holding Q and then the outputs."""
    for rank, (T, rows) in enumerate(run_emulated(_heap_growth_rank, topo, timeout_s=120)):
        assert T == int(topo[0])
        for (B, H, S, D, Tj), grew, err in rows:
            X, X_ = B * H * S * D * 4, B * H * (S + Tj) * D * 4  # fp32
            assert err <= 1e-5
            assert grew == (2 + 2 * (T - 1) / T) * X + 2 * X_, (rank, Tj, grew / X)
