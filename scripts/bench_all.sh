#!/usr/bin/env bash
# Every table and plot of BENCHMARKS.md, back to back (root: throttled links; ~55 min on the
# 2-core development machine). Run from the repository root on a quiet host:
#   scripts/bench_all.sh            # PY=.venv/bin/python by default
# Results are JSON only (benchmarks/results/); plots go to benchmarks/; the targets table
# (docs/benchmark-misses.md) is printed at the end of the layer runs.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SF=$(dirname "$PY")/swiftfusion
R=benchmarks/results
layer() { "$PY" scripts/bench_layer.py --heads 12 --head-dims 64 "$@"; }

# CALIBRATE=0: keep the committed cpu_profile.json (tables then name a clean commit)
[ "${CALIBRATE:-1}" = 0 ] || "$PY" scripts/calibrate_cpu.py --worlds 4,8 --reps 15
layer --topologies 4x1,4x2 --seq 16384 --reps 7 --link-mbit 80 --out $R/layer-A-L16384-80mbit
layer --topologies 4x1,4x2 --seq 16384 --reps 5 --link-mbit 160 --out $R/layer-B-L16384-160mbit
layer --topologies 4x1,4x2 --seq 16384 --reps 5 --link-mbit 2000 --out $R/layer-C-L16384-2000mbit
layer --topologies 2x2,3x2 --seq 16384 --reps 5 --link-mbit 80 --out $R/layer-E-machines-80mbit
layer --topologies 4x2 --seq 16384 --head-dims 32,128 --reps 5 --link-mbit 80 --out $R/layer-E-headdim-80mbit
layer --topologies 4x1,4x2 --seq 4096,8192 --reps 5 --link-mbit 80 --out $R/layer-E-seq-80mbit
layer --topologies 4x1,4x2 --seq 8192 --batches 2,4 --reps 5 --link-mbit 80 --out $R/layer-E-batch-80mbit
layer --topologies 2x2 --seq 16384 --reps 5 --link-mbit 80 --strategies usp,tas,torus,swiftfusion --diffusers --out $R/diffusers-layer-2x2-L16384-80mbit
for mbit in 150 250; do  # one box of PCIe GPUs: 2 islands of 4 (docs/one-box.md)
  "$PY" scripts/bench_layer.py --topologies 2x4 --islands --usp-splits --strategies usp,tas,torus,swiftfusion \
      --kv-pieces 1,2,4 --seq 2048 --heads 8 --head-dims 64 --dtype fp32 --reps 7 --link-mbit $mbit \
      --out $R/layer-box-2x4-$mbit-pieces
done
"$PY" scripts/plot_benchmarks.py $R/layer-A-L16384-80mbit.json $R/layer-B-L16384-160mbit.json \
    $R/layer-C-L16384-2000mbit.json --out benchmarks/layer-A-B-C.png
"$PY" scripts/plot_benchmarks.py $R/layer-E-machines-80mbit.json $R/layer-A-L16384-80mbit.json $R/layer-E-headdim-80mbit.json \
    $R/layer-E-seq-80mbit.json $R/layer-E-batch-80mbit.json --out benchmarks/layer-sweep.png
"$PY" scripts/summarize_benchmarks.py $R/layer-*.json

for model in tiny-flux tiny-cogvideox; do
  for topo in 2x2 4x2; do
    "$SF" compare --model $model --emulate $topo --repeats 5 --steps 3 \
        --json $R/e2e-$model-$topo.json --plot benchmarks/e2e-$model-$topo.png
    "$SF" compare --model $model --emulate $topo --repeats 5 --steps 3 --link-mbit 80 \
        --json $R/e2e-$model-$topo-80mbit.json --plot benchmarks/e2e-$model-$topo-80mbit.png
  done
done

# SGLang's own Flux against SGLang's USP (needs SGLang: scripts/install_sglang_cpu.sh)
"$PY" scripts/bench_sglang.py --json $R/sglang-compare-flux-2x2-80mbit-quiet.json
