"""The README's CPU example commands, run as a user runs them: each prints its result, and no
line twice (no per-rank warnings, no setup notices: the output is the result)."""
import collections
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"^(epoch time: .* memory: .* GB|latency: .* s \(.*\))$")


def readme_example_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if re.match(r"^(\.venv/bin/)?python examples/\S+\.py", line)]


def readable_lines(output: str) -> list[str]:
    """What a person reads: output lines without the progress bar's redraws."""
    return [line for line in output.split("\n")
            if line.strip() and "\r" not in line and not re.search(r"\d+%\|", line)]


def test_the_readme_has_cpu_examples():
    assert len(readme_example_commands()) >= 3


@pytest.mark.parametrize("command", readme_example_commands())
def test_readme_example_prints_its_result_without_repeats(command):
    argv = shlex.split(command)
    argv[0] = sys.executable
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = readable_lines(res.stdout + res.stderr)
    assert res.returncode == 0, "\n".join(lines[-40:])
    assert any(RESULT.match(line) for line in lines), "\n".join(lines)
    repeated = {line: n for line, n in collections.Counter(lines).items() if n > 1}
    assert not repeated, f"repeated lines: {repeated}"
    assert not [line for line in lines if re.search(r"warn", line, re.I)], "\n".join(lines)
    assert len(lines) <= 6, "\n".join(lines)


def test_the_check_can_fail():
    noisy = ("WARNING 11-27 [runtime_state.py:139] Using SDPA_FLASH as attention backend.\n" * 4
             + "flux swiftfusion:  50%|#####     | 2/4\rflux swiftfusion: 100%|##########| 4/4\n"
             + "epoch time: 0.86 sec, parameter memory: 0.37 GB, memory: 0.45 GB\n")
    lines = readable_lines(noisy)
    assert lines.count(lines[0]) == 4 and RESULT.match(lines[-1])
