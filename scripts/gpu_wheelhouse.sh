#!/usr/bin/env bash
# Wheels for a CUDA machine that has PyTorch, Triton, transformers and the NVIDIA NVSHMEM
# library but no package index (an air-gapped cluster node, a lent GPU box): this package and
# what it needs besides those, for CPython 3.12 on x86-64 Linux by default.
#
#   scripts/gpu_wheelhouse.sh .whl            # here, with network (~13 MB)
#   # there, in a clone of this repository with .whl beside it:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 -m xfuser_swiftfusion check --gpu-suite --quick --out gpu-suite
#
# --no-deps everywhere: the versions are the ones constraints-cpu.txt pins and xFuser 0.7.0
# imports (distvae, beautifulsoup4); PyAV (35 MB, only xFuser's video writer imports it) is
# left out. With --target the .pth autoload hook is not processed; the suite and the examples
# install the plugin themselves.
set -euo pipefail
dest=${1:?usage: scripts/gpu_wheelhouse.sh DEST [PYTHON_VERSION]}
py=${2:-3.12}
here=$(cd "$(dirname "$0")/.." && pwd)
pip=(python3 -m pip)
[ -x "$here/.venv/bin/python" ] && pip=("$here/.venv/bin/python" -m pip)
mkdir -p "$dest"
"${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$dest" "$here"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$dest" \
    xfuser==0.7.0 yunchang==0.6.4 diffusers==0.42.1 nvshmem4py-cu13==0.4.1 distvae==0.1.0 \
    beautifulsoup4 soupsieve cuda-python
ls -la "$dest"
du -sh "$dest"
