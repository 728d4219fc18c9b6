"""The GPU suite's ``pe-strategy`` stage on CPU: its PEs as CPU processes over the ``shm`` heap
(the cases against the fp64 reference, the model's bytes, a PE killed mid-layer), its
orchestration with fake PEs and a fake MPS control binary (plain refused, then MPS; the
backstop; the budget), the test configuration that lets NVSHMEM PEs share a GPU, and the
pieces the checks rest on (the extended reference, the byte prediction, the fault verdict).
NVSHMEM itself runs only on a GPU."""
from __future__ import annotations

import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from support.reference import rank_rows
from xfuser_swiftfusion.comm import nvshmem
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.tools import check
from xfuser_swiftfusion.tools.gpu_suite import STAGES, Suite, pe_strategy, run_suite
from xfuser_swiftfusion.tools.gpu_suite.report import RowWriter, read_rows

STAGE = pe_strategy.STAGE


def _rows(path) -> list:
    return [r for r in read_rows(str(path)) if r.stage == STAGE]


# -- the stage with CPU PEs (shm heap) -----------------------------------------------------------

def _cases(rows: str) -> bool:
    w = RowWriter(rows, STAGE)
    return pe_strategy._run_cases(w, dist.get_rank(), dist.get_world_size(), torch.device("cpu"),
                                  "plain", "shm")


@pytest.mark.parametrize("topology", ["2x1", "4x1"])
def test_every_case_passes_on_the_cpu_heap(tmp_path, topology):
    """The PEs' cases (forked ranks here, processes in the stage): within the tolerance of the
    reference, the model's bytes on every PE, swiftfusion without fallback."""
    rows = str(tmp_path / "rows.jsonl")
    assert run_emulated(_cases, topology, rows, timeout_s=120) == [True] * int(topology[0])
    got = read_rows(rows)
    assert len(got) == pe_strategy.expected_passes(2), got
    assert all(r.result == "PASS" and r.data["stand_in"] for r in got), got
    assert all(len(set(r.data["bytes"])) == 1 and r.data["bytes"][0] > 0 for r in got)


def _broken_reference(rows: str) -> bool:
    pe_strategy.reference_rows = lambda *a: check.reference_rows(*a) + 0.05
    return _cases(rows)


def test_a_wrong_output_is_a_fail_row_and_stops_the_run(tmp_path):
    rows = str(tmp_path / "rows.jsonl")
    assert run_emulated(_broken_reference, "2x1", rows, timeout_s=120) == [False, False]
    (row,) = read_rows(rows)  # the first case fails; the run stops there
    assert row.result == "FAIL" and "max abs err" in row.figure and row.data["refused"] is False


def test_a_pe_killed_mid_layer_fails_the_others_fast(tmp_path):
    """The fault run's processes as the stage starts them (gloo over a TCP store, the shm heap
    on CPU): PE 1 kills itself after barrier 1; PE 0 ends in PeerFailure naming it and the
    stage within the bound, and exits."""
    suite = Suite(str(tmp_path), quick=True, budget_s=120, cuda=False, gpus=1)
    try:
        pe_strategy._fault(suite, 2, "plain", suite.env, time.monotonic() + 60)
    finally:
        suite.close()
    rows = _rows(tmp_path / "rows.jsonl")
    assert [(r.case, r.result) for r in rows] == [
        ("2x1 PE 1 SIGKILLed mid-layer (rank 0)", "PASS"),
        ("2x1 PE 1 SIGKILLed mid-layer (rank 1)", "INFO"),
        ("2x1 PE 1 SIGKILLed mid-layer: the victim named", "PASS")], rows
    assert rows[0].data["seconds"] < pe_strategy.FAULT_BOUND_S
    # the survivor was replaying the layer's CUDA graph (the capture stand-in on CPU): the
    # replay's watchdog names its rank, the peer and the stages of the captured work
    message = rows[0].data["message"]
    assert message.startswith("CommTimeout: swiftfusion: rank 0: 'swiftfusion: CUDA graph replay'")
    assert "peers [1]" in message and "barrier 1 (after intra-machine Ulysses scatter)" in message
    assert not pe_strategy.fault_named(message, 0), message
    assert "SIGKILL mid-layer" in (tmp_path / "gpu-suite.log").read_text()


@pytest.mark.slow
def test_the_whole_stage_on_the_cpu_heap(tmp_path):
    """2 and 4 PE processes, the fault on 4 (what the dry run runs)."""
    rc = run_suite(str(tmp_path), (STAGE,), quick=True, budget_s=300, allow_cpu=True)
    rows = _rows(tmp_path / "rows.jsonl")
    assert rc == 0 and not [r for r in rows if r.result == "FAIL"], rows
    n = pe_strategy.expected_passes(2)
    assert len([r for r in rows if r.result == "PASS" and "err" in r.data]) == 2 * n
    fault = [(r.case, r.result) for r in rows if r.data.get("fault")]
    assert sorted(fault) == sorted([(f"4x1 PE 3 SIGKILLed mid-layer (rank {r})", "PASS") for r in range(3)]
                                   + [("4x1 PE 3 SIGKILLed mid-layer (rank 3)", "INFO"),
                                      ("4x1 PE 3 SIGKILLed mid-layer: the victim named", "PASS")])
    (skip,) = [r for r in rows if r.result == "SKIP"]
    assert skip.case == "usp, tas, torus, auto" and "NCCL" in skip.figure


@pytest.mark.parametrize("figures,wrong", [
    ({}, ""),
    ({"err": float("nan")}, "max abs err nan"),
    ({"err": 0.03}, "max abs err 3.00e-02 > 0.02"),
    ({"strategy": "tas"}, "ran as tas"),
    ({"fallbacks": {"usp": 1}}, "fallbacks"),
    ({"bytes": 10}, "10 inter-machine bytes, the model 12"),
    ({"error": "CommTimeout: rank 1: 'barrier 1'"}, "rank 1: CommTimeout"),
])
def test_the_case_verdict_names_what_is_wrong(figures, wrong):
    good = {"error": None, "err": 1e-3, "bytes": 12, "predicted": 12, "strategy": "swiftfusion",
            "fallbacks": {}}
    got = pe_strategy._verdict([good, {**good, **figures}], 2e-2)
    assert (got == []) if not wrong else (len(got) == 1 and wrong in got[0]), got


# -- the orchestration, with fake PEs and a fake MPS control binary ------------------------------

FAKE_PE = '''
import json, os, signal, sys, time
rows, rank, world, label, *args = sys.argv[1:]
rank, world = int(rank), int(world)
def add(case, result, figure="", **data):
    with open(rows, "a") as f:
        f.write(json.dumps({"stage": "pe-strategy", "case": case, "result": result,
                            "figure": figure, "data": data}) + "\\n")
tags = {"attempt": label, "world": world}
env = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                      "SWIFTFUSION_TEST_ONLY_PES_SHARE_GPU")}
BEHAVIOUR
'''

MPS_ONLY = '''
if "--fault" in args:
    if rank == world - 1:
        print("pe-strategy: rank 1: SIGKILL mid-layer", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    add(f"fault (rank {rank})", "PASS", "", rank=rank, fault=True, message="PeerFailure: "
        f"swiftfusion: rank {rank}: 'barrier 2 (after Push-O)': peer rank {world - 1} died", **tags)
elif env["CUDA_MPS_PIPE_DIRECTORY"] is None:
    if rank == 0:
        add(f"{world}x1 bf16 eager", "INFO", "NvshmemError: limited mode", refused=True, **tags)
    else:
        time.sleep(60)  # stuck in NVSHMEM's init: stopped after the grace
elif rank == 0:
    for i in range(CASES):
        add(f"{world}x1 case {i} under MPS", "PASS", "", err=0.0, env=env, **tags)
'''


def _fake(tmp_path, monkeypatch, behaviour: str) -> None:
    script = tmp_path / "fake_pe.py"
    n = pe_strategy.expected_passes(2)
    script.write_text(FAKE_PE.replace("BEHAVIOUR", behaviour.replace("CASES", str(n))))
    monkeypatch.setattr(Suite, "pe_command", lambda self, stage, rank, world, port, label, args=():
                        [sys.executable, str(script), self.rows_path, str(rank), str(world), label, *args])


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _stage(tmp_path, budget_s: float = 120, within_s: float = 30) -> list:
    """The stage on a fake one-GPU machine (fake PEs); its rows. It must end within ``within_s``."""
    suite = Suite(str(tmp_path), quick=True, budget_s=budget_s, cuda=True, gpus=1)
    try:
        start = time.monotonic()
        pe_strategy.stage(suite, 150)
        assert time.monotonic() - start < within_s
    finally:
        suite.close()
    assert not os.path.exists(suite.scratch)
    return _rows(tmp_path / "rows.jsonl")


def test_refused_plain_runs_under_a_private_mps_daemon_started_and_stopped(tmp_path, monkeypatch):
    """NVSHMEM refuses the plain PEs (INFO; the PE still stuck is stopped after the grace):
    both worlds run under MPS with 100 / PEs percent each and the opt-in, the fault too; the
    daemon is started with -d and told 'quit'."""
    from xfuser_swiftfusion.tools.gpu_suite import symmetric
    calls = tmp_path / "calls"
    control = _script(tmp_path / "mps-control", f'echo "$@ $(cat 2>/dev/null)" >> {calls}\n')
    monkeypatch.setattr(symmetric, "mps_available", lambda: control)
    monkeypatch.setattr(pe_strategy, "GRACE_S", 1.0)
    _fake(tmp_path, monkeypatch, MPS_ONLY)
    rows = _stage(tmp_path)
    assert not [r for r in rows if r.result == "FAIL"], rows
    assert [(r.case, r.result) for r in rows if r.data.get("refused")] == [
        ("2x1 bf16 eager", "INFO"), ("2x1 (rank 1)", "INFO")]
    assert ("4x1", "SKIP") in [(r.case, r.result) for r in rows]
    under = [r for r in rows if r.data.get("attempt") == "MPS" and "err" in r.data]
    assert {r.data["world"] for r in under} == {2, 4}
    for r in under:
        assert r.data["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(100 // r.data["world"])
        assert r.data["env"]["SWIFTFUSION_TEST_ONLY_PES_SHARE_GPU"] == "1"
        assert "/mps-pe-strategy/" in r.data["env"]["CUDA_MPS_PIPE_DIRECTORY"]
    fault = [(r.case, r.result) for r in rows if r.data.get("fault")]
    assert ("4x1 PE 3 SIGKILLed mid-layer under MPS (rank 3)", "INFO") in fault
    assert ("4x1 PE 3 SIGKILLed mid-layer under MPS: the victim named", "PASS") in fault
    assert calls.read_text().splitlines() == ["-d ", " quit"]


@pytest.mark.parametrize("behaviour,expect", [
    ("time.sleep(60)", "stopped by the stage's bound"),
    ("sys.exit(3)", "exit 3"),
])
def test_pes_that_hang_or_crash_are_fail_rows_within_the_bound(tmp_path, monkeypatch, behaviour, expect):
    _fake(tmp_path, monkeypatch, behaviour)
    monkeypatch.setattr(pe_strategy, "RUN_S", 2.0)
    monkeypatch.setattr(pe_strategy, "MIN_RUN_S", 1.0)
    monkeypatch.setattr(pe_strategy, "WORLDS", (2,))
    rows = _stage(tmp_path, within_s=15)
    assert [r.case for r in rows if r.result == "FAIL"] == ["2x1 (rank 0)", "2x1 (rank 1)"], rows
    assert all(expect in r.figure for r in rows if r.result == "FAIL")
    assert rows[-1].case == "(stage)" and "did not run" in rows[-1].figure


def test_runs_that_no_longer_fit_the_budget_are_skip_rows(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, "raise SystemExit('a PE must not start')")
    rows = _stage(tmp_path, budget_s=5, within_s=5)
    assert [(r.case, r.result) for r in rows][:3] == [
        ("usp, tas, torus, auto", "SKIP"), ("2x1", "SKIP"), ("4x1", "SKIP")]
    assert rows[1].figure.startswith("budget:") and not (tmp_path / "gpu-suite.log").exists()


def test_the_stage_runs_where_issue_42_puts_it():
    assert STAGES[:6] == ("env", "numerics", "speed", "replay", "pe-strategy", "nvshmem")


# -- the pieces --------------------------------------------------------------------------------

def _row(uuid: str, share: bool, error: str | None = None) -> tuple:
    return ("host", uuid, 0, error, share)


def test_nvshmem_refuses_ranks_sharing_a_gpu_unless_every_rank_opted_in(monkeypatch):
    said = []
    monkeypatch.setattr(nvshmem, "log_once", lambda logger, key, msg: said.append((key, msg)))
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 share one GPU .*NVSHMEM needs one GPU "
                                            r"per rank"):
        nvshmem.check_device_rows([_row("GPU-a", False), _row("GPU-a", False)])
    with pytest.raises(RuntimeError, match=r"SWIFTFUSION_TEST_ONLY_PES_SHARE_GPU=1 on ranks \[1\] "
                                            r"but not on the others"):
        nvshmem.check_device_rows([_row("GPU-a", False), _row("GPU-a", True)])
    assert said == []
    nvshmem.check_device_rows([_row("GPU-a", True)] * 4)
    assert said and all(key == "nvshmem-shared-gpu-test" and "a test configuration" in msg
                        for key, msg in said)  # log_once: the first of them only
    nvshmem.check_device_rows([_row("GPU-a", False), _row("GPU-b", False)])  # one GPU each


def test_the_opt_in_is_read_where_the_device_row_is_made(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": "GPU-a"}))
    monkeypatch.delenv(nvshmem.SHARED_GPU_TEST_ENV, raising=False)
    assert nvshmem.device_row(0, None)[1:] == ("GPU-a", 0, None, False)
    monkeypatch.setenv(nvshmem.SHARED_GPU_TEST_ENV, "yes")  # only "1" opts in
    assert nvshmem.device_row(0, None)[4] is False
    monkeypatch.setenv(nvshmem.SHARED_GPU_TEST_ENV, "1")
    assert nvshmem.device_row(0, None)[4] is True


@pytest.mark.parametrize("heads_kv,text,masked", [(0, 0, 0), (2, 0, 0), (0, 5, 3), (4, 5, 3)])
@pytest.mark.parametrize("where", ["front", "rear"])
def test_the_check_reference_equals_the_independent_one(heads_kv, text, masked, where):
    """``tools/check.py``'s reference with grouped-query K/V and key masks, against the tests'
    own fp64 reference."""
    case = check.CheckCase(heads=8, seq_len=24, head_dim=16, dtype="fp32", joint_tokens=text,
                           joint_strategy=where, heads_kv=heads_kv, masked_keys=masked)
    x = check.global_inputs(case, torch.device("cpu"))
    assert x["k"].shape[1] == (heads_kv or 8) and ("mask" in x) == bool(masked)
    for rank in range(3):
        local, kwargs = check.rank_call(x, case, rank, 3)
        assert local[0].shape == (1, 8, 8, 16) and ("key_mask" in kwargs) == bool(masked)
        joint = (x["jq"], x["jk"], x["jv"]) if text else None
        ref = rank_rows(x["q"], x["k"], x["v"], rank, 3, joint, where,
                        key_mask=x.get("mask"), joint_key_mask=x.get("jmask") if text else None)
        assert torch.allclose(check.reference_rows(x, case, rank, 3), ref, atol=1e-12)


@pytest.mark.parametrize("world", pe_strategy.WORLDS)
def test_predicted_bytes_are_the_cost_models(world):
    """Without text and grouped K/V: the cost model's inter-machine elements; grouped K/V move
    H_kv' / H of the K/V bytes (Q and O unchanged); text adds the text rows of the outputs."""
    from xfuser_swiftfusion.cost_model import Workload, inter_node_elements
    from xfuser_swiftfusion.mesh import torus_mesh
    from xfuser_swiftfusion.topology import Topology
    topo = Topology(world, 1)
    mesh, _ = torus_mesh(topo, 8, "tas")
    by = {}
    for name, case in pe_strategy.cases(world):
        by[name] = [pe_strategy.predicted_bytes(mesh, r, case) for r in range(world)]
        assert len(set(by[name])) == 1
    model = inter_node_elements("swiftfusion", topo, Workload(1, pe_strategy.TOKENS * world, 8, 64, "fp32"))
    assert by["fp32"][0] == model * 4 == by["bf16"][0] * 2
    h_kv = math.lcm(pe_strategy.KV_HEADS, world) / 8
    assert by[f"fp32 mask {pe_strategy.MASKED} GQA 2"][0] == model * 4 * (2 + 2 * h_kv) / 4
    text_rows = (world - 1) * (8 // world) * pe_strategy.TEXT * 64 * 4  # pushed with the outputs
    assert by[f"fp32 text {pe_strategy.TEXT}"][0] == model * 4 + text_rows


@pytest.mark.parametrize("rank,text,missing", [
    # the shm heap: the dead peer, or a PE that gave up before this one
    (2, "PeerFailure: swiftfusion: rank 2: 'Pull-KV stage 3, K/V from rank 3': peer rank 3 (pid 7) "
        "died while get with peer 3 on queue 'other'", []),
    (0, "PeerFailure: swiftfusion: rank 0: 'barrier 2 (after Push-O)': quiet of queue 'other' "
        "failed: connection to peer rank 1 failed", []),
    # NVSHMEM's watchdog: a barrier over all ranks
    (0, "CommTimeout: swiftfusion: rank 0: 'barrier 2 (after Push-O)': barrier over all ranks did "
        "not complete within 3.0 s (a peer is gone or stuck)", []),
    (0, "PeerFailure: rank 0: CUDA error while NVSHMEM transfers were in flight on cuda:0: x",
     ["a peer", "stage"]),
    (0, "RuntimeError: swiftfusion: rank 0: 'barrier 2': peer rank 1 died", ["CommTimeout/PeerFailure"]),
    (0, "CommTimeout: swiftfusion: rank 1: 'barrier 2': peer rank 1", ["rank 0"]),
    (1, "CommTimeout: swiftfusion: rank 1: 'barrier 2': peer rank 1", ["a peer"]),
])
def test_a_survivors_error_must_name_rank_peer_and_stage(rank, text, missing):
    assert pe_strategy.fault_named(text, rank) == missing
    assert pe_strategy.fault_named(text.split(": ", 1)[1], rank, typed=False) == [
        m for m in missing if m != "CommTimeout/PeerFailure"]


# -- NVSHMEM's limited multi-process mode, on the capture stand-in ------------------------------

def _graph_cases(rows: str, mps: bool) -> list:
    if mps:
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = "/tmp/stand-in-mps"  # the stand-in's full mode
    pe_strategy.MODES = {"graph": pe_strategy.MODES["graph"]}
    pe_strategy.cases = lambda world: pe_strategy.__dict__["_all_cases"](world)[:1]
    from xfuser_swiftfusion.emulation import cuda_capture
    ok = _cases(rows)
    return [ok, list(cuda_capture.STATS.violations), cuda_capture.STATS.replays]


@pytest.mark.parametrize("mps", [False, True])
def test_limited_mode_refuses_graphs_so_mps_is_tried(tmp_path, monkeypatch, mps):
    """PEs sharing a GPU without MPS (the stand-in's heap as NVSHMEM's limited mode: a barrier
    is a host barrier plus a wait on another PE's IPC event, which breaks a capture): the graph
    mode is an INFO row marked refused, so the stage reruns under MPS, and nothing is captured;
    under MPS (the stand-in's full mode) the same case captures and replays."""
    monkeypatch.setenv(pe_strategy.STAND_IN_LIMITED_ENV, "1")
    monkeypatch.setattr(pe_strategy, "_all_cases", pe_strategy.cases, raising=False)
    rows = str(tmp_path / "rows.jsonl")
    got = run_emulated(_graph_cases, "2x1", rows, mps, timeout_s=120)
    (row,) = read_rows(rows)
    if not mps:
        assert [ok for ok, _, _ in got] == [False, False]
        assert (row.case, row.result, row.data["refused"]) == ("2x1 graph", "INFO", True), row
        assert "limited multi-process mode" in row.figure and "MPS" in row.figure
        assert all(not violations and not replays for _, violations, replays in got), got
    else:
        assert [ok for ok, _, _ in got] == [True, True] and row.result == "PASS", row
        assert all(not violations and replays == 2 for _, violations, replays in got), got


def _second_capture_fails(rows: str) -> list:
    from xfuser_swiftfusion.strategies.planned import PlanCache
    pe_strategy.MODES = {"graph": pe_strategy.MODES["graph"]}
    capture, tries = PlanCache._capture, []

    def first_only(self, entry):
        tries.append(1)
        return capture(self, entry) if len(tries) == 1 else None
    PlanCache._capture = first_only
    return [_cases(rows)]


def test_graph_mode_checks_each_cases_capture(tmp_path):
    """``graphs_captured`` counts since init: each case must add its own graph (the second
    case's capture fails here, and its row says so)."""
    rows = str(tmp_path / "rows.jsonl")
    assert run_emulated(_second_capture_fails, "2x1", rows, timeout_s=120) == [[False], [False]]
    got = read_rows(rows)
    assert [r.result for r in got] == ["PASS", "FAIL"], got
    assert "not captured in a CUDA graph" in got[1].figure


def _limited_fault(rows: str) -> bool:
    w = RowWriter(rows, STAGE)
    pe_strategy._run_fault(w, dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "plain", "shm")
    return True


def test_the_fault_run_needs_barriers_that_are_kernels(tmp_path, monkeypatch):
    """In NVSHMEM's limited mode a barrier spins on the host holding the GIL (nvshmem4py's
    binding of barrier_all_on_stream), so no watchdog could end a PE waiting on a dead one:
    the fault run refuses to run there (the stage runs it only where graph mode passed)."""
    monkeypatch.setenv(pe_strategy.STAND_IN_LIMITED_ENV, "1")
    rows = str(tmp_path / "rows.jsonl")
    assert run_emulated(_limited_fault, "2x1", rows, timeout_s=120) == [True, True]
    got = read_rows(rows)
    assert [r.result for r in got] == ["FAIL", "FAIL"], got
    assert all("barriers that are kernels" in r.figure for r in got)
