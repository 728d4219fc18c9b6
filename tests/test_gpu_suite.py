"""``swiftfusion check --gpu-suite`` on CPU: the harness (stages as processes, rows, table,
timeouts and crashes as FAIL rows), the kernel checks under the triton interpreter, that they
fail on wrong or unwritten outputs, the fp64 reference against ``support.reference``, the
Torus launch shapes against the launches the strategy makes, and the report parsers for
compute-sanitizer and Nsight Compute. What needs a GPU (speed, sanitizer, ncu, NVSHMEM) runs
only there: ``skip`` rows here."""
from __future__ import annotations

import json
import os
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
    assert {(r.stage, r.result) for r in rows if r.stage in ("speed", "nvshmem")} == {
        ("speed", "SKIP"), ("nvshmem", "SKIP")}
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
