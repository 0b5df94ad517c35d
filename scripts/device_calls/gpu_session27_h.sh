#!/usr/bin/env bash
# Session 27, the GPU tests alone of its defaults (the deferred dense shrink in K tiles of 128, the fused expert
# kernel's grid slice first), then 128/128 batch 64 if time is left. Files: tests.log, vllm.log, vllm/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 140 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py -k "slice_first or gpu or shrink or deferred" \
    > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout -s INT 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --expert-lora-layout shared-a --out "$OUT/vllm" > "$OUT/vllm.log" 2>&1
echo "vllm batch 64, shared A (rc $?):"; grep -v "^WARN" "$OUT/vllm.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
