#!/usr/bin/env bash
# The GPU command of docs/gpu-suite.md on a CPU look-alike of the lent GPU machine.
#
#   scripts/gpu_image_dryrun.sh            # builds the look-alike once (~5 GB, cached), then runs
#   SF_DRYRUN_DIR=/somewhere scripts/gpu_image_dryrun.sh
#
# The look-alike (cached in $SF_DRYRUN_DIR, default ~/.cache/swiftfusion-gpu-dryrun): a Python
# 3.12 venv with the machine's versions: torch 2.11.0 from PyPI (2.11.0+cu130, the machine's
# build: PyPI has no CPU wheel of torch for Linux and the PyTorch CPU index is not reachable
# here, so the CUDA libraries torch pins come along; without a driver torch runs on the CPU),
# triton 3.6.0, numpy 2.5.2, transformers 5.17.0, accelerate 1.15.0, cuda-bindings 13.0.3 and
# cuda-core 0.3.2 / cuda-pathfinder 1.2.2 (too old for nvshmem4py: the carried ones must take
# over). Then: the wheelhouse (scripts/gpu_wheelhouse.sh), a copy of the working tree as the
# device tool sends it with .whl carried, the command block run verbatim there with a fake
# $OUT (the suite's flags get --allow-cpu, and --quick where the command has none; python3 is
# the look-alike's), and the checks:
# command length, files back under $OUT (count, depth, names), nvshmem.core with and without the
# carried cuda-core, the suite's exit status; last, what the CPU could not check (SKIP rows).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${SF_DRYRUN_DIR:-$HOME/.cache/swiftfusion-gpu-dryrun}
mkdir -p "$cache"
py312=${PYTHON312:-}
if [ -z "$py312" ]; then  # the first Python 3.12 that runs (a pyenv shim may exist and refuse)
    for c in "$(command -v python3.12 || true)" /root/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -n "$c" ] && "$c" -c '' 2>/dev/null; then py312=$c; break; fi
    done
fi
[ -n "$py312" ] || { echo "FAIL: no Python 3.12 found; set PYTHON312"; exit 1; }
venv=$cache/venv-py312-torch2.11.0
image=(torch==2.11.0 triton==3.6.0 numpy==2.5.2 transformers==5.17.0 accelerate==1.15.0
       cuda-bindings==13.0.3 cuda-core==0.3.2 cuda-pathfinder==1.2.2 einops peft pyyaml
       sentencepiece safetensors regex requests pillow filelock psutil wrapt tqdm matplotlib)
say() { printf '\n== %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    say "building the look-alike venv in $venv (once)"
    rm -rf "$venv"
    "$py312" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "${image[@]}"
    touch "$venv/.complete"
fi
"$venv/bin/python" - <<'EOF'
import importlib.metadata as m, platform, torch
names = ("torch", "triton", "numpy", "transformers", "cuda-bindings", "cuda-core", "cuda-pathfinder",
         "nvidia-nvshmem-cu13", "nvidia-cudnn-cu13")
print("look-alike: Python", platform.python_version(), "|", ", ".join(f"{n} {m.version(n)}" for n in names),
      "| torch.cuda.is_available():", torch.cuda.is_available())
EOF

whl=$here/.whl  # what the GPU call carries; built into the cache when there is none
if [ -d "$whl/cuda" ]; then
    say "wheelhouse: $whl (the folder the GPU call carries)"
else
    whl=$cache/whl
    say "wheelhouse: none in $here/.whl; building one in $whl"
    bash "$here/scripts/gpu_wheelhouse.sh" "$whl" >/dev/null 2>&1 || bash "$here/scripts/gpu_wheelhouse.sh" "$whl"
fi
ls "$whl" "$whl/cuda" | sed 's/^/  /'

say "the working tree as the device tool sends it, .whl carried"
run=$(mktemp -d "${TMPDIR:-/tmp}/sf-dryrun-XXXXXX")
trap 'rm -rf "$run"' EXIT
mkdir -p "$run/repo" "$run/out" "$run/tmp"
(cd "$here" && git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents -- {} "$run/repo/" 2>/dev/null || true)
cp -r "$whl" "$run/repo/.whl"
mib=$(du -sm "$run/repo" | cut -f1)
echo "  $(find "$run/repo" -type f | wc -l) files, $mib MiB (limit 64 MiB)"
[ "$mib" -lt 64 ] || { echo "FAIL: the working tree and .whl are over 64 MiB"; exit 1; }

say "the GPU command (docs/gpu-suite.md)"
cmd=$(awk '/<!-- gpu-command:/ {grab=1; next} grab && /^```bash/ {inblock=1; next}
           inblock && /^```/ {exit} inblock {print}' "$here/docs/gpu-suite.md")
chars=$(printf '%s' "$cmd" | wc -c)
echo "  $chars characters (limit 2000)"
[ "$chars" -gt 0 ] && [ "$chars" -lt 2000 ] || { echo "FAIL: the command is empty or too long"; exit 1; }
grep -q -- "--no-index --no-deps" <<<"$cmd" && grep -q -- "--target" <<<"$cmd" \
    || { echo "FAIL: the command does not install with --no-index --no-deps --target"; exit 1; }
dry=${cmd//--gpu-suite/--gpu-suite --allow-cpu}
grep -q -- "--gpu-suite --quick" <<<"$cmd" || dry=${dry//--gpu-suite/--gpu-suite --quick}

say "nvshmem.core with the look-alike's cuda-core, then with the carried one"
probe=$run/probe
"$venv/bin/python" -m pip install -q --no-index --no-deps --target "$probe/site" "$whl"/nvshmem4py*.whl
"$venv/bin/python" -m pip install -q --no-index --no-deps --target "$probe/cuda" "$whl"/cuda/*.whl
if PYTHONPATH=$probe/site "$venv/bin/python" -c 'import nvshmem.core' 2>/dev/null; then
    echo "  imports without the carried cuda-core (this look-alike's is new enough)"
else
    echo "  does not import without it: $(PYTHONPATH=$probe/site "$venv/bin/python" -c 'import nvshmem.core' 2>&1 | tail -1)"
fi
PYTHONPATH=$probe/site:$probe/cuda "$venv/bin/python" -c 'import nvshmem.core, cuda.core; print("  imports with the carried cuda-core", cuda.core.__version__)'

say "running it (fake \$OUT=$run/out)"
start=$(date +%s)
set +e
(cd "$run/repo" && env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    PATH="$venv/bin:$PATH" OUT="$run/out" TMPDIR="$run/tmp" bash -c "$dry")
rc=$?
set -e
echo "  exit status $rc after $(( $(date +%s) - start )) s"

say "files back under \$OUT"
bad=0
files=$(cd "$run/out" && find . -type f | sed 's|^\./||' | sort)
echo "$files" | sed 's/^/  /'
n=$(printf '%s\n' "$files" | grep -c . || true)
[ "$n" -le 8 ] || { echo "FAIL: $n files (at most 8 come back)"; bad=1; }
deep=$(printf '%s\n' "$files" | awk -F/ 'NF > 3' || true)
[ -z "$deep" ] || { echo "FAIL: more than 2 folders down: $deep"; bad=1; }
odd=$(printf '%s\n' "$files" | grep -v -E '^[A-Za-z0-9._/-]+$' || true)
[ -z "$odd" ] || { echo "FAIL: names with other characters: $odd"; bad=1; }
echo "  $n files, deepest $(printf '%s\n' "$files" | awk -F/ '{print NF - 1}' | sort -n | tail -1) folder(s) down"

say "setup.log"
sed 's/^/  /' "$run/out/setup.log" | tail -12

say "what the CPU could not check (SKIP rows)"
"$venv/bin/python" - "$run/out/suite/rows.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in rows:
    if r["result"] == "SKIP":
        print(f"  {r['stage']:<10} {r['case'][:40]:<40} {r['figure'][:150]}")
counts = {k: sum(r["result"] == k for r in rows) for k in ("PASS", "FAIL", "SKIP", "INFO")}
print("  rows:", ", ".join(f"{v} {k}" for k, v in counts.items()))
for r in rows:
    if r["result"] == "FAIL":
        print(f"  FAIL {r['stage']} {r['case']}: {r['figure'][:300]}")
print("  only a GPU exercises too: the GPU timing paths (do_bench, do_bench_cudagraph, the sleep-kernel\n"
      "  host/GPU split, CUDA-graph capture of the replayed layer), the triton kernel compiled, the cudnn,\n"
      "  torch-flash and flash-attn kernels, NVSHMEM (smoke test, nvshmem stage; here the smoke test fails\n"
      "  and nvshmem4py is removed, which is that path's check; pe-strategy's PEs sharing the GPU run here\n"
      "  on the shm heap), xFuser's runner compiled for CUDA graphs,\n"
      "  compute-sanitizer, Nsight Compute, MPS, torchrun over several GPUs")
EOF

if [ "$rc" -ne 0 ] || [ "$bad" -ne 0 ]; then
    echo; echo "gpu image dry run: FAILED (command exit $rc)"; exit 1
fi
echo; echo "gpu image dry run: passed"
