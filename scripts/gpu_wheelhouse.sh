#!/usr/bin/env bash
# Wheels for a CUDA machine that has PyTorch, Triton, transformers, the NVIDIA NVSHMEM library
# (nvidia-nvshmem-cu13) and cuda-bindings but no package index (an air-gapped cluster node, the
# lent GPU box: Python 3.12, torch 2.11.0+cu130, triton 3.6.0, numpy 2.5): this package and
# what it needs besides those, for CPython 3.12 on x86-64 Linux by default (~20 MB).
#
#   scripts/gpu_wheelhouse.sh .whl            # here, with network
#
# DEST/*.whl: this package, xfuser 0.7.0, yunchang 0.6.4, diffusers 0.42.1, nvshmem4py-cu13
# 0.4.1, distvae, beautifulsoup4, soupsieve. DEST/cuda/*.whl: cuda-core and cuda-pathfinder,
# which `import nvshmem.core` needs (cuda.core >= 0.5, cuda.pathfinder >= 1.2.3): installed to
# a folder of their own and put on the path only where the machine's own are missing or too
# old (the GPU command in docs/gpu-suite.md does that).
# Not carried: nvidia-nvshmem-cu13 (torch preloads the libnvshmem it finds on sys.path: a
# second copy would shadow the one torch was built with), cuda-python (an empty meta-package
# under --no-deps) and PyAV (35 MB, only xFuser's video writer imports it).
# --no-deps everywhere: the versions are the ones constraints-cpu.txt pins and xFuser 0.7.0
# imports; with --target the .pth autoload hook is not processed: the suite and the examples
# install the plugin themselves.
set -euo pipefail
dest=${1:?usage: scripts/gpu_wheelhouse.sh DEST [PYTHON_VERSION]}
py=${2:-3.12}
here=$(cd "$(dirname "$0")/.." && pwd)
pip=(python3 -m pip)
[ -x "$here/.venv/bin/python" ] && pip=("$here/.venv/bin/python" -m pip)
mkdir -p "$dest/cuda"
rm -f "$dest"/xfuser_swiftfusion-*.whl
"${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$dest" "$here"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
download=("${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py"
          --implementation cp "${platforms[@]}")
"${download[@]}" -d "$dest" xfuser==0.7.0 yunchang==0.6.4 diffusers==0.42.1 nvshmem4py-cu13==0.4.1 \
    distvae==0.1.0 beautifulsoup4 soupsieve
"${download[@]}" -d "$dest/cuda" cuda-core==1.2.2 cuda-pathfinder==1.9.1
rm -f "$dest"/cuda_python-*.whl "$dest"/nvidia_nvshmem*.whl
ls -la "$dest" "$dest/cuda"
du -sh "$dest"
