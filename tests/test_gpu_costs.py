"""The GPU profiles against the committed GPU run (benchmarks/gpu/h100-6230d7a): the costs file
is what the run's rows give, the model predicts the run's replay of rank 0's ``swiftfusion``
layer within +-15 %, ``plan`` and ``auto`` on the measured profiles pick what the model
predicts fastest and say why, the docs show what ``plan`` prints, and ``calibrate --links``
writes a profile (its CPU stand-ins)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from xfuser_swiftfusion import hardware
from xfuser_swiftfusion.cost_model import Workload, candidates, predict, recommend
from xfuser_swiftfusion.tools import cli, gpu_costs
from xfuser_swiftfusion.tools.gpu_suite.kernel import MODELS
from xfuser_swiftfusion.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
COSTS = hardware.gpu_costs()
RUN = ROOT / COSTS["run"]["dir"]
TOLERANCE = 0.15


def _close(a, b, path="") -> None:
    """``a`` equals ``b`` (nested JSON), numbers within 1e-9 relative."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, a.keys() if isinstance(a, dict) else a)
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9), path
    else:
        assert a == b, path


def test_the_costs_file_is_what_the_committed_run_gives():
    """``gpu_costs.json`` (what p4de, p5, h100-ndr read) is ``derive`` of the run it names:
    refreshed from a new run, the profiles follow it."""
    rows = gpu_costs.load_rows(RUN)
    derived = json.loads(json.dumps(gpu_costs.derive(rows, gpu_costs.run_info(RUN, rows))))
    _close(derived, COSTS)
    assert COSTS["run"]["gpu"] == "NVIDIA H100 80GB HBM3" and COSTS["run"]["commit"] == "6230d7a"


def test_the_model_predicts_the_replay():
    """Rank 0's program (``gpu_costs.replay_program``, the one place it is built: its attend
    calls must be the run's, 44 per Flux layer and 29 per CogVideoX layer) on the replay's
    world (one H100, transfers as device copies) predicts the run's GPU time and host time per
    layer within +-15 % at Flux 3072 px, Flux 4096 px and CogVideoX 5B."""
    measured = gpu_costs.replay_rows(gpu_costs.load_rows(RUN))
    assert set(measured) == {m.name for m in MODELS}
    for m in MODELS:
        assert gpu_costs.attend_calls(gpu_costs.replay_program(m)) == measured[m.name]["attend_calls"], m.name
    check = gpu_costs.check_replay(COSTS)
    assert [c["model"] for c in check] == [m.name for m in MODELS]
    for c in check:
        assert c["gpu_ms"] == measured[c["model"]]["gpu_ms"] and c["host_ms"] == measured[c["model"]]["host_ms"]
        assert abs(c["gpu_err"]) <= TOLERANCE and abs(c["host_err"]) <= TOLERANCE, c


def test_the_replay_check_can_fail():
    """The same check with the datasheet's kernel rate and host cost (600 TFLOP/s, 8 us per
    call: the built-in profiles before they were measured) misses the run by far."""
    sheet = hardware.GPU_PROFILES["p5-datasheet"]
    costs = json.loads(json.dumps(COSTS))
    costs["ours"].update(attention=hardware.table_to_json(
        {"bf16": {D: ((1024, 1024, sheet.flops("bf16", D, 1024, 1024)),) for D in (64, 128)}}),
        attend_call_s=8e-6, transfer_call_s=8e-6, merge_call_s=0.0, chunk_s=0.0)
    check = gpu_costs.check_replay(costs)
    assert all(c["gpu_err"] < -0.3 and c["host_err"] < -0.9 for c in check), check


def test_measured_profiles_say_where_each_figure_comes_from():
    """p5 and h100-ndr take the H100's costs as measured, p4de scales the kernel rates (ours
    and the baseline's) by FlashAttention's A100 / H100 datasheet rates and keeps the host's;
    every profile names the run and how each figure was obtained."""
    p5, p4de, ndr = (hardware.GPU_PROFILES[n] for n in ("p5", "p4de", "h100-ndr"))
    ours = COSTS["ours"]
    assert p5.attend_call_s == ours["attend_call_s"] == p4de.attend_call_s
    assert p5.merge_call_s == ours["merge_call_s"] and p5.chunk_s == ours["chunk_s"]
    assert p5.flops("bf16", 128, 2336, 2336) == pytest.approx(ours["attention"]["bf16"]["128"][0][2])
    assert p4de.flops("bf16", 128, 2336, 2336) == pytest.approx(p5.flops("bf16", 128, 2336, 2336) / 3)
    base5, base4 = p5.for_baseline(), p4de.for_baseline()
    assert base4.flops("bf16", 128, 9344, 9344) == pytest.approx(base5.flops("bf16", 128, 9344, 9344) / 3)
    assert base5.flops("bf16", 128, 9344, 9344) == pytest.approx(4 * 4 * 3 * 9344 * 9344 * 128 / 1.10e-3)
    assert ndr.attention == p5.attention and ndr.transfers != p5.transfers
    for p in (p5, p4de, ndr):
        assert p.measured["commit"] == "6230d7a" and p.measured["gpu"] and p.measured["versions"]["torch"]
        assert set(p.figures) >= {"transfers", "attention", "attend_call_s", "merge_call_s",
                                  "transfer_call_s", "chunk_s", "copy_bw", "baseline"}
        assert "6230d7a" in p.origin()
    assert p5.figures["attention"].startswith("measured") and p4de.figures["attention"].startswith("scaled")
    assert p5.figures["transfers"].startswith("datasheet") and p4de.figures["attend_call_s"].startswith("measured")


def test_a_profile_file_round_trip_keeps_the_baseline_and_old_files_load(tmp_path):
    """A measured profile written and read again predicts what it did (the baseline's own
    costs included); a ``swiftfusion-hardware/1`` file (before those fields) still loads."""
    path = tmp_path / "p5.json"
    hardware.save_profile(hardware.GPU_PROFILES["p5"], path)
    back = hardware.load_profile(path)
    topo, w = Topology(4, 8), Workload(1, 37376, 24, 128)
    for s in ("usp", "swiftfusion"):
        assert predict(s, topo, w, back).latency_s == predict(s, topo, w, hardware.GPU_PROFILES["p5"]).latency_s
    old = ROOT / "benchmarks" / "results" / "hw-4x2-80mbit.json"
    assert json.loads(old.read_text())["format"] == "swiftfusion-hardware/1"
    prof = hardware.load_profile(old)
    assert prof.merge_call_s == 0.0 and prof.chunk_s == 0.0 and not prof.baseline


def test_plan_and_auto_pick_what_the_model_predicts_fastest_and_say_why(capsys, monkeypatch):
    """On p5, Flux 3072 px on 4 x 8: ``plan`` prints GPU and host time beside each prediction,
    names the run the costs come from, and recommends the fastest candidate (usp here) with
    the reason; ``auto`` picks the same and says why once."""
    from xfuser_swiftfusion.strategies import auto
    topo, w = Topology(4, 8), Workload(1, 37376, 24, 128)
    prof = hardware.GPU_PROFILES["p5"]
    cands = candidates(topo, w, prof)
    best = recommend(topo, w, prof, cands=cands)
    assert best.latency_s == min(c.latency_s for c in cands)
    assert cli.main(["plan", "--nodes", "4", "--gpus-per-node", "8", "--heads", "24", "--seq-len",
                     "37376", "--head-dim", "128", "--hardware", "p5"]) == 0
    out = capsys.readouterr().out
    assert "GPU ms" in out and "host ms" in out and "6230d7a" in out and "(a prediction)" in out
    assert f"recommended (auto): {best.strategy} U{best.ulysses}xR{best.ring}" in out
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    assert len(why) == 1 and "host-bound" in why[0] and "swiftfusion" in why[0], out
    swift = predict("swiftfusion", topo, w, prof)
    assert swift.host_bound and swift.latency_s > 5 * best.latency_s   # the host, not the GPU
    monkeypatch.setenv("SWIFTFUSION_HARDWARE", "p5")
    q = torch.empty(1, 24, 37376 // 32, 128, dtype=torch.bfloat16)
    pick, _, name = auto.choose(topo, 24, q, pad_heads=False)
    assert name == "p5" and (pick.strategy, pick.ulysses) == (best.strategy, best.ulysses)


class _Child:
    """Stands for a built child strategy (its build is collective; not the point here)."""

    spec = None

    def __call__(self, *args, **kwargs):
        return None


def test_auto_says_once_why_it_picks_the_baseline(monkeypatch, caplog):
    """``AutoAttention`` on a p5 cluster shape (each new shape picks at its first call; the
    children are stood in for): one warning with the predictions, for two shapes that both
    pick usp."""
    from types import SimpleNamespace
    from xfuser_swiftfusion.strategies import auto
    monkeypatch.setenv("SWIFTFUSION_HARDWARE", "p5")
    monkeypatch.setattr(auto.AutoAttention, "_child", lambda self, *key: _Child())
    monkeypatch.setattr(auto, "call_args", lambda spec, q, k, v, joint, key_mask: (k, v, joint, {}))
    impl = auto.AutoAttention.__new__(auto.AutoAttention)
    impl.args = SimpleNamespace(options={"usp_ulysses": 8})
    impl.topology, impl.num_heads, impl.rank = Topology(4, 8), 24, 0
    impl._by_signature, impl.choices, impl.picked = {}, {}, {}
    with caplog.at_level(logging.INFO, logger="xfuser.swiftfusion"):
        for L in (37376, 66048):
            q = torch.empty(1, 24, L // 32, 128, dtype=torch.bfloat16)
            impl(q, q, q, None, 128 ** -0.5)
    whys = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto (why")]
    assert [c[0] for c in impl.choices.values()] == ["usp", "usp"]
    assert len(whys) == 1 and "on profile p5" in whys[0] and "host-bound" in whys[0], whys


def test_the_docs_show_what_plan_prints():
    """docs/cost-model.md holds ``advice_table()``, which is what ``plan`` prints on the
    measured profiles now, BENCHMARKS.md points there, and README names the run and the picks:
    refreshed costs change the table, and the docs must follow."""
    table = gpu_costs.advice_table()
    plan = cli.plan(4, 8, 24, 37376, 128, hardware="p4de")     # the first row of p4de, as plan has it
    row = next(line for line in table.splitlines() if "| p4de |" in line)
    assert f"| {plan['swiftfusion']['predicted_latency_s'] * 1e3:.2f} (" in row
    assert row.endswith(f"| {plan['recommended']['strategy']} U{plan['recommended']['ulysses_degree']}"
                        f"xR{plan['recommended']['ring_degree']} |")
    assert table in (ROOT / "docs/cost-model.md").read_text(), "docs/cost-model.md: regenerate " \
        "with python -m xfuser_swiftfusion.tools.gpu_costs benchmarks/gpu/h100-6230d7a --advice"
    assert "docs/cost-model.md#what-the-measured-costs-imply-on-4-x-8-gpus" in (ROOT / "BENCHMARKS.md").read_text()
    readme = (ROOT / "README.md").read_text()
    picks = {line.split("|")[-2].split()[0] for line in table.splitlines()[2:]}
    assert "6230d7a" in readme and all(f"`{p}`" in readme for p in picks)


def test_calibrate_on_one_gpu_writes_a_profile(tmp_path, capsys):
    """``swiftfusion calibrate --links p4de --allow-cpu --quick`` (the CPU stand-ins of every
    measurement): a profile with p4de's links, the measured costs and their run, which plans;
    without CUDA and without --allow-cpu it refuses."""
    out = tmp_path / "one.json"
    assert cli.main(["calibrate", "--links", "p4de", "--allow-cpu", "--quick", "--dtypes", "bf16",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    prof = hardware.load_profile(out)
    p4de = hardware.GPU_PROFILES["p4de"]
    assert prof.transfers == p4de.transfers and prof.inter_gpu_bw == p4de.inter_gpu_bw
    assert prof.measured["commit"] and prof.measured["date"] and prof.baseline["attention"]["bf16"]
    assert prof.figures["attention"].startswith("measured") and prof.figures["copy_bw"].startswith("measured")
    # (the stand-in's host and device are one: the fit may put all host cost on either figure)
    assert prof.attend_call_s + prof.transfer_call_s > 0 and math.isfinite(prof.copy_bw)
    assert (tmp_path / "one.rows.jsonl").exists() and "host: attend call" in text
    assert predict("swiftfusion", Topology(4, 8), Workload(1, 37376, 24, 128), prof).latency_s > 0
    if not torch.cuda.is_available():
        assert cli.main(["calibrate", "--links", "p5", "--out", str(tmp_path / "x.json")]) == 2
        assert "--allow-cpu" in capsys.readouterr().err
