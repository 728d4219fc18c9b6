#!/usr/bin/env bash
# Proves that every extra installs from wheels alone: for CPython 3.10-3.13 on Linux x86_64 and
# aarch64 (glibc 2.28, the manylinux level of torch's wheels), pip resolves
# xfuser-swiftfusion[EXTRAS] against the package index with --only-binary=:all:, for that
# platform and Python, without installing anything. Uses the network.
#
#   scripts/check_install.sh                       # every set below, every Python and platform
#   PYTHONS=3.12 ARCHES=x86_64 scripts/check_install.sh
#
# Our package is not on the index: its wheel is built here from the working tree and offered
# with --find-links. The resolution is pip's (`pip install --dry-run --report`, the resolver
# `pip download` uses, reading wheel metadata instead of downloading gigabytes of CUDA wheels).
# For each set it checks: every file is a wheel; torch is a CUDA build (it depends on CUDA
# packages) of the set's CUDA major; nothing of the other CUDA major is pulled in; nvshmem4py
# matches. One line per (Python, platform, set); the exit status is non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHONS="${PYTHONS:-3.10 3.11 3.12 3.13}"
ARCHES="${ARCHES:-x86_64 aarch64}"
# extras set -> CUDA major it must resolve to (the [test] and [tools] extras ride along)
SETS="${SETS:-cu12,tools:12 cu13,tools,test:13 gpu:13}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The index alone: this machine's pip configuration (mirrors, constraints, wheel folders) is
# ignored, and pip is the newest release, in a throwaway venv.
for v in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q -U pip

# our wheel, built from a copy of the working tree (no build/ or egg-info left here)
mkdir -p "$work/src"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$work/src"
"$pip" wheel -q --no-deps "$work/src" -w "$work/dist" >"$work/wheel.log" 2>&1 \
    || { cat "$work/wheel.log"; exit 1; }

echo "# check_install: extras resolved to wheels only"
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- pyproject.toml || echo ' (pyproject.toml modified)')"
echo "command: scripts/check_install.sh (PYTHONS='$PYTHONS' ARCHES='$ARCHES')"
echo "pip: $("$pip" --version | cut -d' ' -f1-2); platform: manylinux_2_28 and older tags"
echo

platforms() {  # every manylinux tag a glibc 2.28 machine of this architecture accepts
    local arch=$1 tags="" i
    for i in $(seq 17 28); do tags="$tags --platform manylinux_2_${i}_$arch"; done
    tags="$tags --platform manylinux2014_$arch"
    if [ "$arch" = x86_64 ]; then
        for i in $(seq 5 16); do tags="$tags --platform manylinux_2_${i}_$arch"; done
        tags="$tags --platform manylinux2010_$arch --platform manylinux1_$arch"
    fi
    echo "$tags"
}

cat > "$work/verdict.py" <<'EOF'
"""One line from a pip --report: OK or FAIL, and why."""
import json
import re
import sys

report, extras, major = sys.argv[1], sys.argv[2], sys.argv[3]
other = {"12": "13", "13": "12"}[major]
pkgs = {i["metadata"]["name"].lower(): i for i in json.load(open(report))["install"]}
ver = {n: i["metadata"]["version"] for n, i in pkgs.items()}
problems = [f"not a wheel: {n}" for n, i in pkgs.items()
            if not i["download_info"]["url"].endswith(".whl")]
torch = pkgs.get("torch")
cuda_deps = [d for d in (torch or {}).get("metadata", {}).get("requires_dist", [])
             if re.match(r"(nvidia-|cuda-)", d) and "extra ==" not in d]
if torch is None:
    problems.append("no torch")
elif not cuda_deps:
    problems.append(f"torch {ver['torch']} is a CPU build")
# the other CUDA major anywhere: nvidia-*-cuXX names, cuda-bindings/cuda-python/cuda-toolkit X.*
for n, v in ver.items():
    if n.endswith(f"-cu{other}") or (n in ("cuda-bindings", "cuda-python", "cuda-toolkit")
                                     and v.split(".")[0] != major):
        problems.append(f"{n} {v} is CUDA {other}")
nvshmem = f"nvshmem4py-cu{major}"
if nvshmem not in ver:
    problems.append(f"no {nvshmem}")
status = "FAIL " + "; ".join(problems) if problems else "OK"
print(f"{len(pkgs):3d} wheels  torch {ver.get('torch', '-'):7s} {nvshmem} {ver.get(nvshmem, '-')}"
      f"  cuda-core {ver.get('cuda-core', '-')}  cuda-bindings {ver.get('cuda-bindings', '-')}"
      f"  {status}")
sys.exit(1 if problems else 0)
EOF

fail=0
printf '%-8s %-8s %-22s %s\n' python platform extras result
for arch in $ARCHES; do
    plats="$(platforms "$arch")"
    for py in $PYTHONS; do
        abi="cp${py/./}"
        for set in $SETS; do
            extras="${set%%:*}" major="${set##*:}"
            rm -f "$work/r.json"
            # shellcheck disable=SC2086  # $plats is a list of flags
            if "$pip" install --dry-run --ignore-installed --quiet --report "$work/r.json" \
                    --only-binary=:all: $plats --python-version "$py" --implementation cp \
                    --abi "$abi" --target "$work/target" --find-links "$work/dist" \
                    "xfuser-swiftfusion[$extras]" >"$work/pip.log" 2>&1; then
                line="$(python3 "$work/verdict.py" "$work/r.json" "$extras" "$major")" || fail=1
            else
                line="FAIL pip: $(grep -m1 ERROR "$work/pip.log" || tail -1 "$work/pip.log")"
                fail=1
            fi
            printf '%-8s %-8s %-22s %s\n' "$abi" "$arch" "[$extras]" "$line"
        done
    done
done

# flash-attn stays outside the extras: the index has no wheel of it (a source build needs torch)
echo
if "$pip" download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --python-version 3.12 --implementation cp --abi cp312 -d "$work/fa" flash-attn \
        >/dev/null 2>&1; then
    echo "flash-attn: a wheel exists on the index now: it could become an extra"
else
    echo "flash-attn: no wheel on the index (optional: pip install flash-attn --no-build-isolation, after torch)"
fi
exit "$fail"
