#!/usr/bin/env bash
# Session 8, fifth call (one H200, ~8 minutes). Call 4 bisected call 3's illegal memory access (fp8 batch 256, 8
# adapters): gone with MOELORA_FP8_SPLIT_K=0 and in eager mode. Cause: the split-K counters were first allocated
# inside a graph capture, whose zero-fill is only recorded; a graph replayed before the one holding the memset read
# garbage counters. Now they are made eagerly only (a capture that finds none runs unsplit).
# Tests: test_fp8_gpu.py (with the graph test of split-K), graph decode and parity; then bench decode fp8 128/128
# batch 64/256 with 0/4/8 adapters (profiles), ctx1024 batch 64 with 0/4/8, bf16 128/128 batch 64/256 with 0/4.
# Files: tests.log, bench.log, fp8/ fp8ctx/ bf16/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py > "$OUT/tests.log" 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_cuda_graphs.py tests/test_parity.py \
    -m gpu >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
    --profile-steps 2 --out "$OUT/fp8" > "$OUT/bench.log" 2>&1
timeout 70 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/fp8ctx" >> "$OUT/bench.log" 2>&1
timeout 90 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64,256 --adapter-counts 0,4 \
    --out "$OUT/bf16" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error|error" | cut -c1-160
true
