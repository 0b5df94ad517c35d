#!/usr/bin/env bash
# Session 11, call 4 (one H200): the NVFP4 kernel's decode modes (0 fp32 scale, 1 bf16, 2 inline PTX) and dense
# split-K. 1. NVFP4 GPU tests (every decode mode and split); 2. scripts/bench_nvfp4_gemm.py sweep -> best.json;
# 3. bench decode nvfp4 b64/128, 0/4 adapters with MOELORA_NVFP4_GEMM_CONFIG = best.json.
# Files: tests.log, gemm.log gemm.json best.json, bench.log, nvfp4/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py -k nvfp4 \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
timeout 260 python3 scripts/bench_nvfp4_gemm.py "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
grep -v "^WARN" "$OUT/gemm.log" | tail -22 | cut -c1-250
if [ -s "$OUT/best.json" ]; then
  MOELORA_NVFP4_GEMM_CONFIG="$(cat "$OUT/best.json")" timeout 160 python3 -m moelora bench decode --dtype nvfp4 \
      --workloads vllm --batches 64,128 --adapter-counts 0,4 --out "$OUT/nvfp4" > "$OUT/bench.log" 2>&1
  grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
fi
true
