"""``swiftfusion check --gpu-suite``: everything GPU-side of this package, on the CUDA machine
it runs on, as one pass/fail table with the figures.

Stages, in this order (each a process of its own under a timeout, so a crash, a hang or a
poisoned CUDA context costs one stage; a global budget skips what no longer fits):

====================  =================================================================
env                   GPU, driver, CUDA, package versions
numerics              triton kernel vs fp64 over random chunkings (empty chunks, ragged
                      lengths, state carried across two launches, grouped K/V, NaN-poisoned
                      outputs), D 32/64/128, bf16/fp16, finalize on/off; auto's kernel for
                      other head dims and fp32
speed                 TFLOP/s of the Torus launches (Flux 3072/4096 px, CogVideoX 5B on 4x8)
                      next to torch's flash attention (and flash-attn where installed)
nvshmem               the nvshmem communicator: init from the process group, put/get of
                      slices, barriers, team calls, close, init again, a timeout that returns
strategies            ``swiftfusion check`` on every visible GPU (torchrun): every strategy vs
                      single-device attention, bf16/fp32, with and without text tokens
ncu                   Nsight Compute on the slowest launch of ``speed``
sanitizer             compute-sanitizer memcheck and racecheck on one launch of each kernel
                      configuration
compile               torch.compile around ``ctx.attention``; xFuser's runner with
                      ``--use_torch_compile`` (reduce-overhead: CUDA graphs) on tiny FLUX.1
pe-probe              several NVSHMEM PEs on one GPU (raw nvshmem4py), plain and under MPS
====================  =================================================================

Output: the table on stdout, and under ``--out`` five files: ``gpu-suite.md`` (table),
``gpu-suite.json`` (rows with every figure), ``rows.jsonl`` (the same, written as the rows
come: what a killed run leaves), ``gpu-suite.log`` (every stage's output), ``ncu.csv``.
Scratch files (the sanitizer's and ncu's inner rows, the MPS daemon's pipes) live in a
temporary folder, removed at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from .report import RowWriter, format_table, read_rows, summary

# most telling per second first: under a tight --budget the probe and the slow compiles go
STAGES = ("env", "numerics", "speed", "nvshmem", "strategies", "ncu", "sanitizer", "compile",
          "pe-probe")
TIMEOUT_S = {"env": 60, "numerics": 180, "strategies": 240, "nvshmem": 90, "pe-probe": 150,
             "compile": 300, "speed": 180, "sanitizer": 300, "ncu": 150}
MIN_STAGE_S = 20  # a stage with less budget left than this is skipped
CUDA_ONLY = ("nvshmem", "pe-probe", "speed", "sanitizer", "ncu")


def _module(stage: str, rows: str, quick: bool, *extra: str) -> list[str]:
    return [sys.executable, "-m", "xfuser_swiftfusion.tools.gpu_suite", stage, "--rows", rows,
            *(["--quick"] if quick else []), *extra]


class Suite:
    """Runs the stages; collects rows in ``out/rows.jsonl``."""

    def __init__(self, out: str, quick: bool, budget_s: float, cuda: bool, gpus: int) -> None:
        self.out, self.quick, self.cuda, self.gpus = out, quick, cuda, gpus
        self.deadline = time.monotonic() + budget_s
        self.scratch = tempfile.mkdtemp(prefix="sf-gpu-suite-")
        self.rows_path = os.path.join(out, "rows.jsonl")
        self.log_path = os.path.join(out, "gpu-suite.log")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not cuda:  # the triton kernel runs in its interpreter on CPU tensors
            self.env["TRITON_INTERPRET"] = "1"

    def close(self) -> None:
        """Remove the scratch folder."""
        shutil.rmtree(self.scratch, ignore_errors=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, stage: str, case: str, result: str, figure: str, **data) -> None:
        RowWriter(self.rows_path, stage).add(case, result, figure, **data)

    def run(self, stage: str, cmd: list[str], timeout_s: float, env: dict | None = None,
            case: str = "(stage)", ok: tuple[int, ...] = (0,)) -> tuple[int | None, str]:
        """Run ``cmd``; its output goes to the log. A timeout or an exit status not in ``ok``
        is a FAIL row with the last lines of the output. Returns (exit status or None, output)."""
        timeout_s = min(timeout_s, self.left())
        start = time.monotonic()
        # a session of its own: a timeout ends the stage's children too (torchrun's workers)
        proc = subprocess.Popen(cmd, env=env or self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            rc = None
        seconds = time.monotonic() - start
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {stage} {case}: {' '.join(cmd)}\n{output}\n===== exit {rc}, "
                      f"{seconds:.1f} s\n")
        if rc not in ok:
            tail = " / ".join(line.strip() for line in output.strip().splitlines()[-3:])
            what = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit {rc}"
            self.add(stage, case, "FAIL", f"{what}: {tail}"[:400], seconds=seconds)
        return rc, output

    # -- the stages ------------------------------------------------------------------------

    def stage(self, name: str) -> None:
        if name in CUDA_ONLY and not self.cuda:
            self.add(name, "(stage)", "SKIP", "needs a CUDA device")
            return
        if name == "strategies" and self.gpus > 1:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={self.gpus}"]
            self.run(name, torchrun + _module(name, self.rows_path, self.quick)[1:], TIMEOUT_S[name])
        elif name == "pe-probe":
            self.pe_probe()
        elif name == "sanitizer":
            self.sanitizer()
        elif name == "ncu":
            self.ncu()
        else:
            self.run(name, _module(name, self.rows_path, self.quick), TIMEOUT_S[name])

    def pe_probe(self, world: int = 2) -> None:
        from .symmetric import mps_available, mps_env
        self._probe("2 PEs on one GPU", world, self.env)
        control = mps_available()
        if control is None:
            self.add("pe-probe", "2 PEs on one GPU under MPS", "SKIP",
                     "nvidia-cuda-mps-control not found")
            return
        root = os.path.join(self.scratch, "mps")
        env = dict(self.env, **mps_env(root))
        for d in mps_env(root).values():
            os.makedirs(d, exist_ok=True)
        started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
        if started.returncode:
            self.add("pe-probe", "MPS daemon", "INFO", f"did not start: {started.stderr.strip()[:200]}")
            return
        try:
            self._probe("2 PEs on one GPU under MPS", world, env)
        finally:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=30)

    def _probe(self, label: str, world: int, env: dict) -> None:
        from ...emulation.launcher import free_port
        port = free_port()
        timeout_s = min(60.0, self.left())
        with open(self.log_path, "a") as log:
            log.write(f"\n===== pe-probe {label}\n")
            log.flush()
            procs = [subprocess.Popen(_module("pe-probe", self.rows_path, False, "--rank", str(r),
                                              "--world", str(world), "--port", str(port),
                                              "--label", label),
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
                     for r in range(world)]
            deadline = time.monotonic() + timeout_s
            for r, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    self.add("pe-probe", f"{label} (rank {r})", "INFO",
                             f"no answer within {timeout_s:.0f} s (killed)")

    def sanitizer(self) -> None:
        from .tools import SANITIZER_TOOLS, find, sanitizer_command, sanitizer_errors
        exe = find("compute-sanitizer")
        if exe is None:
            self.add("sanitizer", "(stage)", "SKIP", "compute-sanitizer not found")
            return
        for tool in SANITIZER_TOOLS:
            inner = os.path.join(self.scratch, f"launches-{tool}.jsonl")
            env = dict(self.env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # every tensor its own allocation
            rc, output = self.run("sanitizer", sanitizer_command(exe, tool, _module("launches", inner, False)),
                                  TIMEOUT_S["sanitizer"] / len(SANITIZER_TOOLS), env=env, case=tool,
                                  ok=(0, 9))  # 9: the tool found errors (--error-exitcode)
            if rc not in (0, 9):
                continue  # a FAIL row says why
            errors = sanitizer_errors(output)
            launches = read_rows(inner)
            bad = [r.case for r in launches if r.result != "PASS"]
            if errors is None:
                self.add("sanitizer", tool, "FAIL", "no summary line in its output (gpu-suite.log)")
                continue
            self.add("sanitizer", tool, "PASS" if errors == 0 and rc == 0 and launches and not bad else "FAIL",
                     f"{errors} errors over {len(launches)} launches"
                     + (f"; wrong results: {', '.join(bad)}" if bad else ""),
                     errors=errors, launches=[r.case for r in launches])

    def ncu(self) -> None:
        from .tools import find, ncu_command, ncu_metrics, NCU_SUMMARY
        exe = find("ncu")
        if exe is None:
            self.add("ncu", "(stage)", "SKIP", "ncu not found")
            return
        speed = [r for r in read_rows(self.rows_path) if r.stage == "speed" and "tflops" in r.data]
        if not speed:
            self.add("ncu", "(stage)", "SKIP", "no speed rows to pick the slowest launch from")
            return
        slowest = min(speed, key=lambda r: r.data["tflops"]["triton"])
        program = _module("one-launch", os.path.join(self.scratch, "one-launch.jsonl"), False,
                          "--launch", json.dumps(slowest.data["launch"]))
        metrics: dict[str, str] = {}
        for pipes in (True, False):  # the pipe metrics' names may not exist on this GPU
            rc, output = self.run("ncu", ncu_command(exe, program, pipes), TIMEOUT_S["ncu"] / 2,
                                  case="pipes" if pipes else "sections")
            metrics = ncu_metrics(output)
            if rc == 0 and metrics:
                with open(os.path.join(self.out, "ncu.csv"), "w") as f:
                    f.write(output[output.find('"ID"'):])
                break
        if not metrics:
            return
        shown = {k: metrics[k] for k in NCU_SUMMARY if k in metrics}
        pipes = {k.split("__")[1].split(".")[0]: v for k, v in metrics.items() if k.startswith("sm__pipe")}
        self.add("ncu", slowest.case, "INFO", "; ".join(f"{k} {v}" for k, v in {**shown, **pipes}.items()),
                 metrics=metrics)


def run_suite(out: str, stages: tuple[str, ...] = STAGES, quick: bool = False,
              budget_s: float = 540.0, allow_cpu: bool = False) -> int:
    """Run ``stages``; print and write the table. Returns 0 when no row failed, 1 otherwise,
    2 when there is no CUDA device and ``allow_cpu`` is not set."""
    import torch
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        print("error: the GPU suite needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"error: unknown stage {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    for name in ("rows.jsonl", "gpu-suite.log"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    suite = Suite(out, quick, budget_s, cuda, torch.cuda.device_count() if cuda else 1)
    try:
        for i, name in enumerate(stages, 1):
            if suite.left() < MIN_STAGE_S:
                suite.add(name, "(stage)", "SKIP", f"budget: {max(0.0, suite.left()):.0f} s left")
                continue
            start = time.monotonic()
            before = len(read_rows(suite.rows_path))
            suite.stage(name)
            new = read_rows(suite.rows_path)[before:]
            print(f"[{i}/{len(stages)}] {name:<10} {time.monotonic() - start:6.1f} s  {summary(new)}",
                  flush=True)
    finally:
        suite.close()
    rows = read_rows(suite.rows_path)
    table = format_table(rows)
    with open(os.path.join(out, "gpu-suite.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "gpu-suite.json"), "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1, default=str)
    print(table)
    print(f"gpu suite: {summary(rows)}; files in {out}")
    return 1 if any(r.result == "FAIL" for r in rows) else 0
