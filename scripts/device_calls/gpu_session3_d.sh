#!/usr/bin/env bash
# Session 3, device call D: bench decode FP8 (vLLM workload; batch 64/128 x 0/4/8/32 rank-16 adapters, then
# batch 64 x 0/4/8 rank-64 adapters), then `moelora bench kernels` (MoE cases take the layer's fused dispatch).
# Files: bench_d.log, fp8/decode-*.json, fp8r64/decode-*.json, kernels-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
B="python3 -m moelora bench decode"
timeout ${T_FP8:-170} $B --out "$OUT/fp8" --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8,32 \
    2>&1 | tee "$OUT/bench_d.log" | grep -v "^WARN" | tail -11
timeout ${T_R64:-110} $B --out "$OUT/fp8r64" --dtype fp8 --lora-rank 64 --workloads vllm \
    --batches 64 --adapter-counts 0,4,8 2>&1 | tee -a "$OUT/bench_d.log" | grep -v "^WARN" | tail -5
timeout ${T_KER:-220} python3 -m moelora bench kernels --out "$OUT" 2>&1 | tee -a "$OUT/bench_d.log" | tail -100
