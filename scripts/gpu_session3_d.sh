#!/usr/bin/env bash
# Session 3, device call D (right after C, on the warm machine): bench decode FP8 with rank-64 adapters
# (batch 64 x 0/4/8), then `moelora bench kernels` (the MoE cases now take the fused kernel where the layer does).
# Files: bench_d.log, fp8r64/decode-*.json, kernels-*.json.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout ${T_R64:-95} python3 -m moelora bench decode --out "$OUT/fp8r64" --dtype fp8 --lora-rank 64 --workloads vllm \
    --batches 64 --adapter-counts 0,4,8 2>&1 | tee "$OUT/bench_d.log" | grep -v "^WARN" | tail -5
timeout ${T_KER:-170} python3 -m moelora bench kernels --out "$OUT" 2>&1 | tee -a "$OUT/bench_d.log" | tail -100
