#!/usr/bin/env bash
# Written at the end of session 26: the fused kernel's grid slice first (MOELORA_FUSED_LORA_SLICE_FIRST=1: gate and
# up programs of a pair side by side, so the up program's read of the shared A finds it in L2; +0.40% at 4 adapters
# in one round of session 26 call 4), two rounds, 4 and 8 adapters, shared-A adapters, fp8 128/128 batch 64
# (~4 min). Files: first.log, first/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 240 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/first" \
    --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/first.log" 2>&1
echo "slice first, shared A (rc $?):"; grep -v "^WARN" "$OUT/first.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
true
