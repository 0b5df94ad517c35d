#!/usr/bin/env bash
# Written at the end of session 26 for the next session's first call (~6 min): (1) the fused kernel's grid slice
# first (MOELORA_FUSED_LORA_SLICE_FIRST=1: gate and up of a pair side by side, so the up program's read of the
# shared A finds it in L2), +0.40% at 4 adapters in one round of session 26 call 4: two rounds, 4 and 8 adapters,
# shared-A adapters, fp8 128/128 batch 64, traced (the gate_up phase with a shared A has not been traced yet);
# (2) the same with adapters that give gate and up an A each (slice first should change nothing there).
# Files: first.log, first/, sep.log, sep/, traces/.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 260 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/first" \
    --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/first.log" 2>&1
echo "slice first, shared A (rc $?):"; grep -v "^WARN" "$OUT/first.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
rm -f "$OUT"/traces/*a8* "$OUT"/traces/*1.json.gz
(cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done)
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/sep" --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1" > "$OUT/sep.log" 2>&1
echo "slice first, an A each (rc $?):"; grep -v "^WARN" "$OUT/sep.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first" | cut -c1-190
true
