"""The quick emulated layer benchmark (issue 6): every strategy on 2x2 and 4x1 against an fp64
reference and its inter-machine bytes against the byte model; no timing. The script itself
exits non-zero on any failing row, so this test fails with it."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_layer.py"


def test_quick_layer_benchmark_equivalence_and_bytes():
    env = dict(os.environ, LOG_LEVEL="warning")
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 2x2") or line.startswith("| 4x1")]
    assert len(rows) >= 2 * 4, res.stdout[-3000:]  # both topologies, every strategy
