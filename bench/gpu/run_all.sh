#!/bin/bash
# One device call: mma.sync ceiling, config sweep (build report + correctness + timing), table.
# On the lent H200, from the repo root:  bash bench/gpu/run_all.sh   (carry .gpu)
# Env: D128_CONFIGS / D64_CONFIGS (space-separated BLOCK_M,BLOCK_N,WARPS,Q_IN_REGS), AB_CONFIGS,
# SKIP_TABLE=1. Seen: 100 s on a warm H200 (2026-11-29).
set -o pipefail
source .gpu/setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
J=$OUT/results.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv 2>&1
timeout 60 python3 bench/gpu/mma_bench.py peak --json "$J"
for c in ${D128_CONFIGS:-128,64,4,0 128,48,4,0}; do
  timeout 90 python3 bench/gpu/mma_bench.py sweep --d 128 --config "$c" --json "$J" \
    --ptx "$OUT/d128_${c//,/_}.ptx"
done
for c in ${D64_CONFIGS:-128,64,4,1 128,64,4,0}; do
  timeout 90 python3 bench/gpu/mma_bench.py sweep --d 64 --config "$c" --json "$J"
done
# A/B, e.g. AB_CONFIGS="128:128,64,4,0": rescale every tile (RESCALE_THRESH<0: lazy rescaling off)
for dc in ${AB_CONFIGS:-}; do
  MMA_EXTRA="-DRESCALE_THRESH=-1.0f" timeout 90 python3 bench/gpu/mma_bench.py sweep \
    --d "${dc%%:*}" --config "${dc#*:}" --json "$J"
done
if [ -z "$SKIP_TABLE" ]; then
  timeout 300 python3 bench/gpu/mma_bench.py table --sweep "$J" --json "$J" --md "$OUT/table.md"
fi
