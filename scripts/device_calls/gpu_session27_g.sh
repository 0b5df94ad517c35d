#!/usr/bin/env bash
# Session 27, the smallest form of scripts/device_calls/gpu_session27_e.sh (device time spent on refused starts): the GPU tests of
# session 27's defaults, then 128/128 and ctx 1,024 at batch 64 (0 / 4 / 8 shared-A adapters), each its own process
# so that what finishes is kept. Files: tests.log, vllm.log, vllm/, ctx.log, ctx/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora_grouped.py \
    -k "slice_first or gpu or shrink or deferred or delta" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
for w in vllm ctx1024; do
    timeout -s INT 130 python3 -m moelora bench decode --dtype fp8 --workloads $w --batches 64 \
        --adapter-counts 0,4,8 --expert-lora-layout shared-a --out "$OUT/$w" > "$OUT/$w.log" 2>&1
    echo "$w batch 64, shared A (rc $?):"; grep -v "^WARN" "$OUT/$w.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
done
true
