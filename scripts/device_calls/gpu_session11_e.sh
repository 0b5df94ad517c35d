#!/usr/bin/env bash
# Session 11, call 5 (one H200): NVFP4 experts on the Triton fast path (TritonExperts: alignment shared, token rows
# read in place, SiLU-and-mul / combine kernels), _ExpertGemm's sort made lazily. 1. tests/test_fp8_gpu.py (all:
# FP8 paths touched by the lazy sort, NVFP4 layer tests now on the fast path); 2. the GEMM sweep timed in CUDA graphs
# (dense weights rotated out of L2) -> best.json; 3. bench decode nvfp4 b64/128, 0/4/8 adapters with best.json.
# Files: tests.log, gemm.log gemm.json best.json, bench.log, nvfp4/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 170 python3 scripts/bench_nvfp4_gemm.py "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
grep -v "^WARN" "$OUT/gemm.log" | tail -22 | cut -c1-250
[ -s "$OUT/best.json" ] || echo '{}' > "$OUT/best.json"
MOELORA_NVFP4_GEMM_CONFIG="$(cat "$OUT/best.json")" timeout 170 python3 -m moelora bench decode --dtype nvfp4 \
    --workloads vllm --batches 64,128 --adapter-counts 0,4,8 --out "$OUT/nvfp4" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
