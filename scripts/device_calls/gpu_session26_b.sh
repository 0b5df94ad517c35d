#!/usr/bin/env bash
# Session 26, call 2: (1) GPU tests of the shared-A read (now on by default) and of MOELORA_LORA_SHARED_H (the gate
# program expands up from its h); (2) one A/B process, fp8 128/128 batch 64, shared-A adapters: SHARED_H against the
# default; (3) the grid with the defaults and shared-A adapters, both workloads, batch 64 and 256.
# Files: tests.log, ab.log, ab/, grid.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    tests/test_kernels_moe_lora_grouped.py -k "gpu or a_src or shared" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --out "$OUT/ab" --ab "sharedH:MOELORA_LORA_SHARED_H=1" > "$OUT/ab.log" 2>&1
echo "shared h (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^sharedH" | cut -c1-190
timeout 280 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
