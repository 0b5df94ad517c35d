#!/usr/bin/env bash
# Session 13, call 4 (one H200), the session's final code: asynchronous scheduling on by default on a GPU, the
# one-pass sampler from one row under it. The sampler, no-sync and graph GPU tests; then bench decode fp8 at
# Qwen3-30B-A3B dimensions, the whole grid (128/128 and ctx1024, batch 64 and 256, 0 / 4 / 8 rank-16 adapters)
# with the defaults. Files: tests.log, bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_sample_triton.py \
    tests/test_no_sync_gpu.py tests/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 370 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
