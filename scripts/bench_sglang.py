"""SGLang's own USP against our strategies on SGLang's Flux model class, emulated cluster:
``swiftfusion compare --engine sglang`` (``xfuser_swiftfusion/tools/compare_sglang.py``) with
SGLang imported the way the CPU tests import it (``tests/support/sglang_env.py``: a stand-in for
the torchvision the CPU stack cannot load) and the benchmark's defaults.

    python scripts/bench_sglang.py                       # 2x2, 80 Mbit/s, 2048 image tokens
    python scripts/bench_sglang.py --emulate 2x4 --repeats 3 --json out.json

Flags after the defaults override them (any flag of ``swiftfusion compare``); the links need root.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import sglang_env  # noqa: E402

DEFAULTS = ["--emulate", "2x2", "--link-mbit", "80", "--height", "1024", "--width", "512",
            "--max-sequence-length", "64", "--steps", "3", "--repeats", "5"]


def main(argv: list[str]) -> int:
    with warnings.catch_warnings():  # SGLang's quantization modules warn that CPUs lack them
        warnings.simplefilter("ignore")
        reason = sglang_env.sglang()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    from xfuser_swiftfusion.tools.cli import main as swiftfusion
    return swiftfusion(["compare", "--engine", "sglang", *DEFAULTS, *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
