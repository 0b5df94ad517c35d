#!/usr/bin/env bash
# Session 10, call 4 (one H200): the final code (side stream at high priority, per-slot dense epilogue).
# 1. GPU tests: FP8 LoRA paths, side stream, grouped kernel; 2. bench decode fp8: 128/128 b64/128/256 x 0/4/8 adapters,
# ctx1024 b64 x 0/4/8, rank 64 b64/256 x 0/4, 32 adapters b64/256. Files: tests.log, bench.log, vllm/ ctx/ r64/ a32/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py tests/test_streams.py \
    tests/test_kernels_moe_lora_grouped.py -k "lora or epilogue or side_stream or grouped" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128,256 --adapter-counts 0,4,8 \
    --out "$OUT/vllm" > "$OUT/bench.log" 2>&1
timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ctx" >> "$OUT/bench.log" 2>&1
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4 \
    --lora-rank 64 --out "$OUT/r64" >> "$OUT/bench.log" 2>&1
timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 32 \
    --out "$OUT/a32" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
