#!/usr/bin/env bash
# Session 29 call 5 (~4 min): session 29's defaults at HEAD (MOELORA_MOE_LORA_EARLY=2 from the code, no environment):
# (1) 128/128 batch 64, 0 / 4 / 8 shared-A adapters; (2) one A/B process, one round, adapters with an A each (the
# layout still short of 90%), 0 / 4 / 8: launch variants that lost before mode 2 changed the gate_up schedule —
# the fused kernel's grid pair first, the dense chain at normal priority, the down GEMM issued first.
# Files: shared.log, shared/, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --out "$OUT/shared" > "$OUT/shared.log" 2>&1
echo "shared A (rc $?):"; grep -v "^WARN" "$OUT/shared.log" | grep -E "tok/s|Error|Traceback" | cut -c1-160
timeout -s INT 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/ab" --ab "pairfirst:MOELORA_FUSED_LORA_SLICE_FIRST=0;dnormal:MOELORA_DENSE_DEFER_PRIORITY=normal;mdown:MOELORA_MOE_LORA_ORDER=down" \
    > "$OUT/ab.log" 2>&1
echo "A/B, an A each (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^pairfirst|^dnormal|^mdown" | cut -c1-190
true
