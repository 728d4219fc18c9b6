"""Cost model: byte and op counts of the programs, monotonicity, predictions that follow the
strategies' step lists, ``plan --json`` fields, profile files, ``calibrate``, and ``auto`` end
to end."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion import cost_model
from xfuser_swiftfusion.tools import cli
from xfuser_swiftfusion.cost_model import (GPU_PROFILES, Workload, candidates, inter_node_elements,
                                           predict, recommend, ulysses_degrees)
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.mesh import choose_mesh, counted_inter_node_elements
from xfuser_swiftfusion.strategies import get, ring, tas, torus
from xfuser_swiftfusion.topology import Topology
from support.reference import max_abs_err, rank_rows
from support.scripts import load_script

STRATS = ("usp", "tas", "torus", "swiftfusion")
P4DE = GPU_PROFILES["p4de-datasheet"]  # the model's mechanics on a plain GPU profile (no baseline costs)
real_tas, real_torus = tas.tas_schedule, torus.torus_schedule


@pytest.mark.parametrize("nodes,gpus,heads", [(2, 8, 24), (4, 8, 24), (3, 8, 24), (4, 2, 12),
                                              (4, 1, 16), (3, 2, 12), (2, 4, 6)])
def test_byte_terms_equal_counted(nodes, gpus, heads):
    topo = Topology(nodes, gpus)
    L = 48 * topo.world_size
    w = Workload(2, L, heads, 64)
    for s in STRATS:
        for deg in ulysses_degrees(topo, heads):
            p = predict(s, topo, w, P4DE, deg)
            mesh = choose_mesh(topo, heads, p.placement, deg)
            kind = "pull" if p.runs_as == "swiftfusion" else "pass"
            counted = counted_inter_node_elements(mesh, 2, L, heads, 64, kind)
            assert inter_node_elements(s, topo, w, deg) == pytest.approx(max(counted), abs=1e-6)
            assert p.inter_node_bytes == max(counted) * 2


def _faster(profile, kind: str, locality: str, factor: float):
    """``profile`` with ``kind``'s bandwidth at ``locality`` times ``factor``."""
    rates = {k: dict(v) for k, v in profile.transfers.items()}
    rates[kind][locality] = dataclasses.replace(rates[kind][locality], bw=rates[kind][locality].bw * factor)
    return dataclasses.replace(profile, transfers=rates)


def _attention(profile, rate: float, by_keys: dict[int, float] | None = None):
    """``profile`` whose kernel runs ``rate`` FLOP/s (times ``by_keys[Lk]`` at Lk keys) at every
    head dim, without merge or call costs."""
    pts = tuple((1024, lk, rate * f) for lk, f in (by_keys or {1024: 1.0}).items())
    table = {dt: {D: pts for D in (32, 64, 128)} for dt in ("bf16", "fp32")}
    return dataclasses.replace(profile, attention=table, merge_s_per_elem=0.0, attend_call_s=0.0)


def test_more_bandwidth_is_not_slower():
    topo, w = Topology(4, 8), Workload(1, 66048 - 66048 % 32, 24, 128)
    for s in STRATS:
        base = predict(s, topo, w, P4DE).latency_s
        for kind in P4DE.transfers:
            for locality in ("intra", "inter"):
                fast = _faster(P4DE, kind, locality, 4)
                assert predict(s, topo, w, fast).latency_s <= base * (1 + 1e-12), (s, kind, locality)


def test_key_length_efficiency_scales_attention_time():
    """A profile whose kernel runs twice as fast on long key sets predicts half the attention
    FLOP time for a layer whose calls have long key sets (usp on 1x4 is Ulysses: all 32768
    queries against all 32768 keys on H/4 heads: beyond the last point, 16384 keys), and the
    log-log interpolation's 2^(1/4) at 2048 keys (a quarter of the way from 1024 to 16384)."""
    topo, w = Topology(1, 4), Workload(1, 32768, 8, 64)
    slow = _attention(P4DE, 1e12)
    fast_long = _attention(P4DE, 1e12, {1024: 1.0, 16384: 2.0})
    base, fast = (predict("usp", topo, w, p).compute_s for p in (slow, fast_long))
    copies = base - 4 * 2 * 32768 * 32768 * 64 / 1e12   # the permute copies around the all-to-alls
    assert fast - copies == pytest.approx((base - copies) / 2, rel=1e-9)
    short = Workload(1, 2048, 8, 64)
    flop = 4 * 2 * 2048 * 2048 * 64 / 1e12
    gap = predict("usp", topo, short, slow).compute_s - predict("usp", topo, short, fast_long).compute_s
    assert gap == pytest.approx(flop * (1 - 2 ** -0.25), rel=1e-9)


def test_torus_overlap_beats_tas_when_compute_dominates():
    topo = Topology(4, 8)
    slow_compute = _attention(P4DE, 20e12)
    w = Workload(1, 131072, 24, 128)
    tas = predict("tas", topo, w, slow_compute)
    torus = predict("torus", topo, w, slow_compute)
    assert torus.latency_s <= tas.latency_s
    assert torus.compute_s == pytest.approx(tas.compute_s, rel=0.05)  # same FLOPs, more calls


def test_recommend_never_slower_than_usp(monkeypatch):
    """The fastest candidate; usp's own prediction when every candidate is predicted slower."""
    real_candidates = cost_model.candidates
    for topo, H in [(Topology(2, 8), 24), (Topology(4, 8), 24), (Topology(4, 2), 12)]:
        w = Workload(1, 4096 * topo.world_size, H, 64)
        best = recommend(topo, w, P4DE)
        usp = predict("usp", topo, w, P4DE)
        with monkeypatch.context() as m:
            m.setattr(cost_model, "candidates", lambda *a: [  # noqa: B023 - called in this iteration
                dataclasses.replace(c, latency_s=2 * usp.latency_s) for c in real_candidates(*a)])
            assert recommend(topo, w, P4DE) == usp
        assert best.latency_s == min(c.latency_s for c in candidates(topo, w, P4DE))


def test_plan_json_fields(capsys):
    assert cli.main(["plan", "--nodes", "4", "--gpus-per-node", "8", "--heads", "24",
                     "--seq-len", "66048", "--head-dim", "128", "--json", "--hardware", "p5"]) == 0
    out = json.loads(capsys.readouterr().out)
    for s in STRATS:
        for key in ("runs_as", "ulysses_degree", "ring_degree", "inter_node_bytes_per_gpu",
                    "paper_inter_node_bytes_per_gpu", "predicted_latency_s"):
            assert key in out[s], (s, key)
        assert out[s]["predicted_latency_s"] > 0
    rec = out["recommended"]
    assert rec["strategy"] in STRATS and rec["hardware"] == "p5"
    assert rec["predicted_latency_s"] <= out["usp"]["predicted_latency_s"]
    assert cli.main(["plan", "--nodes", "2", "--gpus-per-node", "2", "--heads", "4", "--seq-len",
                     "64", "--head-dim", "8", "--hardware", "nope"]) == 2


def _auto_on_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, L, D = 1, 8, 64, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    S = L // world
    mine = slice(rank * S, (rank + 1) * S)
    ref = rank_rows(q, k, v, rank, world)
    logs: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logs.append(record.getMessage())
    ours = logging.getLogger("xfuser.swiftfusion")
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ctx = sf.init_sequence_parallel("auto", H, timeout_s=60)
    try:
        out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])
        choice = list(ctx._impl.choices.values())
        picks = [m for m in logs if m.startswith("auto: ")]
        return choice, max_abs_err(out, ref), ctx.stats()["calls"], picks
    finally:
        ctx.close()
        ours.removeHandler(handler)


def _auto_beside_usp_on_rank():
    """A usp context holds xFuser's state at U4 (1x4, 4 heads); auto, whose model would pick
    usp at another degree when free to (the model's pick is stood in for: usp at the degree it
    may use, else U1), must run usp on the groups that exist."""
    from xfuser_swiftfusion.strategies import auto

    def pick_usp(topology, w, profile, usp_ulysses, external, pad_heads):
        usp = [p for p in candidates(topology, w, profile, pad_heads) if p.strategy == "usp"]
        return next(p for p in usp if p.ulysses == (usp_ulysses or 1))

    auto.recommend = pick_usp
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 32, 16, generator=g) for _ in range(3))
    S = 32 // world
    mine = slice(rank * S, (rank + 1) * S)
    with sf.init_sequence_parallel("usp", 4, timeout_s=60) as base:
        base.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])
        with sf.init_sequence_parallel("auto", 4, timeout_s=60) as ctx:
            out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])
            return list(ctx._impl.choices.values()), max_abs_err(out, rank_rows(q, k, v, rank, world))


def test_auto_runs_usp_on_the_xfuser_groups_that_exist():
    for choices, err in run_emulated(_auto_beside_usp_on_rank, "1x4", timeout_s=120):
        assert choices == [("usp", 4)] and err < 1e-5, (choices, err)


def test_auto_identical_choice_and_exact():
    res = run_emulated(_auto_on_rank, "2x2", timeout_s=120)
    choices = {tuple(map(tuple, c)) for c, _, _, _ in res}
    assert len(choices) == 1 and len(res[0][0]) == 1
    assert max(e for _, e, _, _ in res) < 1e-5
    # the pick is logged once, by rank 0 (all ranks pick the same)
    assert [len(picks) for *_, picks in res] == [1, 0, 0, 0], [picks for *_, picks in res]


def test_cpu_profile_warns_once_when_measured_on_another_cpu(tmp_path, caplog):
    """A profile records the CPU it was measured on; used on another CPU it says so (once)."""
    from xfuser_swiftfusion.cost_model import CPU_PROFILE_PATH, cpu_profile, host_cpu
    data = json.loads(CPU_PROFILE_PATH.read_text())
    same, other = tmp_path / "same.json", tmp_path / "other.json"
    same.write_text(json.dumps({**data, "cpu": host_cpu()}))
    other.write_text(json.dumps({**data, "cpu": "Some Other CPU (family 1 model 2; avx2)"}))
    with caplog.at_level("WARNING", logger="xfuser.swiftfusion"):
        cpu_profile(4, path=same)
        assert not caplog.records
        cpu_profile(4, path=other)
        cpu_profile(8, path=other)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "Some Other CPU" in msgs[0] and "calibrate_cpu.py" in msgs[0]


# --- the model runs the code's own schedules -----------------------------------------------

def test_program_op_counts_equal_the_counted_ones():
    """Each rank's program makes the calls ``ctx.stats()`` counts on a real run
    (tests/test_op_counts.py pins those to formulas and checks them on emulated clusters)."""
    from test_op_counts import CASES, expected
    from xfuser_swiftfusion.strategies.ops import counts
    for (topo, heads), tur in CASES.items():
        t = Topology.parse(topo)
        for s in ("tas", "torus", "swiftfusion"):
            spec = get(s)
            mesh = choose_mesh(t, heads, spec.placement)
            w = Workload(1, 8 * t.world_size, heads, 8, "fp32")
            for x, ops in enumerate(cost_model.programs(spec, mesh, w)):
                assert counts(ops) == expected(s, *tur), (topo, heads, s, x)


def _late_pulls(T, t, text):
    """The Torus schedule with its pulls issued only after Pull-Q stage 1's attention."""
    steps = real_torus(T, t, text)
    issue = next(i for i, s in enumerate(steps) if s.kind == "issue")
    first = next(i for i, s in enumerate(steps) if s.kind == "attend" and s.kv == t)
    return steps[:issue] + steps[issue + 1:first + 1] + [steps[issue]] + steps[first + 1:]


def test_prediction_follows_a_changed_schedule(monkeypatch):
    """Editing a strategy's step list, and nothing else, changes its prediction: the Torus
    pulls issued later (a link-bound layer waits longer), a ring without its fetches (no ring
    bytes), ``tas`` with one all-to-all more."""
    topo, w = Topology(4, 8), Workload(1, 98304, 24, 128)
    slow = dataclasses.replace(P4DE, transfers={k: {loc: dataclasses.replace(r, bw=r.bw / 40)
                                                    for loc, r in v.items()}
                                                for k, v in P4DE.transfers.items()})
    torus_s, tas_s = (predict(s, topo, w, slow).latency_s for s in ("torus", "tas"))
    monkeypatch.setattr(torus, "torus_schedule", _late_pulls)
    assert predict("torus", topo, w, slow).latency_s > torus_s * 1.01
    monkeypatch.setattr(ring, "ring_schedule", lambda R: [ring.RingStep(i, False) for i in range(1, R + 1)])
    assert predict("tas", topo, w, slow).latency_s < tas_s * 0.99
    monkeypatch.undo()
    monkeypatch.setattr(tas, "tas_schedule", lambda text: [tas.TasStep("all_to_all", "Q"), *real_tas(text)])
    assert predict("tas", topo, w, slow).latency_s > tas_s * 1.01


def _schedules_on_rank(which: str):
    """tas on 1x2 with one head (U1 x R2: a ring of 2), its step list or its ring's edited."""
    if which == "tas":   # no ring step: the states are never updated
        tas.tas_schedule = lambda text: [s for s in real_tas(text) if s.kind != "ring"]
    elif which == "ring":  # the ring stops after its first step: the peer's block is missed
        ring.ring_schedule = lambda R: [ring.RingStep(1, False)]
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(3))
    S = 16 // world
    mine = slice(rank * S, (rank + 1) * S)
    ctx = sf.init_sequence_parallel("tas", 1, timeout_s=60)
    try:
        out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine])
        return max_abs_err(out, rank_rows(q, k, v, rank, world))
    finally:
        ctx.close()


@pytest.mark.parametrize("which", ["none", "tas", "ring"])
def test_strategies_execute_their_step_lists(which):
    """The step lists the model times are the ones ``tas`` and its ring execute: an edited
    list changes the output (the untouched one is exact)."""
    err = max(run_emulated(_schedules_on_rank, "1x2", which, timeout_s=120))
    assert (err < 1e-5) == (which == "none"), err


# --- profiles -------------------------------------------------------------------------------

def test_profile_file_round_trip_and_every_entry_point(tmp_path, monkeypatch, capsys):
    """A profile file predicts what the profile it was written from predicts, and plan, auto
    and the CLI's --hardware all take it."""
    from xfuser_swiftfusion.hardware import get_profile, load_profile, save_profile
    from xfuser_swiftfusion.strategies.auto import choose
    path = tmp_path / "mine.json"
    save_profile(dataclasses.replace(P4DE, name="mine"), path)
    prof = load_profile(path)
    topo, w = Topology(4, 8), Workload(1, 65536, 24, 64)
    for s in STRATS:
        assert predict(s, topo, w, prof).latency_s == predict(s, topo, w, P4DE).latency_s
    assert get_profile(str(path)).name == "mine"
    assert cli.main(["plan", "--nodes", "4", "--gpus-per-node", "8", "--heads", "24", "--seq-len",
                     "65536", "--head-dim", "64", "--json", "--hardware", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["hardware"] == "mine"
    monkeypatch.setenv("SWIFTFUSION_HARDWARE", str(path))
    best, _, name = choose(topo, 24, torch.empty(1, 24, 65536 // 32, 64, dtype=torch.bfloat16))
    assert name == "mine" and best == recommend(topo, w, prof, pad_heads=True)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["check", "--emulate", "1x2", "--hardware", str(bad)]) == 2
    assert "swiftfusion calibrate" in capsys.readouterr().err


def test_calibrate_writes_a_profile_the_model_runs(tmp_path, capsys):
    """``swiftfusion calibrate --emulate 2x2 --quick`` (loopback): every transfer kind within
    and across machines, a table, and a file that plans."""
    from xfuser_swiftfusion.hardware import KINDS, load_profile
    out = tmp_path / "emu.json"
    assert cli.main(["calibrate", "--emulate", "2x2", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    prof = load_profile(out)
    assert prof.host_cores and prof.host_waits and not prof.two_sided_fifo
    for kind in KINDS:
        assert kind in text
        assert prof.transfers[kind]["inter"].bw > 0 and prof.transfers[kind]["intra"].cpu_s_per_byte > 0
    assert prof.measured["topology"] == "2x2"
    p = predict("torus", Topology(2, 2), Workload(1, 4096, 8, 64), prof)
    assert 0 < p.compute_s < p.latency_s


def test_calibrate_measures_collectives_between_two_of_three_machines(tmp_path, capsys):
    """With 3 machines the collectives are measured across all three and between two
    (``inter1``, the rate of a group spanning two machines); an odd machine out idles."""
    from xfuser_swiftfusion.hardware import load_profile
    out = tmp_path / "emu.json"
    assert cli.main(["calibrate", "--emulate", "3x1", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    prof = load_profile(out)
    for kind in ("all_to_all", "all_gather"):
        assert prof.transfers[kind]["inter1"].bw > 0 and f"{kind:<12} inter1" in text
        assert prof.rate(kind, "inter", 1) is prof.transfers[kind]["inter1"]
        assert prof.rate(kind, "inter", 2) is prof.transfers[kind]["inter"]
    assert "inter1" not in prof.transfers["exchange"]


def test_the_stored_check_against_measurements_holds():
    """``scripts/check_cost_model.py``'s stored run (benchmarks/results/check-cost-model.json:
    the measured rows and the profiles calibrated beside them): the model of this checkout
    still predicts them as well as the run reported, and ``--recalibrate``'s table judges auto
    only where the profile picks what ran."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    ccm = load_script("check_cost_model")
    stored = json.loads((root / "benchmarks" / "results" / "check-cost-model.json").read_text())
    profiles = {(k.split("@")[0], float(k.split("@")[1])): str(root / v)
                for k, v in stored["profiles"].items()}
    _, summary = ccm.table(stored["rows"], profiles, False)
    assert summary["rows"] == 72 and summary["within_15pct"] >= 71, summary
    assert summary["auto_judged"] == 18 and summary["auto_within_5pct"] >= 17, summary
    assert ccm.links_summary(stored["links_pct"]) == {
        k: stored["summary"][k] for k in ("links_within_15pct", "links_fastest_kind_within_15pct")}
    _, same = ccm.table(stored["rows"], profiles, False, repicked=True)
    assert same["auto_judged"] == 18, same            # the profiles auto ran with: every pick
    other = {k: "p4de" for k in profiles}             # GPU rates: other picks, not judged
    _, moved = ccm.table(stored["rows"], other, False, repicked=True)
    assert moved["auto_judged"] < 18, moved


def test_check_links_summary_counts_kinds_and_each_clusters_fastest_kind():
    """The link summary of ``check_cost_model.py``: every kind within +-15 %, and per cluster
    its fastest kind (the link's rate as the best transport carries it) within +-15 %."""
    ccm = load_script("check_cost_model")
    links = {"a@80": {"exchange": -20.0, "get": -10.0},     # fastest -10: recovered
             "b@2000": {"exchange": -30.0, "get": -16.0},   # fastest -16: not
             "c@160": {"exchange": 20.0, "get": -40.0}}     # fastest +20 (over the line): not
    assert ccm.links_summary(links) == {"links_within_15pct": "1/6",
                                        "links_fastest_kind_within_15pct": "1/3"}
