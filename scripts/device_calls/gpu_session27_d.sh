#!/usr/bin/env bash
# Session 27 call 5 (~6 min): the grid with session 27's defaults (the deferred dense shrink in K tiles of 128, the
# fused routed-expert kernel's grid slice first): shared-A adapters, both workloads, batch 64 and 256, 0 / 4 / 8
# adapters; then adapters with an A each at 128/128 batch 64. Files: grid.log, grid/, sep.log, sep/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --expert-lora-layout shared-a --out "$OUT/grid" > "$OUT/grid.log" 2>&1
echo "grid, shared A (rc $?):"; grep -v "^WARN" "$OUT/grid.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
timeout -s INT 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/sep" > "$OUT/sep.log" 2>&1
echo "an A each (rc $?):"; grep -v "^WARN" "$OUT/sep.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
