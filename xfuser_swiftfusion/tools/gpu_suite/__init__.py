"""``swiftfusion check --gpu-suite``: everything GPU-side of this package, on the CUDA machine
it runs on, as one pass/fail table with the figures.

Stages, in this order (each a process of its own under a timeout, so a crash, a hang or a
poisoned CUDA context costs one stage; a global budget skips what no longer fits and cuts a
stage that would run past it: a SKIP row, not a failure):

====================  =================================================================
env                   GPU, driver, CUDA, package versions (cuda-core, cuda-bindings,
                      cuda-pathfinder, nvshmem4py and whether ``nvshmem.core`` imports)
numerics              triton kernel vs fp64 over random chunkings (empty chunks, ragged
                      lengths, state carried across two launches, grouped K/V, NaN-poisoned
                      outputs), D 32/64/128, bf16/fp16, finalize on/off; cuDNN's attention
                      (its LSE) at D 64/128; auto's kernel for other head dims and fp32
speed                 every backend (triton, cudnn, torch flash, flash-attn) on each launch
                      of Flux 3072/4096 px and CogVideoX 5B on 4x8, per ring step and fused
                      (``launches="stage"``): the whole call with its merge (prepared,
                      graph-replayed) against one cuDNN call over the same tokens (and with
                      the fused combine), triton's sm_90 candidates and K/V splits
replay                rank 0's whole swiftfusion layer of those models on this GPU, remote
                      transfers as device copies, beside xFuser's USP on the same rank: per
                      backend, the layer as before execution plans and as plans (per ring
                      step, fused, replayed as a CUDA graph): GPU and host time per layer,
                      attention launches; xFuser's USP-equivalent single kernel
pe-strategy           swiftfusion across 2 and 4 NVSHMEM PEs sharing this GPU (topologies 2x1,
                      4x1; plain, else under a private MPS daemon) vs single-device attention,
                      the model's inter-machine bytes, no fallback; a PE killed mid-layer
                      (``pe_strategy.py``)
nvshmem               the nvshmem communicator: init from the process group, put/get of
                      slices, barriers, team calls, close, a second communicator on the same
                      instance, a timeout that returns
strategies            ``swiftfusion check`` on every visible GPU (torchrun): every strategy vs
                      single-device attention, bf16/fp32, with and without text tokens, one
                      row per strategy
compile               torch.compile around ``ctx.attention``; xFuser's runner with
                      ``--use_torch_compile`` (reduce-overhead: CUDA graphs) on tiny FLUX.1
sanitizer             compute-sanitizer memcheck and racecheck on one launch of each kernel
                      configuration (kernel errors; CUDA API errors torch handles are not)
ncu                   Nsight Compute on the launch of ``speed`` with the most FLOPs
pe-probe              several NVSHMEM PEs on one GPU (raw nvshmem4py), plain and under a
                      private MPS daemon, in what is left of the budget
====================  =================================================================

Output: the table on stdout, and under ``--out`` six files: ``gpu-suite.md`` (table),
``gpu-suite.json`` (rows with every figure), ``rows.jsonl`` (the same, written as the rows
come: what a killed run leaves), ``gpu-suite.log`` (every stage's output), ``ncu.csv`` and
``kernel-table.json`` (the measured kernel choice of this GPU, ``kernels/choice.py``'s format).
Scratch files (the sanitizer's and ncu's inner rows, the MPS daemon's pipes) live in a
temporary folder, removed at the end.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Callable, Iterator, Sequence

from .report import RowWriter, format_table, read_rows, summary

# most telling per second first: under a tight --budget the probe and the slow tools go
STAGES = ("env", "numerics", "speed", "replay", "pe-strategy", "nvshmem", "strategies", "compile",
          "sanitizer", "ncu", "pe-probe")
TIMEOUT_S = {"env": 60, "numerics": 180, "speed": 180, "replay": 240, "pe-strategy": 150,
             "nvshmem": 90, "strategies": 240, "compile": 300, "sanitizer": 300, "ncu": 150,
             "pe-probe": 150}
MIN_STAGE_S = 20  # a stage with less budget left than this is skipped
CUDA_ONLY = ("nvshmem", "pe-probe", "sanitizer", "ncu")
FILES = ("gpu-suite.md", "gpu-suite.json", "rows.jsonl", "gpu-suite.log", "ncu.csv", "kernel-table.json")


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

    def _log(self, text: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(text)

    def run(self, stage: str, cmd: list[str], timeout_s: float, env: dict | None = None,
            case: str = "(stage)", ok: tuple[int, ...] = (0,), record: bool = True
            ) -> tuple[int | None, str]:
        """Run ``cmd`` (at most ``timeout_s``, and no longer than the budget); its output goes to
        the log. Returns (exit status, or None when it was stopped, and the output). With
        ``record``, an exit status not in ``ok`` or the stage's own timeout is a FAIL row with
        the last lines of the output, and a stop at the end of the budget a SKIP row."""
        budget_cut = self.left() < timeout_s
        timeout_s = max(0.0, min(timeout_s, self.left()))
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
        self._log(f"\n===== {stage} {case}: {' '.join(cmd)}\n{output}\n===== exit {rc}, {seconds:.1f} s\n")
        if record and rc not in ok:
            tail = " / ".join(line.strip() for line in output.strip().splitlines()[-3:])
            if rc is None and budget_cut:
                self.add(stage, case, "SKIP", f"budget: stopped after {seconds:.0f} s, at the "
                         f"end of the suite's budget: {tail}"[:400], seconds=seconds, budget=True)
            else:
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
        elif name == "pe-strategy":
            from .pe_strategy import stage
            stage(self, TIMEOUT_S[name])
        elif name == "sanitizer":
            self.sanitizer()
        elif name == "ncu":
            self.ncu()
        else:
            self.run(name, _module(name, self.rows_path, self.quick), TIMEOUT_S[name])

    def pe_probe(self, world: int = 2) -> None:
        """Two raw NVSHMEM PEs on one GPU, then the same under a private MPS daemon; every wait
        (the PEs, the daemon's start and stop) within what is left of the budget."""
        self._probe("2 PEs on one GPU", world, self.env)
        with self.mps("pe-probe", "2 PEs on one GPU under MPS") as env:
            if env is not None:
                self._probe("2 PEs on one GPU under MPS", world, env)

    @contextlib.contextmanager
    def mps(self, stage: str, case: str) -> Iterator[dict | None]:
        """A private CUDA MPS daemon (its pipe and log folders in the scratch folder; the GPU's
        compute mode is never changed) for the body: yields the environment of its clients, or
        None where it cannot run (a ``case`` SKIP row or an ``MPS daemon`` INFO row says why);
        stopped afterwards. Its start and stop wait within what is left of the budget."""
        from .symmetric import mps_available, mps_env
        control = mps_available()
        if control is None:
            self.add(stage, case, "SKIP", "nvidia-cuda-mps-control not found")
            yield None
            return
        if self.left() < MIN_STAGE_S:
            self.add(stage, case, "SKIP", f"budget: {max(0.0, self.left()):.0f} s left")
            yield None
            return
        dirs = mps_env(os.path.join(self.scratch, f"mps-{stage}"))
        env = dict(self.env, **dirs)
        for d in dirs.values():
            os.makedirs(d, exist_ok=True)
        try:
            started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True,
                                     timeout=max(1.0, min(30.0, self.left())))
        except subprocess.TimeoutExpired:
            self.add(stage, "MPS daemon", "INFO", "did not start within the time left")
            self._stop_mps(stage, control, env)
            yield None
            return
        if started.returncode:
            self.add(stage, "MPS daemon", "INFO", f"did not start: {started.stderr.strip()[:200]}")
            yield None
            return
        try:
            yield env
        finally:
            self._stop_mps(stage, control, env)

    def _stop_mps(self, stage: str, control: str, env: dict) -> None:
        timeout_s = max(1.0, min(10.0, self.left()))
        try:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.add(stage, "MPS daemon", "INFO", f"did not answer 'quit' within {timeout_s:.0f} s")

    def _probe(self, label: str, world: int, env: dict) -> None:
        timeout_s = max(1.0, min(60.0, self.left()))
        for r, (rc, _) in enumerate(self.pes("pe-probe", label, world, env, timeout_s=timeout_s)):
            if rc is None:
                self.add("pe-probe", f"{label} (rank {r})", "INFO",
                         f"no answer within {timeout_s:.0f} s (killed)")

    def pe_command(self, stage: str, rank: int, world: int, port: int, label: str,
                   args: Sequence[str] = ()) -> list[str]:
        """The command of one PE process of ``stage``."""
        return _module(stage, self.rows_path, False, "--rank", str(rank), "--world", str(world),
                       "--port", str(port), "--label", label, *args)

    def pes(self, stage: str, label: str, world: int, env: dict, args: Sequence[str] = (),
            timeout_s: float = 60.0, give_up: Callable[[], bool] | None = None,
            grace_s: float = 10.0) -> list[tuple[int | None, str]]:
        """Run ``world`` PE processes of ``stage`` (``pe_command``; a gloo store on a free port)
        for at most ``timeout_s`` and the budget; once ``give_up()`` is true (polled), the PEs
        still running get ``grace_s`` more. PEs still running then are stopped (SIGKILL). Under
        MPS (``env`` names its pipes) every PE gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` =
        100 / ``world`` (summing to at most 100: NVSHMEM's full multi-process-per-GPU mode).
        Every PE's output goes to the log. Returns per rank (exit status, or None where it was
        stopped, and its output)."""
        from ...emulation.launcher import free_port
        port = free_port()
        if "CUDA_MPS_PIPE_DIRECTORY" in env:
            env = dict(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // world))
        name = re.sub(r"[^\w.-]+", "-", f"{stage}-{label}-{world}{''.join(args)}")
        paths = [os.path.join(self.scratch, f"{name}-r{r}.log") for r in range(world)]
        procs = []
        for r, path in enumerate(paths):
            with open(path, "w") as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(self.pe_command(stage, r, world, port, label, args),
                                              env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        start = time.monotonic()
        deadline = stop_at = start + max(0.0, min(timeout_s, self.left()))
        while any(p.poll() is None for p in procs) and time.monotonic() < stop_at:
            if give_up is not None and stop_at == deadline and give_up():
                stop_at = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.1)
        stopped = [p.poll() is None for p in procs]
        for p, stop in zip(procs, stopped):
            if stop:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        results = []
        for r, (p, path, stop) in enumerate(zip(procs, paths, stopped)):
            with open(path) as f:
                output = f.read()
            rc = None if stop else p.returncode
            self._log(f"\n===== {stage} {label} {world} PEs (rank {r}): {' '.join(p.args)}\n{output}\n"
                      f"===== exit {rc}, {time.monotonic() - start:.1f} s\n")
            results.append((rc, output))
        return results

    def _sm(self) -> int:
        """The GPU's SM version from the env stage's row (0 when unknown)."""
        gpu = [r for r in read_rows(self.rows_path) if r.stage == "env" and r.case == "gpu"]
        return int(gpu[-1].data.get("sm", 0)) if gpu else 0

    def sanitizer(self) -> None:
        from .tools import (SANITIZER_TOOLS, find, racecheck_is_information, sanitizer_command,
                            sanitizer_errors)
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
                continue  # a FAIL or SKIP row says why
            errors = sanitizer_errors(output)
            launches = read_rows(inner)
            bad = [r.case for r in launches if r.result not in ("PASS", "SKIP")]
            if errors is None:
                self.add("sanitizer", tool, "FAIL", "no summary line in its output (gpu-suite.log)")
                continue
            figure = (f"{errors} kernel errors over {len(launches)} launches"
                      + (f"; wrong results: {', '.join(bad)}" if bad else ""))
            passed = errors == 0 and launches and not bad
            if not passed and not bad and tool == "racecheck" and racecheck_is_information(self._sm()):
                self.add("sanitizer", tool, "INFO", figure + " (information on sm_90 and newer, "
                         "where the kernel's pipelined loads are asynchronous copies: read the "
                         "hazards in gpu-suite.log)", errors=errors, launches=[r.case for r in launches])
                continue
            self.add("sanitizer", tool, "PASS" if passed else "FAIL", figure, errors=errors,
                     launches=[r.case for r in launches])

    def ncu(self) -> None:
        from .tools import NCU_SUMMARY, find, ncu_command, ncu_metrics
        exe = find("ncu")
        if exe is None:
            self.add("ncu", "(stage)", "SKIP", "ncu not found")
            return
        speed = [r for r in read_rows(self.rows_path) if r.stage == "speed" and "flops" in r.data
                 and not r.data.get("stand_in")]
        if not speed:
            self.add("ncu", "(stage)", "SKIP", "no speed rows to pick the launch from")
            return
        largest = max(speed, key=lambda r: r.data["flops"])
        program = _module("one-launch", os.path.join(self.scratch, "one-launch.jsonl"), False,
                          "--launch", json.dumps(largest.data["launch"]))
        rc, output = self.run("ncu", ncu_command(exe, program, True), TIMEOUT_S["ncu"] / 2,
                              case="pipes", record=False)  # pipe metric names differ by GPU
        metrics = ncu_metrics(output) if rc == 0 else {}
        note = ""
        if not metrics:
            note = "; pipe metrics not available here (gpu-suite.log)"
            rc, output = self.run("ncu", ncu_command(exe, program, False), TIMEOUT_S["ncu"] / 2,
                                  case="sections")
            metrics = ncu_metrics(output) if rc == 0 else {}
            if rc == 0 and not metrics:
                self.add("ncu", largest.case, "FAIL", "no metrics in ncu's output (gpu-suite.log)")
        if not metrics:
            return
        with open(os.path.join(self.out, "ncu.csv"), "w") as f:
            f.write(output[output.find('"ID"'):])
        shown = {k: metrics[k] for k in NCU_SUMMARY if k in metrics}
        pipes = {k.split("__")[1].split(".")[0]: v for k, v in metrics.items() if k.startswith("sm__pipe")}
        self.add("ncu", largest.case, "INFO", "; ".join(f"{k} {v}" for k, v in {**shown, **pipes}.items())
                 + note, metrics=metrics)


def write_kernel_table(rows: list, path: str) -> bool:
    """``kernel-table.json`` from the speed stage's rows: per architecture and shape, the
    backends ordered by their summed ``attend`` time over the launches (``choice.py``'s
    format). Returns whether there was anything to write."""
    from ...kernels.choice import table_document
    entries: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        if r.stage != "speed" or "attend_ms" not in r.data:
            continue
        shape = entries.setdefault(r.data["arch"], {}).setdefault(r.data["shape"], {})
        for name, ms in r.data["attend_ms"].items():
            shape[name] = shape.get(name, 0.0) + ms
    if not entries:
        return False
    doc = None
    for arch, shapes in entries.items():
        one = table_document(arch, shapes, "swiftfusion check --gpu-suite, speed stage: attend "
                             "milliseconds summed over the Torus launches of each shape")
        doc = one if doc is None else {**doc, "archs": {**doc["archs"], **one["archs"]}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return True


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
    for name in FILES:
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
            try:
                suite.stage(name)
            except Exception as exc:  # noqa: BLE001  (one stage's error costs that stage only)
                suite.add(name, "(stage)", "FAIL", f"{type(exc).__name__}: {exc}"[:400])
            new = read_rows(suite.rows_path)[before:]
            print(f"[{i}/{len(stages)}] {name:<10} {time.monotonic() - start:6.1f} s  {summary(new)}",
                  flush=True)
    finally:
        suite.close()
        rows = read_rows(suite.rows_path)
        write_kernel_table(rows, os.path.join(out, "kernel-table.json"))
        table = format_table(rows)
        with open(os.path.join(out, "gpu-suite.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out, "gpu-suite.json"), "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1, default=str)
    print(table)
    print(f"gpu suite: {summary(rows)}; files in {out}")
    return 1 if any(r.result == "FAIL" for r in rows) else 0
