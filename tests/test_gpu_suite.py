"""``swiftfusion check --gpu-suite`` on CPU: the harness (stages as processes, rows, table,
timeouts and crashes as FAIL rows), the kernel checks under the triton interpreter, that they
fail on wrong or unwritten outputs, the fp64 reference against ``support.reference``, the
Torus launch shapes against the launches the strategy makes, and the report parsers for
compute-sanitizer and Nsight Compute. What needs a GPU (speed, sanitizer, ncu, NVSHMEM) runs
only there: ``skip`` rows here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from support.reference import attention_lse
from xfuser_swiftfusion.tools.cli import main as cli_main
from xfuser_swiftfusion.tools.gpu_suite import Suite, kernel, run_suite, tools
from xfuser_swiftfusion.tools.gpu_suite.report import RowWriter, read_rows


def test_suite_on_cpu_writes_the_table_rows_and_log(tmp_path, capsys):
    out = tmp_path / "out"
    rc = run_suite(str(out), ("env", "numerics", "speed", "nvshmem"), quick=True, budget_s=300,
                   allow_cpu=True)
    rows = read_rows(str(out / "rows.jsonl"))
    assert rc == 0, [r for r in rows if r.result == "FAIL"]
    numerics = [r for r in rows if r.stage == "numerics"]
    assert len(numerics) == 4 and all(r.result == "PASS" for r in numerics)
    assert all(r.data["worst"]["backend"] == "triton" for r in numerics)
    speed = [r for r in rows if r.stage == "speed" and r.result == "INFO"]  # CPU stand-ins
    assert len(speed) == sum(len(kernel._launches(m)) for m in kernel.CPU_MODELS)  # fused and per ring step
    assert all(r.data["stand_in"] for r in speed)
    skipped = {r.case for r in rows if r.stage == "speed" and r.result == "SKIP"}
    assert skipped == {f"{b} D{d} bf16" for b in ("triton", "cudnn", "torch-flash", "flash-attn")
                       for d in (64, 128)}
    assert {(r.stage, r.result) for r in rows if r.stage == "nvshmem"} == {("nvshmem", "SKIP")}
    table_doc = json.loads((out / "kernel-table.json").read_text())
    assert set(table_doc["archs"]["cpu"]) == {"128/bf16", "64/bf16"}
    table = (out / "gpu-suite.md").read_text()
    assert "| numerics | triton D64 bf16 finalize on | PASS |" in table
    assert len(json.loads((out / "gpu-suite.json").read_text())) == len(rows)
    assert "===== numerics" in (out / "gpu-suite.log").read_text()
    printed = capsys.readouterr().out
    assert "[2/4] numerics" in printed and table in printed


def test_without_a_gpu_the_suite_says_so(tmp_path, capsys):
    assert cli_main(["check", "--gpu-suite", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_stage_that_crashes_or_hangs_is_a_fail_row(tmp_path):
    suite = Suite(str(tmp_path), quick=True, budget_s=60, cuda=False, gpus=1)
    try:
        rc, _ = suite.run("crash", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
        assert rc == 3
        # the stage's own children end with it
        child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(30)"
        start = time.monotonic()
        rc, _ = suite.run("hang", [sys.executable, "-c", child], 1)
        assert rc is None and time.monotonic() - start < 15  # not held up by the child's pipe
    finally:
        suite.close()
    assert not os.path.exists(suite.scratch)
    leftover = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
    rows = read_rows(str(tmp_path / "rows.jsonl"))
    assert [(r.stage, r.result) for r in rows] == [("crash", "FAIL"), ("hang", "FAIL")]
    assert rows[0].figure == "exit 3: boom" and rows[1].figure.startswith("timed out after 1 s")


@pytest.mark.parametrize("finalize", [True, False])
def test_numerics_fail_on_a_wrong_or_unwritten_output(tmp_path, monkeypatch, finalize):
    """The check is able to fail: the last Q row of each launch's output left unwritten
    (finalizing: the NaN poison stays) or its state scaled (not finalizing). The kernel under
    the break is the CPU backend (triton's interpreter is set per process, at import)."""
    real = kernel.attend

    def broken(qs, kvs, states, *, scale, finalize=False, out=None):
        res = real(qs, kvs, states, scale=scale, finalize=finalize, out=None)
        if finalize:
            for o, r in zip(out, res):
                o[..., :-1, :] = r[..., :-1, :]  # the last row keeps its poison
            return out
        for s in states:
            s.acc[..., -1:, :] *= 1.5
        return None

    monkeypatch.setattr(kernel, "attend", broken)
    kernel.set_backend("cpu")
    try:
        kernel._numerics_row(RowWriter(str(tmp_path / "r.jsonl"), "numerics"), "broken",
                             torch.device("cpu"), 32, torch.bfloat16, finalize, range(2), 24)
    finally:
        kernel.set_backend(None)
    (row,) = read_rows(str(tmp_path / "r.jsonl"))
    assert row.result == "FAIL", row


@pytest.mark.parametrize("heads_kv", [4, 2])
def test_reference_is_softmax_attention_over_all_chunks(heads_kv):
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(2, 4, n, 16, generator=g) for n in (5, 0, 7)]
    kvs = [(torch.randn(2, heads_kv, n, 16, generator=g), torch.randn(2, heads_kv, n, 16, generator=g))
           for n in (3, 0, 9)]
    outs, lses = kernel.reference(qs, kvs, 0.3)
    k = torch.cat([k for k, _ in kvs], dim=2)
    v = torch.cat([v for _, v in kvs], dim=2)
    for q, o, lse in zip(qs, outs, lses):
        want_o, want_lse = attention_lse(q, k, v, scale=0.3)
        torch.testing.assert_close(o, want_o)
        torch.testing.assert_close(lse, want_lse)


def _launches_made(heads: int, head_dim: int, tokens: int) -> list[tuple]:
    """Rank function: swiftfusion on this emulated cluster; the (Q lengths, K/V lengths,
    heads) of every attend call with K/V (the ring's launches)."""
    import torch.distributed as dist

    import xfuser_swiftfusion as sf
    from xfuser_swiftfusion.strategies import ring
    seen, real = [], ring.attend

    def spy(qs, kvs, states, **kw):
        if kvs:
            seen.append((tuple(q.shape[2] for q in qs), tuple(k.shape[2] for k, _ in kvs), qs[0].shape[1]))
        return real(qs, kvs, states, **kw)

    ring.attend = spy
    S = tokens // dist.get_world_size()
    ctx = sf.init_sequence_parallel("swiftfusion", num_heads=heads, timeout_s=60)
    try:
        x = [torch.randn(1, heads, S, head_dim) for _ in range(3)]
        ctx.attention(*x)
    finally:
        ctx.close()
        ring.attend = real
    return sorted(set(seen))


@pytest.mark.parametrize("topology, heads", [("2x2", 8), ("2x2", 4), ("3x2", 6)])
def test_torus_launches_are_the_launches_swiftfusion_makes(topology, heads):
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    from xfuser_swiftfusion.topology import Topology
    topo = Topology.parse(topology)
    tokens = 24 * topo.world_size
    made = run_emulated(_launches_made, topo, heads, 16, tokens, timeout_s=120)
    model = kernel.ModelShape("t", heads, 16, tokens)
    want = sorted({(launch.q_lens, launch.kv_lens, launch.heads)
                   for launch in kernel.torus_launches(model, topo.nodes, topo.gpus_per_node)})
    for rank_launches in made:
        assert rank_launches == want


def test_sanitizer_summaries():
    assert tools.sanitizer_errors("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert tools.sanitizer_errors("========= ERROR SUMMARY: 3 errors\n") == 3
    assert tools.sanitizer_errors(
        "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n") == 1
    assert tools.sanitizer_errors("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)") == 0
    assert tools.sanitizer_errors("Traceback ...") is None


def test_ncu_details_csv():
    text = ('==PROF== Connected to process 1\n'
            '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"\n'
            '"0","1","python3","h","_multi_chunk_attn_kernel","1","7","(128, 1, 1)","(33, 1, 3)",'
            '"0","9.0","GPU Speed Of Light Throughput","Duration","us","61.25"\n'
            '"0","1","python3","h","_multi_chunk_attn_kernel","1","7","(128, 1, 1)","(33, 1, 3)",'
            '"0","9.0","Occupancy","Achieved Occupancy","%","11.80"\n'
            '"0","1","python3","h","_multi_chunk_attn_kernel","1","7","(128, 1, 1)","(33, 1, 3)",'
            '"0","9.0","Command line profiler metrics",'
            '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","%","41.2"\n')
    m = tools.ncu_metrics(text)
    assert m["Duration"] == "61.25 us" and m["Achieved Occupancy"] == "11.80 %"
    assert m["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"] == "41.2 %"
    cmd = tools.ncu_command("ncu", ["python3", "x.py"])
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and cmd[-2:] == ["python3", "x.py"]


def _lifecycle_on_the_heap(rows: str) -> None:
    from xfuser_swiftfusion.tools.gpu_suite import symmetric
    symmetric.lifecycle(RowWriter(rows, "nvshmem"), kind="shm")


@pytest.mark.parametrize("topology", ["1x1", "1x2"])
def test_nvshmem_stage_checks_run_on_the_emulated_heap(tmp_path, topology):
    """The nvshmem stage's lifecycle checks (put/get of contiguous and strided slices, team
    calls, close, a second communicator) over the CPU heap, which has the same API."""
    from xfuser_swiftfusion.emulation.launcher import run_emulated
    rows = str(tmp_path / "rows.jsonl")
    run_emulated(_lifecycle_on_the_heap, topology, rows, timeout_s=120)
    got = read_rows(rows)
    world = 2 if topology == "1x2" else 1
    assert len(got) == 5 * world and all(r.result == "PASS" for r in got), got


# -- the harness: budget, stage errors, the probe -----------------------------------------------

def test_a_stage_cut_by_the_budget_is_a_skip_not_a_failure(tmp_path):
    suite = Suite(str(tmp_path), quick=True, budget_s=1.5, cuda=False, gpus=1)
    try:
        start = time.monotonic()
        rc, _ = suite.run("compile", [sys.executable, "-c", "import time; time.sleep(30)"], 300)
        assert rc is None and time.monotonic() - start < 10
    finally:
        suite.close()
    (row,) = read_rows(str(tmp_path / "rows.jsonl"))
    assert (row.stage, row.result) == ("compile", "SKIP") and row.figure.startswith("budget: stopped")
    assert row.data["budget"] is True


def test_a_stage_that_raises_costs_that_stage_and_the_table_is_written(tmp_path, monkeypatch, capsys):
    def stage(self, name):
        if name == "numerics":
            raise subprocess.TimeoutExpired(["nvidia-cuda-mps-control", "-d"], 30)
        self.add(name, "case", "PASS", "ran")

    monkeypatch.setattr(Suite, "stage", stage)
    rc = run_suite(str(tmp_path), ("env", "numerics", "speed"), quick=True, budget_s=60, allow_cpu=True)
    rows = read_rows(str(tmp_path / "rows.jsonl"))
    assert rc == 1
    assert [(r.stage, r.result) for r in rows] == [("env", "PASS"), ("numerics", "FAIL"), ("speed", "PASS")]
    assert "TimeoutExpired" in rows[1].figure
    assert "| numerics | (stage) | FAIL |" in (tmp_path / "gpu-suite.md").read_text()


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_probe_waits_no_longer_than_the_budget(tmp_path, monkeypatch):
    """An MPS daemon that never starts: the probe returns at the end of the budget with a row,
    not after its own 30 s (or an exception)."""
    from xfuser_swiftfusion.tools.gpu_suite import symmetric
    control = _script(tmp_path / "mps-control", 'if [ "$1" = "-d" ]; then sleep 60; fi\nexit 0\n')
    monkeypatch.setattr(symmetric, "mps_available", lambda: control)
    monkeypatch.setattr(Suite, "_probe", lambda self, label, world, env: None)
    suite = Suite(str(tmp_path), quick=True, budget_s=22, cuda=True, gpus=1)
    suite.deadline = time.monotonic() + 2.0  # past the check for MIN_STAGE_S, 2 s left
    monkeypatch.setattr("xfuser_swiftfusion.tools.gpu_suite.MIN_STAGE_S", 1)
    try:
        start = time.monotonic()
        suite.pe_probe()
        assert time.monotonic() - start < 10
    finally:
        suite.close()
    rows = read_rows(str(tmp_path / "rows.jsonl"))
    assert [(r.case, r.result) for r in rows] == [("MPS daemon", "INFO")], rows


# -- ncu and compute-sanitizer ------------------------------------------------------------------

def _speed_rows(rows_path: str) -> None:
    w = RowWriter(rows_path, "speed")
    for name, q in (("small", 2), ("large", 8), ("medium", 4)):
        launch = kernel.Launch(name, 3, 128, (64,) * q, (64,) * 2)
        # the largest launch is not the slowest one
        w.add(name, "INFO", "x", flops=launch.flops, launch=launch.__dict__, tflops={"triton": 50 + q})


def test_ncu_profiles_the_largest_launch_and_a_working_fallback_is_no_failure(tmp_path, monkeypatch):
    args_file = tmp_path / "args"
    csv = ('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
           '"0","_multi_chunk_attn_kernel","GPU Speed Of Light Throughput","Duration","us","61.25"\n')
    ncu = _script(tmp_path / "ncu", f'echo "$@" >> {args_file}\n'
                  'case "$*" in *--metrics*) echo "==ERROR== unknown metric"; exit 1;; esac\n'
                  f"cat <<'CSV'\n{csv}CSV\n")
    monkeypatch.setattr(tools, "find", lambda name: ncu if name == "ncu" else None)
    suite = Suite(str(tmp_path), quick=True, budget_s=60, cuda=True, gpus=1)
    _speed_rows(suite.rows_path)
    try:
        suite.ncu()
    finally:
        suite.close()
    rows = [r for r in read_rows(suite.rows_path) if r.stage == "ncu"]
    assert [(r.case, r.result) for r in rows] == [("large", "INFO")], rows
    assert "Duration 61.25 us" in rows[0].figure and "pipe metrics not available" in rows[0].figure
    assert '"name": "large"' in args_file.read_text().splitlines()[0]
    assert (tmp_path / "ncu.csv").read_text().startswith('"ID"')


def test_sanitizer_counts_kernel_errors_and_racecheck_on_sm90_is_information(tmp_path, monkeypatch):
    """A fake compute-sanitizer: the memcheck run reports two CUDA API errors torch handles
    (no kernel error), the racecheck run two hazards; on sm_90 racecheck is an INFO row."""
    fake = _script(tmp_path / "compute-sanitizer", '''
rows=""; prev=""
for a in "$@"; do [ "$prev" = "--rows" ] && rows="$a"; prev="$a"; done
echo '{"stage": "launches", "case": "launch D64 bf16", "result": "PASS", "figure": "", "data": {}}' >> "$rows"
case "$*" in
*racecheck*) echo "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)"; exit 9;;
*) echo "========= Program hit cudaErrorPeerAccessUnsupported (error 217) due to peer access is not supported on CUDA API call to cudaDeviceCanAccessPeer."
   echo "========= Program hit cudaErrorInvalidValue (error 1) due to invalid argument on CUDA API call to cudaFuncGetAttributes."
   echo "========= ERROR SUMMARY: 2 errors"; exit 9;;
esac
''')
    monkeypatch.setattr(tools, "find", lambda name: fake if name == "compute-sanitizer" else None)
    suite = Suite(str(tmp_path), quick=True, budget_s=60, cuda=True, gpus=1)
    suite.add("env", "gpu", "INFO", "H100", sm="90")
    try:
        suite.sanitizer()
    finally:
        suite.close()
    rows = {r.case: r for r in read_rows(suite.rows_path) if r.stage == "sanitizer"}
    assert rows["memcheck"].result == "PASS", rows["memcheck"]
    assert rows["racecheck"].result == "INFO" and "2 kernel errors" in rows["racecheck"].figure
    assert "--report-api-errors" in tools.sanitizer_command("cs", "memcheck", ["p"])


def test_sanitizer_api_errors_are_not_kernel_errors():
    out = ("========= Program hit cudaErrorInvalidValue (error 1) due to invalid argument on CUDA API "
           "call to cudaFuncGetAttributes.\n"
           "========= Invalid __global__ read of size 4 bytes\n"
           "========= ERROR SUMMARY: 2 errors\n")
    assert tools.sanitizer_errors(out) == 1
    assert tools.racecheck_is_information(90) and not tools.racecheck_is_information(80)


# -- the strategies stage: one row per strategy ---------------------------------------------------

@pytest.fixture
def one_rank_world(monkeypatch):
    import torch.distributed as dist

    from xfuser_swiftfusion.emulation.launcher import free_port
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fake_check(failing: set, seen: list):
    from xfuser.core.distributed import runtime_state as rs

    from xfuser_swiftfusion.tools.check import CheckRow

    def check_strategy(strategy, case, topology=None, timeout_s=None):
        seen.append((strategy, case.dtype, rs.RuntimeState._select_attention_backend(None, None)))
        if (strategy, case.dtype) in failing:
            raise RuntimeError(f"{strategy} cannot run {case.dtype} here")
        return CheckRow(strategy, strategy, "U1xR1 (one GPU)", 0.0, 1e-5, True, 0)

    return check_strategy


def test_one_strategy_that_raises_costs_its_row_only(tmp_path, monkeypatch, one_rank_world):
    from xfuser_swiftfusion.strategies import names
    from xfuser_swiftfusion.tools.check import check_strategy
    from xfuser_swiftfusion.tools.gpu_suite import paths
    seen: list = []
    monkeypatch.setattr("xfuser_swiftfusion.tools.check.check_strategy",
                        _fake_check({("tas", "bf16")}, seen))
    paths.strategies(RowWriter(str(tmp_path / "r.jsonl"), "strategies"), quick=True)
    rows = read_rows(str(tmp_path / "r.jsonl"))
    assert len(rows) == 2 * len(names()) and check_strategy is not None
    assert [r.case for r in rows if r.result == "FAIL"] == ["tas bf16 text 7 on 1 GPU"]
    assert all(r.result == "PASS" for r in rows if not r.case.startswith("tas bf16"))


def test_usp_fp32_on_cuda_runs_on_xfusers_efficient_backend_or_is_a_skip(tmp_path, monkeypatch, one_rank_world):
    from xfuser.core.distributed.attention_backend import AttentionBackendType

    from xfuser_swiftfusion.tools.gpu_suite import paths
    seen: list = []
    monkeypatch.setattr("xfuser_swiftfusion.tools.check.check_strategy",
                        _fake_check({("usp", "fp32")}, seen))
    paths.strategies(RowWriter(str(tmp_path / "r.jsonl"), "strategies"), quick=True, cuda=True)
    backends = {(s, dt): b for s, dt, b in seen}
    assert backends[("usp", "fp32")] == AttentionBackendType.SDPA_EFFICIENT
    assert backends[("usp", "bf16")] != AttentionBackendType.SDPA_EFFICIENT  # xFuser's own choice
    rows = {r.case: r for r in read_rows(str(tmp_path / "r.jsonl"))}
    usp = rows["usp fp32 text 7 on 1 GPU"]
    assert usp.result == "SKIP" and "SDPA_EFFICIENT" in usp.figure and "usp cannot run fp32" in usp.figure


def test_usp_refuses_fp32_on_xfusers_cudnn_backend(monkeypatch, one_rank_world):
    """xFuser's CUDNN backend (its default where cuDNN is) gave NaN for fp32 on the H100 (the
    compile stage's usp and auto rows): usp raises an error naming the fix instead."""
    from xfuser.core.distributed import runtime_state as rs
    from xfuser.core.distributed.attention_backend import AttentionBackendType

    from xfuser_swiftfusion import init_sequence_parallel
    from xfuser_swiftfusion.distributed import init_distributed_from_env
    init_distributed_from_env()
    monkeypatch.setattr(rs.RuntimeState, "_select_attention_backend",
                        lambda self, config=None: AttentionBackendType.CUDNN)
    ctx = init_sequence_parallel("usp", num_heads=2, timeout_s=30)
    try:
        q = torch.randn(1, 2, 8, 16)
        with pytest.raises(ValueError, match="CUDNN.*fp16/bf16.*SDPA_EFFICIENT"):
            ctx.attention(q, q, q)
    finally:
        ctx.close()


def test_compile_stage_runs_xfusers_usp_in_fp32_on_its_efficient_backend(tmp_path, monkeypatch,
                                                                         one_rank_world):
    """As the strategies stage: on a GPU xFuser's own choice (cuDNN) cannot run the stage's fp32
    model; the backend holds during the whole run (auto builds xFuser's state at its first call)."""
    from xfuser.core.distributed import runtime_state as rs
    from xfuser.core.distributed.attention_backend import AttentionBackendType

    import xfuser_swiftfusion
    from xfuser_swiftfusion.strategies import names
    from xfuser_swiftfusion.tools.gpu_suite import paths
    seen: list = []

    class Ctx:
        def __init__(self, strategy):
            self.strategy = strategy

        def attention(self, q, k, v):
            seen.append((self.strategy, rs.RuntimeState._select_attention_backend(None, None)))
            raise RuntimeError("recorded")

        def close(self):
            seen.append((self.strategy, "closed"))

    monkeypatch.setattr(xfuser_swiftfusion, "init_sequence_parallel",
                        lambda strategy, **kw: Ctx(strategy))
    paths.compiled_attention(RowWriter(str(tmp_path / "r.jsonl"), "compile"), torch.device("cpu"),
                             cuda=True)
    assert seen == [x for s in names() for x in ((s, AttentionBackendType.SDPA_EFFICIENT),
                                                 (s, "closed"))]
    assert [r.result for r in read_rows(str(tmp_path / "r.jsonl"))] == ["FAIL"] * len(names())


# -- env, numerics, speed -----------------------------------------------------------------------

def test_env_records_the_cuda_python_packages_and_transformers():
    from xfuser_swiftfusion.tools.gpu_suite import paths
    assert {"cuda-core", "cuda-bindings", "cuda-pathfinder", "transformers", "numpy"} <= set(paths.versions())


def test_numerics_is_a_skip_where_the_triton_interpreter_cannot_run(tmp_path, monkeypatch):
    """The GPU image's triton 3.6.0 with numpy 2.5.2 (reported by the package metadata)."""
    import importlib.metadata

    from xfuser_swiftfusion.kernels import interpret
    real = importlib.metadata.version
    image = {"triton": "3.6.0", "numpy": "2.5.2"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: image.get(name) or real(name))
    clear = getattr(getattr(interpret, "interpreter_problem", None), "cache_clear", lambda: None)
    clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        kernel.numerics(RowWriter(str(tmp_path / "r.jsonl"), "numerics"), torch.device("cpu"), quick=True)
    finally:
        clear()
    (row,) = read_rows(str(tmp_path / "r.jsonl"))
    assert (row.case, row.result) == ("triton", "SKIP") and "numpy 2.5.2" in row.figure


def test_speed_times_each_backend_through_attend_and_its_prebuilt_kernels():
    launch = kernel.torus_launches(kernel.CPU_MODELS[1])[0]
    got = kernel.measure_launch(launch, ["cpu"], torch.bfloat16, torch.device("cpu"), quick=True)
    assert set(got["attend"]) == set(got["kernel"]) == set(got["single"]) == {"cpu"}
    assert got["kernel_how"] == {"cpu": "host"}


def test_fused_launches_follow_the_schedule_with_the_same_flops():
    """One launch per Torus stage and query entries: at most 12 per layer, the same work as the
    per-ring-step launches; Flux 3072 px's are the issue's 2336 x 9344 and 9344 x 9344."""
    for model in kernel.MODELS:
        fused, ring = kernel.schedule_launches(model, fused=True), kernel.schedule_launches(model)
        assert sum(x.count for x in fused) <= 12 < sum(x.count for x in ring)
        assert sum(x.flops * x.count for x in fused) == pytest.approx(sum(x.flops * x.count for x in ring))
    flux = kernel.schedule_launches(kernel.MODELS[0], fused=True)
    assert sorted((sum(x.q_lens), sum(x.kv_lens), x.count) for x in flux) == [(2336, 9344, 8), (9344, 9344, 2)]


def test_triton_variants_time_the_candidates_and_splits(monkeypatch):
    from xfuser_swiftfusion.kernels import triton_attend
    monkeypatch.setattr(triton_attend, "_device_info", lambda index: (90, 132))
    short, full = kernel.schedule_launches(kernel.MODELS[0], fused=True)
    labels = [label for label, _ in kernel.triton_variants(short, torch.device("cuda", 0), quick=False)]
    assert "128x64 w8 s3 split 1" in labels and "128x64 w8 s3 split 4" in labels  # the default splits 2
    assert "128x64 w8 s3 split 2" not in labels  # the default itself is timed as the backend
    assert all(how["n_split"] == 1 for _, how in kernel.triton_variants(full, torch.device("cuda", 0), quick=False))


def test_the_kernel_table_is_written_from_the_speed_rows(tmp_path):
    from xfuser_swiftfusion.tools.gpu_suite import write_kernel_table
    w = RowWriter(str(tmp_path / "r.jsonl"), "speed")
    for ms in ({"triton": 1.0, "cudnn": 0.5}, {"triton": 2.0, "cudnn": 3.0}):
        w.add("launch", "INFO", "x", attend_ms=ms, arch="sm90", shape="128/bf16")
    assert write_kernel_table(read_rows(str(tmp_path / "r.jsonl")), str(tmp_path / "t.json"))
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["archs"]["sm90"]["128/bf16"] == {"order": ["triton", "cudnn"], "ms": {"triton": 3.0, "cudnn": 3.5}}


# -- replay -------------------------------------------------------------------------------------

def _replayed(model, monkeypatch) -> tuple[list, object]:
    from xfuser_swiftfusion.strategies import ring, torus
    from xfuser_swiftfusion.tools.gpu_suite import replay
    seen, real = [], ring.attend

    def spy(qs, kvs, states, **kw):
        if kvs:
            seen.append((tuple(q.shape[2] for q in qs), tuple(k.shape[2] for k, _ in kvs), qs[0].shape[1]))
        return real(qs, kvs, states, **kw)

    monkeypatch.setattr(ring, "attend", spy)
    assert torus.attend is not None
    r = replay.build_layer(model, torch.device("cpu"), torch.float32)
    out = r()  # [B, H, S + Tj, D]: the text rows with the image rows
    assert out.shape[2] == r.q.shape[2] + model.joint and torch.isfinite(out).all()
    return sorted(set(seen)), r


@pytest.mark.parametrize("heads", [24, 48])
def test_replay_makes_rank_0s_launches_and_transfers(monkeypatch, heads):
    """The replayed layer makes the launches ``torus_launches`` derives (checked there against
    the launches swiftfusion makes on emulated clusters) and moves rank 0's bytes."""
    from xfuser_swiftfusion.mesh import counted_inter_node_elements
    model = kernel.ModelShape("m", heads, 16, 32 * 4)
    made, r = _replayed(model, monkeypatch)
    want = sorted({(x.q_lens, x.kv_lens, x.heads) for x in kernel.torus_launches(model)})
    assert made == want
    elements = counted_inter_node_elements(r.mesh, 1, model.tokens, heads, 16, ring="pull")[0]
    assert r.comm.counter.inter_node_bytes == elements * 4  # fp32
    assert r.comm.copies > 0


def test_replay_with_text_tokens_and_its_usp_equivalent(monkeypatch):
    model = kernel.ModelShape("m", 48, 16, 32 * 3 + 5, joint=5)
    _, r = _replayed(model, monkeypatch)
    assert (r.usp_heads, r.usp_queries, r.keys) == (3, 32 * 3 // 2 + 5, 32 * 3 + 5)  # U16 x R2
    from xfuser_swiftfusion.tools.gpu_suite import replay
    out, lse = replay.usp_single_kernel(r, "cpu")()[:2]
    assert out.shape == (1, 3, r.usp_queries, 16)


class _StreamJoins:
    """``torch.cuda``'s streams and events as CUDA graph capture sees them: work recorded on a
    stream forked from the origin stream is unjoined until the origin waits on that stream or
    on its latest event (capture ends with 'capturing stream has unjoined work' otherwise)."""

    def __init__(self, monkeypatch) -> None:
        import contextlib
        joins = self

        class Stream:
            def __init__(self, device=None, priority=0) -> None:
                self.records = 0   # events recorded on it
                self.joined = 0    # of them, joined into the origin

            def wait_stream(self, other) -> None:
                if self is joins.origin:
                    other.joined = other.records

            def wait_event(self, event) -> None:
                if self is joins.origin and event.stream is not None:
                    event.stream.joined = max(event.stream.joined, event.n)

        class Event:
            def __init__(self, *a, **k) -> None:
                self.stream, self.n = None, 0

            def record(self, stream=None) -> None:
                self.stream = stream or joins.current
                self.stream.records += 1
                self.n = self.stream.records

        @contextlib.contextmanager
        def stream_ctx(s):
            before, joins.current = joins.current, s
            try:
                yield
            finally:
                joins.current = before

        self.origin = self.current = Stream()
        self.Stream = Stream
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: joins.current)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)


def test_the_replayed_layer_joins_every_transfer_stream_before_it_returns(monkeypatch):
    """CUDA graph capture of the layer ends with 'capturing stream has unjoined work' unless
    every transfer stream forked from the capturing stream is joined back before it returns."""
    from xfuser_swiftfusion.tools.gpu_suite import replay
    joins = _StreamJoins(monkeypatch)
    r = replay.build_layer(kernel.ModelShape("m", 24, 16, 32 * 4, joint=3), torch.device("cpu"),
                           torch.float32)
    comm = r.comm
    comm._cuda, comm._used = True, {}
    comm._pools = {q: [joins.Stream() for _ in range(2)] for q in ("ring", "other")}
    comm._turn = dict.fromkeys(comm._pools, 0)
    r()
    streams = [s for pool in comm._pools.values() for s in pool]
    assert sum(s.records for s in streams) > 0
    assert [(s.records, s.joined) for s in streams if s.joined < s.records] == []


def test_the_replay_draws_nothing_from_the_default_generator():
    """A failed CUDA graph capture left the H100's default generator unusable and the next
    input draw failed the whole replay stage ('Offset increment outside graph capture')."""
    from xfuser_swiftfusion.tools.gpu_suite import replay
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    r = replay.build_layer(kernel.ModelShape("m", 24, 16, 32 * 4, joint=3), torch.device("cpu"),
                           torch.float32)
    r()
    replay.usp_single_kernel(r, "cpu")()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert r.q.std() > 0.5 and r.comm._buffers.entries()  # random inputs, filled buffers


def test_a_replayed_graph_is_compared_with_the_eager_layer_from_the_same_state():
    """``same_output`` restores the symmetric buffers between its two runs and tells a wrong
    second run apart; the replayed layer itself is the same at every call (what it leaves in
    the buffers is what the next call reads again)."""
    from xfuser_swiftfusion.tools.gpu_suite import replay
    r = replay.build_layer(kernel.ModelShape("m", 24, 16, 32 * 4, joint=3), torch.device("cpu"),
                           torch.float32)
    r()
    assert replay.same_output(r, r, r) == 0.0
    assert torch.equal(r().clone(), r())
    wrong = lambda: r() + 1  # noqa: E731
    assert replay.same_output(r, r, wrong) == pytest.approx(1.0)


def test_replay_comm_puts_to_other_peers_never_land_in_my_buffers():
    """Puts to several peers wrote one local slot concurrently on pool streams (on an H200 a
    CogVideoX graph replay differed from eager by 0.44 with 4 streams per queue): a put to
    another rank lands in a scratch image nothing reads; a put to myself in my buffer."""
    from xfuser_swiftfusion.tools.gpu_suite.replay import ReplayComm
    comm = ReplayComm(0, 3, [0, 0, 1], 5.0)
    a, src = comm.symmetric_empty((3, 64), torch.float32), comm.symmetric_empty((3, 64), torch.float32)
    before = a.clone()
    for peer in (1, 2):  # on my machine, on another one
        src[peer].fill_(float(peer))
        comm.put(a[1], src[peer], peer, queue="other", what="Push-O").wait()
    assert torch.equal(a, before)
    comm.put(a[1], src[2], 0, queue="other", what="to myself").wait()
    assert torch.equal(a[1], torch.full((64,), 2.0))


def test_replay_comm_copies_the_bytes_of_slices():
    from xfuser_swiftfusion.tools.gpu_suite.replay import ReplayComm
    comm = ReplayComm(0, 3, [0, 0, 1], 5.0)  # rank 1 on my machine, rank 2 on another
    a, b = comm.symmetric_empty((4, 256), torch.float32), comm.symmetric_empty((4, 256), torch.float32)
    src = torch.randn(4, 256)
    comm.put(a[1:3], src[1:3], 0, queue="other", what="rows").wait()  # to myself: my buffer
    comm.get(b[:, 64:128], a[:, 64:128], 1, queue="ring", what="strided").wait()  # one copy per row
    assert torch.equal(a[1:3], src[1:3]) and torch.equal(b[1:3, 64:128], src[1:3, 64:128])
    with pytest.raises(ValueError, match="another machine must be a contiguous view of a symmetric"):
        comm.get(torch.empty(2, 256), a[1:3], 2, queue="other", what="unregistered")
    comm.get(b[2:4], a[1:3], 2, queue="other", what="registered").wait()
    assert torch.equal(b[2:4], src[1:3])
    assert comm.counter.intra_node_bytes == 4 * 64 * 4  # transfers with myself count no bytes
    assert comm.counter.inter_node_bytes == 2 * 256 * 4 and comm.copies == 1 + 4 + 1


def test_replay_stage_rows_on_cpu(tmp_path, monkeypatch):
    from xfuser_swiftfusion.tools.gpu_suite import replay
    monkeypatch.setattr(kernel, "CPU_MODELS", (kernel.ModelShape("tiny", 24, 32, 32 * 2),))
    replay.replay(RowWriter(str(tmp_path / "r.jsonl"), "replay"), torch.device("cpu"), quick=True)
    rows = read_rows(str(tmp_path / "r.jsonl"))
    assert [r.case.split(": ")[-1] for r in rows] == [
        "USP (xFuser's ring on this rank)", "SGLang's pipelined Ulysses (rank 0 of one machine, U8)",
        "cpu, direct", "cpu, plan", "cpu, plan + CUDA graph", "USP-equivalent single kernel"]
    sglang = rows.pop(1)
    assert sglang.result == "INFO" and sglang.data["stand_in"], sglang
    # 24 heads over U8 x 3 groups, 64 tokens: 8 per rank; one attention call per group
    assert (sglang.data["groups"], sglang.data["S"], sglang.data["launches"]) == (3, 8, 3)
    usp, direct, planned, graphed = rows[0].data, rows[1].data, rows[2].data, rows[3].data
    # the graph row's plan captured and replayed under the capture stand-in: a replay's counts
    assert "capture rules" in graphed["graph"] and graphed["copies"] == planned["copies"] > 0
    assert graphed["attend_calls"] == planned["attend_calls"] and rows[3].result == "INFO"
    assert usp["usp"] and usp["launches"] == usp["R"] == 4  # one attention call per ring block
    assert direct["attend_calls"] > 0 and direct["stand_in"] and not direct["plan"]
    # the plan's launches: one per Torus stage and query entry (T = 4: 10) against one per
    # ring step of the direct layer
    assert planned["plan"] and planned["launch_mode"] == "stage" and planned["launches"] == 10
    # (finalize-only attend calls launch no attention)
    assert direct["launch_mode"] == "ring" and 10 < direct["launches"] <= direct["attend_calls"]
    assert planned["usp_gpu_ms"] == usp["gpu_ms"] and planned["usp_ratio"] > 0
    assert "x the single kernel" in rows[4].figure


# -- the dry run's look-alike: a CUDA build of torch on a machine without a GPU ----------------

def test_xfuser_on_a_cuda_build_of_torch_without_a_gpu_runs_as_on_cpu(monkeypatch):
    """torch 2.11.0+cu130 without a driver (the dry run's look-alike): xFuser's envs say CUDA
    (``torch.version.cuda`` is set) and its runtime state picks cuDNN (``cudnn.is_available()``);
    the compatibility layer makes both what a CPU build of torch gives."""
    from types import ModuleType, SimpleNamespace

    from xfuser.core.distributed.attention_backend import AttentionBackendType

    from xfuser_swiftfusion.integrations.xfuser import compat
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    envs = ModuleType("fake_envs")
    envs._is_cuda = lambda: True  # torch.version.cuda is "13.0"
    compat.patch_envs_cuda_build_without_gpu(envs)
    assert envs._is_cuda() is False

    class RuntimeState:
        def _select_attention_backend(self, engine_config=None):
            return AttentionBackendType.CUDNN  # torch.backends.cudnn.is_available()

    rs = ModuleType("fake_runtime_state")
    rs.RuntimeState, rs.AttentionBackendType = RuntimeState, AttentionBackendType
    compat.patch_runtime_state_backend_selection(rs)
    assert RuntimeState()._select_attention_backend() == AttentionBackendType.SDPA_FLASH
    asked = SimpleNamespace(runtime_config=SimpleNamespace(attention_backend="CUDNN"))
    assert RuntimeState()._select_attention_backend(asked) == AttentionBackendType.CUDNN


# -- the GPU command (docs/gpu-suite.md) ---------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_command() -> str:
    """The block ``scripts/gpu_image_dryrun.sh`` runs: the fenced block after the marker."""
    text = open(os.path.join(REPO, "docs", "gpu-suite.md")).read()
    after = text[text.index("<!-- gpu-command:"):]
    block = after[after.index("```bash\n") + len("```bash\n"):]
    return block[:block.index("```")].rstrip("\n")


def test_the_gpu_command_fits_the_device_tool():
    """The static parts the dry run relies on: under 2,000 characters; the wheels installed with
    --no-index --no-deps --target; the carried cuda-core only where nvshmem.core needs it; the
    NVSHMEM smoke test first, bounded, removing nvshmem4py when it fails; a suite budget ending
    40 s inside the 540 s limit; at most 8 files back, 1 folder down."""
    from xfuser_swiftfusion.tools.gpu_suite import FILES
    cmd = gpu_command()
    assert 0 < len(cmd) < 2000
    stated = re.search(r"this command \((\d+)\s", open(os.path.join(REPO, "docs", "gpu-suite.md")).read())
    assert stated and int(stated.group(1)) == len(cmd), "docs/gpu-suite.md states another length"
    assert "--no-index --no-deps --no-compile --no-cache-dir --target" in cmd
    assert "python3 -c 'import nvshmem.core' 2>>$L || export PYTHONPATH=$S:$C" in cmd
    smoke = cmd.index("nvshmem-smoke")
    assert cmd.index("timeout -k 5 75") < smoke < cmd.index("rm -rf $S/nvshmem $S/nvshmem4py*")
    assert smoke < cmd.index("--gpu-suite") and "--budget $((500-SECONDS))" in cmd
    outputs = set(re.findall(r"\$OUT/[\w./-]*", cmd))
    assert outputs == {"$OUT/setup.log", "$OUT/suite"}
    assert len(FILES) + 1 <= 8  # the suite's files under $OUT/suite, and setup.log
    assert subprocess.run(["bash", "-n", "-c", cmd]).returncode == 0
    for script in ("gpu_image_dryrun.sh", "gpu_wheelhouse.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", script)]).returncode == 0


def test_a_backend_that_raises_in_speed_costs_its_figures_only(tmp_path, monkeypatch):
    real = kernel._kernel_fn

    def kernel_fn(name, qs, kvs, scale):
        if len(qs) > 4:
            raise RuntimeError("cuDNN Frontend error: no valid execution plans")
        return real(name, qs, kvs, scale)

    monkeypatch.setattr(kernel, "_kernel_fn", kernel_fn)
    monkeypatch.setattr(kernel, "CPU_MODELS", kernel.CPU_MODELS[1:])
    kernel.speed(RowWriter(str(tmp_path / "r.jsonl"), "speed"), torch.device("cpu"), quick=True)
    rows = [r for r in read_rows(str(tmp_path / "r.jsonl")) if r.result != "SKIP"]
    # launches of up to 4 Q chunks measured; the others failed
    assert [r.result for r in rows] == ["FAIL" if len(x.q_lens) > 4 else "INFO"
                                        for x in kernel._launches(kernel.CPU_MODELS[0])]
    assert "no valid execution plans" in rows[0].figure


class _FakeGPU:
    """``torch.cuda``'s events and sleep kernel over a clock: the GPU runs queued work in
    order after the sleep; an event completes when the GPU reaches it."""

    def __init__(self, monkeypatch) -> None:
        from xfuser_swiftfusion.tools.gpu_suite import timing
        self.busy_until = 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self, stream=None) -> None:
                self.t = max(time.monotonic(), gpu.busy_until)

            def query(self) -> bool:
                return time.monotonic() >= self.t

            def elapsed_time(self, end) -> float:
                return (end.t - self.t) * 1e3

        def sleep(cycles: int) -> None:
            gpu.busy_until = max(time.monotonic(), gpu.busy_until) + cycles / timing.SLEEP_CYCLES_PER_MS / 1e3

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def queue(self, seconds: float) -> None:
        self.busy_until = max(time.monotonic(), self.busy_until) + seconds


@pytest.mark.parametrize("host_s, gpu_s, waits", [
    (0.002, 0.006, False),  # GPU-bound
    (0.06, 0.003, False),   # a host slower than the first 50 ms sleep (the H100's cudnn layers)
    (None, 0.001, True),    # a call that waits for the GPU
])
def test_host_and_gpu_time_of_a_call_are_told_apart(monkeypatch, host_s, gpu_s, waits):
    """The GPU-only timing of the replay, on a fake GPU: host issue and GPU work apart, and a
    call that waits for the GPU (HostWaits) told from a host that outlasts the first sleep."""
    from xfuser_swiftfusion.tools.gpu_suite import timing
    gpu = _FakeGPU(monkeypatch)

    def layer():
        # None: e.g. .item() inside, the host waits until the GPU is done
        time.sleep(max(0.0, gpu.busy_until - time.monotonic()) if host_s is None else host_s)
        gpu.queue(gpu_s)

    if waits:
        with pytest.raises(timing.HostWaits, match="waits for the GPU"):
            timing.host_and_gpu_ms(layer, torch.device("cuda"), reps=3)
        return
    host, on_gpu = timing.host_and_gpu_ms(layer, torch.device("cuda"), reps=2)
    assert host_s * 1e3 * 0.9 < host < host_s * 1e3 * 1.5 + 3
    assert gpu_s * 1e3 - 0.5 < on_gpu < gpu_s * 1e3 + 0.5


def test_replayed_graph_rows_count_the_copies_of_their_transfers():
    """A plan's CUDA graph replay adds its capture's copies to ``ReplayComm.copies`` as it adds
    bytes (``replay_counts``; on CPU through the capture stand-in)."""
    from xfuser_swiftfusion.emulation import cuda_capture
    from xfuser_swiftfusion.tools.gpu_suite import replay
    cuda_capture.install()
    try:
        r = replay.build_layer(kernel.ModelShape("m", 24, 16, 32 * 4, joint=3), torch.device("cpu"),
                               torch.float32)
        eager = replay._one_layer(r, r.variant(True, "stage", False))
        graphed = r.variant(True, "stage", True)
        for _ in range(3):  # compile, capture, replay
            graphed()
        assert cuda_capture.STATS.replays == 2 and not cuda_capture.STATS.violations
        per_layer = replay._one_layer(r, graphed)
        assert cuda_capture.STATS.replays == 3
        assert per_layer == eager and per_layer["copies"] > 0, (per_layer, eager)
    finally:
        cuda_capture.uninstall()


def test_a_failed_capture_in_the_replay_stage_leaves_the_callers_stream():
    """torch.cuda.graph's __exit__ raises in capture_end before leaving its stream context:
    the replay stage captures inside an outer stream context of its own."""
    from xfuser_swiftfusion.emulation import cuda_capture
    from xfuser_swiftfusion.tools.gpu_suite import replay
    cuda_capture.install()
    try:
        r = replay.build_layer(kernel.ModelShape("m", 24, 16, 32 * 4, joint=3), torch.device("cpu"),
                               torch.float32)

        def syncing():
            out = r()
            torch.cuda.synchronize()  # a host synchronisation: illegal while capturing
            return out
        caller = torch.cuda.Stream()
        with torch.cuda.stream(caller):
            ms, how, diff = replay._graph_ms(syncing, r, quick=True)
            assert ms is None and how.startswith("capture failed: CaptureRuleError") and diff is None
            assert torch.cuda.current_stream() is caller
            assert id(caller) not in cuda_capture.allocator_capturing
    finally:
        cuda_capture.uninstall()


# -- SGLang's pipelined Ulysses (replay row) -----------------------------------------------------

def _sglang_ulysses(U: int, G: int, text: int, H: int = 24, S: int = 5, D: int = 16,
                    streams: bool | None = None):
    from xfuser_swiftfusion.tools.gpu_suite.replay import _usp_op
    from xfuser_swiftfusion.tools.gpu_suite.sglang_ulysses import build_pipelined_ulysses
    g = torch.Generator().manual_seed(U * 10 + G)
    q, k, v = (torch.randn(1, H, S, D, generator=g) for _ in range(3))
    joint = tuple(torch.randn(1, H, text, D, generator=g) for _ in range(3)) if text else None
    layer = build_pipelined_ulysses(q, k, v, joint, U, G, D ** -0.5, _usp_op("cpu"))
    if streams is not None:
        layer = type(layer)(layer.q, layer.k, layer.v, layer.replicated, U, G, layer.scale,
                            layer.op, streams=streams)
    # fp64: this rank's rows (text first) over text + U copies of its shard (on the replay's
    # transport every peer holds what this rank holds), [B, T + S, H, D]
    cat = lambda parts: torch.cat(parts, 2).double()  # noqa: E731
    rows = cat(([joint[0]] if text else []) + [q])
    keys, values = (cat(([joint[i]] if text else []) + [x] * U) for i, x in ((1, k), (2, v)))
    ref = (torch.softmax(rows @ keys.transpose(-1, -2) * D ** -0.5, -1) @ values).transpose(1, 2)
    return layer, ref


@pytest.mark.parametrize("U,G,text", [(8, 3, 0), (4, 2, 3), (2, 3, 4)])
def test_sglang_pipelined_ulysses_equals_fp64_attention(U, G, text):
    """Rank 0's own heads come out of its attention over the slots it filled (its rows, the
    peers' rows, the text first); every peer's head block lands where the peers' blocks go."""
    layer, ref = _sglang_ulysses(U, G, text)
    out = layer()
    assert out.shape == ref.shape
    own = slice(0, G * layer.h)  # rank 0's heads: blocks (0, g)
    assert (out[:, :, own].double() - ref[:, :, own]).abs().max() < 1e-5
    assert torch.count_nonzero(out[:, :, G * layer.h:]) == 0  # no peer has written a block yet
    layer.fill_peer_outputs(ref.float())  # what each peer sends for its heads
    assert (layer().double() - ref).abs().max() < 1e-5


def test_sglang_pipelined_ulysses_sends_each_peer_its_heads_and_rows():
    """What the copy stream and the group streams write to a peer: its head block of this
    rank's shard in its slot, and its rows of this rank's output heads in its block."""
    layer, ref = _sglang_ulysses(4, 2, 3)
    layer()
    h, S, T = layer.h, layer.q.shape[1], layer.T
    for p in (1, 2, 3):
        for g in range(2):
            heads = slice((p * 2 + g) * h, (p * 2 + g + 1) * h)
            for part, x in enumerate((layer.q, layer.k, layer.v)):
                assert torch.equal(layer.peer_slots[p][g][part][:, T:T + S], x[:, :, heads])
            mine = slice(g * h, (g + 1) * h)  # rank 0's heads of group g: rank p's rows of them
            block = layer.peer_out_blocks[p][g]
            assert (block[:, T:].double() - ref[:, T:, mine]).abs().max() < 1e-5  # shard copies
            assert (block[:, :T].double() - ref[:, :T, mine]).abs().max() < 1e-5


def test_sglang_pipelined_ulysses_joins_its_streams(monkeypatch):
    """CUDA graph capture (the GPU suite times the row as a graph) needs the copy stream and
    every group stream joined back into the caller's stream before the call returns."""
    joins = _StreamJoins(monkeypatch)
    layer, _ = _sglang_ulysses(4, 2, 3, streams=True)
    layer()
    streams = [layer.copy_stream, *layer.group_streams]
    assert all(s.records > 0 for s in layer.group_streams)
    assert [(s.records, s.joined) for s in streams if s.joined < s.records] == []
    assert joins.current is joins.origin


@pytest.mark.parametrize("heads,world,rows,sms,want", [
    (24, 8, 36864 + 512, 132, 0),   # Flux 3072 px on one H200 machine: too few tiles per group
    (56, 2, 65536, 132, 7),         # MiniMax-H3's 56 heads at Ulysses 2 (SGLang's example)
    (56, 8, 65536, 132, 0), (48, 8, 17776, None, 3), (40, 2, 8192, None, 5),
    (12, 8, 4096, None, 0)])        # no candidate divides 12 heads over 8 ranks
def test_sglang_automatic_head_groups(heads, world, rows, sms, want):
    """SGLang's ``_auto_pipeline_groups``: the most of 7, 5, 4, 3, 2 dividing the heads by the
    ranks whose calls fill 4 waves of 128-row tiles on the SMs."""
    from xfuser_swiftfusion.tools.gpu_suite.sglang_ulysses import auto_groups
    assert auto_groups(heads, world, 1, rows, sms) == want
