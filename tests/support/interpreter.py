"""Triton interpreter cases in a subprocess: ``TRITON_INTERPRET=1`` is read when triton.jit
decorates a kernel, so a test module runs its own cases in a fresh interpreter (itself, as
``__main__``) and reads one JSON line ``{"case": name, "result": "ok" | error}`` per case."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cases_in_subprocess(test_file: str, timeout_s: float = 900) -> dict[str, str]:
    """Run ``test_file`` as a script under the interpreter; case name -> result
    (``"__subprocess__"``: the script itself failed)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([TESTS, os.path.dirname(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case"]] = record["result"]
    if proc.returncode != 0:
        results["__subprocess__"] = f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return results


def report(cases: dict) -> None:
    """In the subprocess: run every ``name -> callable`` case with the Triton backend on CPU
    tensors and print its result line."""
    from xfuser_swiftfusion.kernels import current_backend, set_backend

    set_backend("triton")
    assert current_backend(torch.device("cpu")) == "triton"
    for name, case in cases.items():
        try:
            case()
            result = "ok"
        except Exception as e:  # reported to the parent test, which fails on it
            result = f"{type(e).__name__}: {e}"
        print(json.dumps({"case": name, "result": result}), flush=True)
