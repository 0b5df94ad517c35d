#!/usr/bin/env bash
# Session 11, call 3 (one H200): the NVFP4 GEMM kernel rewritten (call 2 measured NVFP4 decode at 228 tok/s, b64).
# 1. NVFP4 GPU tests; 2. scripts/bench_nvfp4_gemm.py (new kernel's configurations vs the old one, per GEMM, beside
# the byte floor); 3. bench decode nvfp4 b64/128, 0/4 adapters, with a profile of 2 steps. Files: tests.log,
# gemm.log gemm.json, bench.log, nvfp4/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py -k nvfp4 \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 200 python3 scripts/bench_nvfp4_gemm.py "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
grep -v "^WARN" "$OUT/gemm.log" | tail -16 | cut -c1-200
timeout 200 python3 -m moelora bench decode --dtype nvfp4 --workloads vllm --batches 64,128 --adapter-counts 0,4 \
    --profile-steps 2 --out "$OUT/nvfp4" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|^ +[0-9.]+ ms|%" | cut -c1-160 | head -60
true
