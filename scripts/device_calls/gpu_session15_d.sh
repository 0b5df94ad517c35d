#!/usr/bin/env bash
# Session 15, call 4 (one H200): the final form (LoRA split-K partial over the slot groups up to 64 rows, the GEMM
# launched with PDL after the shrink; call 3: batch 64 4,876 / 4,746 against 4,793 / 4,703 tok/s without PDL).
# (1) The FP8 GPU tests call 3's time limit cut (collection order 60-81: the demo model in FP8 and NVFP4 with
# graphs and adapters, NVFP4 GEMMs, the fast-path experts); (2) bench decode fp8, the whole grid.
# Files: tests.log, bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "demo_model or nvfp4 or fast_path_equal" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 280 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
