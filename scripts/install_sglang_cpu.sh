#!/usr/bin/env bash
# SGLang's diffusion runtime (sglang.multimodal_gen) beside the CPU stack, for the tests:
#   scripts/install_sglang_cpu.sh [python]     (default: .venv/bin/python)
# Every package --no-deps at the pins of constraints-sglang-cpu.txt (~40 MB of wheels): letting pip
# resolve sglang's dependencies pulls a CUDA torch of several GB. torchvision is left out (PyPI's
# does not load beside torch+cpu); the tests stand in for it (tests/support/sglang_env.py).
# GPU machines install the extra instead: pip install "xfuser-swiftfusion[sglang]".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PKGS=$(grep -v '^#' constraints-sglang-cpu.txt | sed 's/==.*//' | tr '\n' ' ')
"$PY" -m pip install -q --no-deps -c constraints-sglang-cpu.txt $PKGS
