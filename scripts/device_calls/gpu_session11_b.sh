#!/usr/bin/env bash
# Session 11, call 2 (one H200). 1. The epilogue GPU tests, rewritten after call 1 (one projection at a time within
# bf16 rounding; the whole layer against fp32 on the dequantized weights, the epilogue path's error no larger than
# the default path's). 2. bench decode fp8 128/128 b64/128: defaults with 0/4/8 adapters, then
# MOELORA_FP8_MOE_LORA_EPILOGUE=1 with 4/8 (same run). 3. NVFP4 decode b64, 0/4 adapters (never measured).
# Files: tests.log, bench.log, default/ epilogue/ nvfp4/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_moe_lora_epilogue.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8 \
    --out "$OUT/default" > "$OUT/bench.log" 2>&1
MOELORA_FP8_MOE_LORA_EPILOGUE=1 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,128 --adapter-counts 4,8 --out "$OUT/epilogue" >> "$OUT/bench.log" 2>&1
timeout 120 python3 -m moelora bench decode --dtype nvfp4 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --out "$OUT/nvfp4" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
