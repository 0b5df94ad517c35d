#!/usr/bin/env bash
# Session 10, call 3 (one H200). The stacked dense LoRA epilogue in the FP8 GEMM (MOELORA_FP8_LORA_STACKED, default
# on) and the high-priority side stream (default since call 2): 1. GPU tests (FP8 epilogue forms, streams);
# 2. bench decode fp8 with the defaults: 128/128 b64/128/256 x 0/4/8 adapters, ctx1024 b64 x 0/4/8; 3. the per-slot
# epilogue (MOELORA_FP8_LORA_STACKED=0) at 128/128 b64/256 x 4/8 for the same-run comparison.
# Files: tests.log, bench.log, vllm/ ctx/ perslot/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py tests/test_streams.py \
    -k "epilogue or side_stream" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128,256 --adapter-counts 0,4,8 \
    --out "$OUT/vllm" > "$OUT/bench.log" 2>&1
timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ctx" >> "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_STACKED=0 timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 \
    --adapter-counts 4,8 --out "$OUT/perslot" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
