#!/usr/bin/env bash
# Session 27 call 4 (~5.5 min): the new defaults (the deferred dense shrink in K tiles of 128, DEFER_SHRINK_BLOCK_K;
# the fused routed-expert kernel's grid slice first) — (1) the GPU tests of both paths: the deferred dense LoRA
# (decode steps against the undeferred path and PEFT), the fused / grouped routed-expert kernels, the dense kernels;
# (2) one A/B process, two rounds, shared-A adapters, fp8 128/128 batch 64: the deferred shrink's split count with
# the 128 tile (forced 8 / 2 against the default 4).
# Files: tests.log, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py tests/test_kernels_moe_lora_grouped.py \
    -k "slice_first or gpu or shrink or deferred or delta" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout -s INT 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/ab" \
    --ab "s8:MOELORA_LORA_SHRINK_SPLITS=8;s2:MOELORA_LORA_SHRINK_SPLITS=2" > "$OUT/ab.log" 2>&1
echo "deferred shrink splits at K tile 128 (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^s[28] " | cut -c1-190
true
