"""Option ``kv_pieces`` of ``torus`` (two-sided transport over gloo: the pieces as exchanges of
their own, piece-major buffers) and ``swiftfusion`` (one-sided, the shared-memory heap: gets of
the pieces' rows) on emulated ranks against the fp64 reference, and in the cost model's ops.
The schedule's invariants and the in-process numerics per piece are in
tests/test_torus_schedule.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.emulation.launcher import run_emulated
from support.reference import max_abs_err, rank_rows


def _pieces_rank():
    """2 x 2, kv_pieces = 3 over S = 7 rows (pieces of 3, 2, 2): 8 query heads, 4 K/V heads
    (T = 2, U = 2, R = 1) and 2 query heads, 1 K/V head (T = 2, U = 1, R = 2: the ring passes
    and gathers pieces); text, a key mask, both launch modes, two calls (the second replays
    the plan); torus and swiftfusion; then the fp8 refusal. Returns
    ([(strategy, H, launches, call, err)], [msg per strategy])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, S, D, Tj = 2, 7, 16, 5
    mine = slice(rank * S, (rank + 1) * S)
    rows = []
    for name, (H, Hkv), launches in ((n, hs, la) for n in ("torus", "swiftfusion")
                                     for hs in ((8, 4), (2, 1)) for la in ("ring", "stage")):
        ctx = sf.init_sequence_parallel(name, H, timeout_s=60,
                                        options={"kv_pieces": 3, "launches": launches})
        try:
            for call in range(2):
                g = torch.Generator().manual_seed(call)
                q = torch.randn(B, H, S * world, D, generator=g)
                k, v = (torch.randn(B, Hkv, S * world, D, generator=g) for _ in range(2))
                jq = torch.randn(B, H, Tj, D, generator=g)
                jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g) for _ in range(2))
                mask, jmask = torch.rand(B, S * world, generator=g) < 0.7, torch.rand(B, Tj, generator=g) < 0.7
                mask[:, 0] = True
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], jq, jk, jv, "front",
                                    key_mask=mask, joint_key_mask=jmask)
                rep = lambda x: x.double().repeat_interleave(H // Hkv, dim=1)  # noqa: E731
                want = rank_rows(q.double(), rep(k), rep(v), rank, world,
                                 (jq.double(), rep(jk), rep(jv)), "front", None, mask, jmask)
                err = max_abs_err(out, want) if out.shape == want.shape else float("inf")
                rows.append((name, H, launches, call, err))
            assert (ctx.strategy, ctx.mesh.ring) == (name, 1 if H == 8 else 2), (ctx.strategy, ctx.mesh)
        finally:
            ctx.close()
    msgs = []
    for name in ("torus", "swiftfusion"):
        try:
            sf.init_sequence_parallel(name, 8, timeout_s=60, options={"kv_pieces": 3, "fp8_comms": True})
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    return rows, msgs


def test_torus_kv_pieces_on_emulated_ranks():
    for rank, (rows, msgs) in enumerate(run_emulated(_pieces_rank, "2x2", timeout_s=300)):
        assert len(rows) == 16
        for name, H, launches, call, err in rows:
            assert err <= 1e-5, f"rank {rank} {name} H={H} launches={launches} call {call}: err {err:.2e}"
        for msg in msgs:
            assert msg is not None and "kv_pieces > 1 with fp8_comms is not supported" in msg, msg


@pytest.mark.parametrize("launches", ["ring", "stage"])
@pytest.mark.parametrize("T,U,R", [(2, 2, 1), (3, 1, 2)])
def test_cost_model_ops_follow_the_pieces(launches, T, U, R):
    """torus's ops with kv_pieces P: the last Pull-KV stage's K/V as P exchanges with the
    machine it comes from (K and V of S_p rows to each of its U GPUs), the same inter-machine bytes in all,
    and attends over the pieces' rows; kv_pieces = 1 is the program without the option."""
    from xfuser_swiftfusion.cost_model import Workload, programs
    from xfuser_swiftfusion.mesh import Mesh
    from xfuser_swiftfusion.strategies import get
    from xfuser_swiftfusion.strategies.ops import Attend, Transfer
    from xfuser_swiftfusion.topology import Topology
    mesh = Mesh(Topology(T, U * R), T * U, R, "tas")
    W, S, H, D, itemsize = T * U * R, 7, 2 * T * U, 8, 4
    w = Workload(1, W * S, H, D, "fp32")
    spec = get("torus")
    base = programs(spec, mesh, w, launches)
    assert programs(spec, mesh, w, launches, {"kv_pieces": 1}) == base
    h = H // (T * U)
    for P, rows in ((3, [3, 2, 2]), (7, [1] * 7), (9, [1] * 7)):  # at most S pieces
        for x, ops in enumerate(programs(spec, mesh, w, launches, {"kv_pieces": P})):
            t = mesh.coords(x)[0]
            frm = {mesh.rank_of((t + 1) % T, b, mesh.coords(x)[2]) for b in range(U)}
            other = [op for op in ops if isinstance(op, Transfer) and op.queue == "other"]
            pieces = [op for op in other if {p for p, _ in op.recvs} == frm and len(op.recvs) == 2 * U
                      and all(n < S * h * D * itemsize for _, n in op.recvs)]
            assert [op.recvs[0][1] for op in pieces] == [n * h * D * itemsize for n in rows], (P, x)
            assert len(other) == len([op for op in base[x] if isinstance(op, Transfer)
                                      and op.queue == "other"]) - 2 + len(rows)
            sent = lambda ops: sum(n for op in ops if isinstance(op, Transfer) and op.queue == "other"  # noqa: E731
                                   for _, n in op.sends)
            assert sent(ops) == sent(base[x]), (P, x)  # the ring passes pieces, not blocks: fewer bytes
            kv_rows = {n for op in ops if isinstance(op, Attend) for n in op.kv}
            assert set(rows) <= kv_rows, (P, x, kv_rows)


@pytest.mark.parametrize("launches", ["ring", "stage"])
def test_one_sided_ops_get_the_pieces(launches):
    """swiftfusion's ops with kv_pieces P: the last stage's K/V as P gets from each GPU of the
    machine it comes from (K and V of S_p rows packed), a ring-group sync per piece."""
    from xfuser_swiftfusion.cost_model import Workload, programs
    from xfuser_swiftfusion.mesh import Mesh
    from xfuser_swiftfusion.strategies import get
    from xfuser_swiftfusion.strategies.ops import Barrier, Transfer
    from xfuser_swiftfusion.topology import Topology
    T, U, R, S, H, D = 2, 2, 2, 7, 4, 8
    mesh = Mesh(Topology(T, U * R), T * U, R, "tas")
    w = Workload(1, T * U * R * S, H, D, "fp32")
    spec, h = get("swiftfusion"), H // (T * U)
    base = programs(spec, mesh, w, launches)
    for x, ops in enumerate(programs(spec, mesh, w, launches, {"kv_pieces": 3})):
        gets = [op.recvs[0][1] for op in ops if isinstance(op, Transfer) and op.kind == "get"
                and op.queue == "other" and op.recvs[0][1] not in (S * h * D * 4, 2 * S * h * D * 4)]
        assert gets == [2 * n * h * D * 4 for n in (3, 2, 2) for _ in range(U)], (x, gets)
        syncs = lambda ops: sum(isinstance(op, Barrier) and not op.quiet for op in ops)  # noqa: E731
        assert syncs(ops) == syncs(base[x]) + 2, x


def test_bench_layer_rows_carry_the_pieces():
    """``bench_layer.py --kv-pieces``: row names <-> options, the floor link + C / (T^2 P)
    (figures by hand: 150 Mbit/s = 18.75 MB/s), limits without a usp row."""
    from support.scripts import load_script
    bench = load_script("bench_layer")
    assert bench.row_name("torus", {"kv_pieces": 4}) == "torus[P=4]"
    assert bench.row_name("torus", {"kv_pieces": 1}) == "torus"
    assert bench.row_options("torus[P=4]") == {"kv_pieces": 4} and bench.row_options("torus") == {}
    assert bench.split_name("torus[P=4]") == ("torus", None) and bench.split_name("usp@U2") == ("usp", 2)
    row = lambda s, lat, comp: dict(  # noqa: E731
        strategy=s, ran="torus", ran_as="torus", ulysses=8, world=8, latency_s=lat, compute_s=comp,
        formula_total_bytes=8388608, **({"options": bench.row_options(s)} if bench.row_options(s) else {}))
    rows = [row("torus", 0.27, 0.15), row("torus[P=4]", 0.25, 0.16)]
    summary = bench.add_limits(rows, 150, 2)
    link = 8388608 / 2 / 18.75e6
    assert rows[0]["floor_s"] == pytest.approx(link + 0.15 / 4)
    assert rows[1]["floor_s"] == pytest.approx(link + 0.16 / 16)
    assert rows[1]["speedup_vs_usp"] is None and summary["best"] == "torus[P=4]"
    assert "torus[P=4]" in bench.limits_table(rows, 150, 2)


def test_plan_predicts_torus_with_its_pieces():
    """``swiftfusion plan --kv-pieces P``: torus's and swiftfusion's predictions run their
    programs with P pieces (here more, smaller launches: slower on this host-bound profile),
    tas's unchanged."""
    from xfuser_swiftfusion.tools.cli import plan
    one, four = (plan(1, 8, 24, 4096, 128, hardware="l40s-2s", kv_pieces=P) for P in (1, 4))
    for name in ("torus", "swiftfusion"):
        assert four[name]["predicted_latency_s"] != one[name]["predicted_latency_s"], name
    assert four["tas"]["predicted_latency_s"] == one["tas"]["predicted_latency_s"]


def test_auto_children_get_kv_pieces_only_where_they_take_it(caplog):
    """auto builds its pick with the context's options: kv_pieces reaches torus and
    swiftfusion; tas (no Torus schedule) runs without it, logged once."""
    import logging
    from xfuser_swiftfusion.strategies import get
    from xfuser_swiftfusion.strategies.auto import child_options
    opts = {"kv_pieces": 4, "comm": "auto"}
    assert child_options(opts, get("torus")) == opts == child_options(opts, get("swiftfusion"))
    with caplog.at_level(logging.INFO):
        assert child_options(opts, get("tas")) == {"comm": "auto"}
    assert "tas takes no option kv_pieces" in caplog.text
    assert child_options({"kv_pieces": 1}, get("tas")) == {"kv_pieces": 1}


LAYER = (1, 16384, 24, 128)  # B, L, H, D of the one-box layer (plan --seq-len 16384 --heads 24)


def _argmin_by_hand(topo, w, prof):
    """The fastest (strategy, Ulysses degree, P) by ``predict`` alone, each option given by
    hand: every modelled strategy that is not refused and runs as itself, at every Ulysses
    degree, and torus/swiftfusion at P in {2, 4} where the mesh has T > 1 and P <= S."""
    import math
    from xfuser_swiftfusion.cost_model import predict, refused
    from xfuser_swiftfusion.mesh import choose_mesh
    from xfuser_swiftfusion.strategies.registry import modelled
    g = math.gcd(topo.world_size, w.heads)
    out = []
    for spec in modelled():
        if refused(spec, prof):
            continue
        for deg in (d for d in range(1, g + 1) if g % d == 0):
            mesh = choose_mesh(topo, w.heads, spec.placement, deg)
            takes = spec.name in ("torus", "swiftfusion") and mesh.torus > 1
            pieces = [1, 2, 4] if takes else [1]
            for P in (P for P in pieces if P <= w.seq_len // topo.world_size):
                p = predict(spec.name, topo, w, prof, deg, options={"kv_pieces": P})
                if p.runs_as == spec.name:
                    out.append((p.latency_s, spec.name, deg, P))
    return min(out)


def test_candidates_price_pieces_for_the_strategies_that_take_them():
    """``candidates``: torus and swiftfusion also at P in {2, 4} (their ``options``), only
    where the mesh has T > 1 and P fits the tokens per GPU; no other strategy; a pinned P
    is the only one."""
    from xfuser_swiftfusion.cost_model import GPU_PROFILES, Workload, candidates
    from xfuser_swiftfusion.topology import Topology
    prof, w = GPU_PROFILES["l40s-2s-datasheet"], Workload(*LAYER)
    cands = candidates(Topology(2, 4), w, prof)
    pieced = {(c.strategy, c.pieces) for c in cands if c.pieces > 1}
    assert pieced == {(s, P) for s in ("torus", "swiftfusion") for P in (2, 4)}
    assert all(c.options == {"kv_pieces": c.pieces} for c in cands if c.pieces > 1)
    assert all(c.label == f"{c.strategy}[P={c.pieces}]" for c in cands if c.pieces > 1)
    assert {c.strategy for c in cands if c.pieces == 1} >= {"usp", "tas", "torus", "swiftfusion"}
    assert all(c.pieces == 1 for c in candidates(Topology(1, 8), w, prof))         # T = 1
    two = candidates(Topology(2, 4), Workload(1, 16, 8, 64), prof)                 # 2 tokens per GPU
    assert {c.pieces for c in two} == {1, 2}
    pinned = candidates(Topology(2, 4), w, prof, kv_pieces=2)
    assert {c.pieces for c in pinned if c.strategy in ("torus", "swiftfusion")} == {2}


@pytest.mark.parametrize("hardware, pieces", [("l40s-2s-datasheet", 4), ("l40s-2s", 1)])
def test_recommend_is_the_argmin_over_pieces(hardware, pieces):
    """The pick is the argmin of ``predict`` at every (strategy, degree, P) computed here; P > 1
    where the datasheet's links make the last stage's transfer the bottleneck, P = 1 on this
    code's host-bound costs; ``plan`` shows it (its rows and its recommendation)."""
    from xfuser_swiftfusion.cost_model import GPU_PROFILES, Workload, recommend
    from xfuser_swiftfusion.tools import cli
    from xfuser_swiftfusion.topology import Topology
    prof, w = GPU_PROFILES[hardware], Workload(*LAYER)
    lat, name, deg, P = _argmin_by_hand(Topology(2, 4), w, prof)
    best = recommend(Topology(2, 4), w, prof)
    assert (best.strategy, best.ulysses, best.pieces, best.latency_s) == (name, deg, P, lat)
    assert P == pieces
    p = cli.plan(1, 8, 24, 16384, 128, hardware=hardware)
    rec = p["recommended"]
    assert (rec["strategy"], rec["kv_pieces"], rec["predicted_latency_s"]) == (name, P, lat)
    assert rec["label"] == (name if P == 1 else f"{name}[P={P}]")
    assert p["torus"]["kv_pieces"] == pieces and p["tas"]["kv_pieces"] == 1
    pinned = cli.plan(1, 8, 24, 16384, 128, hardware=hardware, kv_pieces=2)
    assert pinned["torus"]["kv_pieces"] == 2
    assert {c["kv_pieces"] for c in pinned["recommended"]["candidates"]
            if c["strategy"] in ("torus", "swiftfusion")} == {2}


def test_ties_go_to_fewer_pieces():
    """Within the 0.1 % tie, the same strategy and degree with fewer pieces wins."""
    import dataclasses
    from xfuser_swiftfusion.cost_model import GPU_PROFILES, Workload, candidates, predict, recommend
    from xfuser_swiftfusion.topology import Topology
    prof, w, topo = GPU_PROFILES["l40s-2s-datasheet"], Workload(*LAYER), Topology(2, 4)
    usp = predict("usp", topo, w, prof).latency_s
    torus = [c for c in candidates(topo, w, prof) if c.strategy == "torus" and c.ulysses == 8]
    assert sorted(c.pieces for c in torus) == [1, 2, 4]
    # most pieces first and fastest: only the tie rule puts P = 1 first
    torus.sort(key=lambda c: -c.pieces)
    fake = [dataclasses.replace(c, latency_s=usp * (0.5 - 1e-5 * c.pieces)) for c in torus]
    assert recommend(topo, w, prof, cands=fake).pieces == 1
    fake = [dataclasses.replace(c, latency_s=usp * (0.5 - 1e-2 * c.pieces)) for c in torus]
    assert recommend(topo, w, prof, cands=fake).pieces == 4


def test_auto_builds_its_pick_with_the_pieces_it_chose(monkeypatch):
    """``auto`` (``choose``, as every rank runs it) picks P with the strategy; the child's
    options are the context's with the pick's ``kv_pieces`` over them; a user ``kv_pieces``
    pins P and ``fp8_comms`` pins P = 1 (pieces are unsupported with it)."""
    from xfuser_swiftfusion.cost_model import GPU_PROFILES, Workload, recommend
    from xfuser_swiftfusion.strategies import get
    from xfuser_swiftfusion.strategies.auto import build_options, choose, pinned_pieces
    from xfuser_swiftfusion.topology import Topology
    monkeypatch.setenv("SWIFTFUSION_HARDWARE", "l40s-2s-datasheet")
    B, L, H, D = LAYER
    q = torch.empty(B, H, L // 8, D, dtype=torch.bfloat16)
    best, cands, _ = choose(Topology(2, 4), H, q)
    want = recommend(Topology(2, 4), Workload(*LAYER), GPU_PROFILES["l40s-2s-datasheet"],
                     pad_heads=True)
    assert best == want and best.pieces == 4 and best.strategy == "swiftfusion"
    assert (build_options({"comm": "auto"}, best.options, get(best.runs_as))
            == {"comm": "auto", "kv_pieces": 4})
    assert build_options({"kv_pieces": 4}, {}, get("tas")) == {}
    assert pinned_pieces({}) is None and pinned_pieces({"kv_pieces": 2}) == 2
    assert pinned_pieces({"fp8_comms": True}) == 1
    for bad in ({"kv_pieces": 0}, {"kv_pieces": "4"}, {"kv_pieces": 2, "fp8_comms": True}):
        with pytest.raises(ValueError, match="kv_pieces"):
            pinned_pieces(bad)
    best, cands, _ = choose(Topology(2, 4), H, q, kv_pieces=pinned_pieces({"kv_pieces": 2}))
    assert best.pieces == 2
    assert all(c.pieces == 2 for c in cands if c.strategy in ("torus", "swiftfusion"))
    best, _, _ = choose(Topology(2, 4), H, q, kv_pieces=pinned_pieces({"fp8_comms": True}))
    assert best.pieces == 1


def test_auto_call_builds_the_child_with_the_chosen_pieces(monkeypatch):
    """``AutoAttention.__call__`` (the children stood in for: their build is collective)
    asks for its pick's child with the pick's ``kv_pieces`` on the datasheet box, none on
    this code's costs, and the user's P where given; ``build_options`` merges them so."""
    from types import SimpleNamespace
    from xfuser_swiftfusion.strategies import auto
    from xfuser_swiftfusion.topology import Topology
    asked = []

    class Child:
        spec = None

        def __call__(self, *args, **kwargs):
            return None

    monkeypatch.setattr(auto.AutoAttention, "_child", lambda self, name, deg, heads, topo, picked:
                        asked.append((name, picked)) or Child())
    monkeypatch.setattr(auto, "call_args", lambda spec, q, k, v, joint, key_mask: (k, v, joint, {}))
    q = torch.empty(1, 24, 16384 // 8, 128, dtype=torch.bfloat16)
    for hardware, options, want in [
            ("l40s-2s-datasheet", {}, ("swiftfusion", {"kv_pieces": 4})),
            ("l40s-2s-datasheet", {"kv_pieces": 2}, ("swiftfusion", {"kv_pieces": 2})),
            ("l40s-2s", {}, ("usp", {}))]:
        monkeypatch.setenv("SWIFTFUSION_HARDWARE", hardware)
        impl = auto.AutoAttention.__new__(auto.AutoAttention)
        impl.args = SimpleNamespace(options=options)
        impl.topology, impl.num_heads, impl.rank = Topology(2, 4), 24, 1
        impl._by_signature, impl.choices, impl.picked = {}, {}, {}
        impl(q, q, q, None, 128 ** -0.5)
        assert asked.pop() == want and list(impl.picked.values()) == [want[1]]
