#!/usr/bin/env bash
# Session 11, call 6 (one H200), the final code (call 5's best NVFP4 configuration now the default): 1. NVFP4 GPU
# tests on the defaults; 2. bench decode nvfp4 (no override): 128/128 and ctx1024, batch 64/256, 0/4/8 adapters.
# Files: tests.log, bench.log, nvfp4/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py -k nvfp4 \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 280 python3 -m moelora bench decode --dtype nvfp4 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/nvfp4" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|floor" | cut -c1-170
true
