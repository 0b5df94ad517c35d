#!/usr/bin/env bash
# Session 27: scripts/device_calls/gpu_session27_e.sh cut to batch 64 (device time spent on refused starts; ~6 min).
# deferred dense shrink in K tiles of 128, DEFER_SHRINK_BLOCK_K; the fused routed-expert kernel's grid slice first):
# (1) the GPU tests of both paths — the deferred dense LoRA (decode steps against the undeferred path and PEFT), the
# fused / grouped routed-expert kernels, the dense shrink; (2) the grid with these defaults: shared-A adapters, both
# workloads, batch 64 and 256, 0 / 4 / 8 adapters. Files: tests.log, grid.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora_grouped.py \
    -k "slice_first or gpu or shrink or deferred or delta" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64 \
    --adapter-counts 0,4,8 --expert-lora-layout shared-a --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid, shared A (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
