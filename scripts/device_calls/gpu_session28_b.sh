#!/usr/bin/env bash
# Session 28 call 5 (~6 min): session 28's defaults (the deferred dense shrink split by input width, o_proj 8 ways;
# its delta kernel at 8 warps): (1) the deferred dense LoRA's GPU tests (decode steps against the undeferred path
# and PEFT, graph replay, the launch switches); (2) the grid, shared-A adapters, both workloads, batch 64 and 256,
# 0 / 4 / 8 adapters; (3) adapters with an A each, 128/128 batch 64. Files: tests.log, grid.log, grid/, sep.log, sep/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=6 \
    tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  |s call" "$OUT/tests.log" | cut -c1-250 | tail -12
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --expert-lora-layout shared-a --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid, shared A (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
timeout -s INT 70 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/sep" > "$OUT/sep.log" 2>&1
echo "an A each (rc $?):"; grep -v "^WARN" "$OUT/sep.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
