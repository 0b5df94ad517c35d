#!/usr/bin/env bash
# Session 31, call 3 (~5 min): the grid at the session's defaults: fp8, 128/128 and ctx 1,024, batch 64, 0 / 4 / 8
# adapters, both expert LoRA layouts. Extra switches for every run: EXTRA="MOELORA_X=1" (env syntax).
# Files: grid_*.log, grid_*/.
source "$(dirname "$0")/../gpu_prelude.sh"
grid() {  # name layout workload batches
    env ${EXTRA:-MOELORA_UNUSED=0} timeout -s INT 110 python3 -m moelora bench decode --dtype fp8 --workloads "$3" \
        --batches "$4" --adapter-counts 0,4,8 --expert-lora-layout "$2" --out "$OUT/grid_$1" > "$OUT/grid_$1.log" 2>&1
    echo "grid $1 (rc $?):"; grep -v "^WARN" "$OUT/grid_$1.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
}
grid separate-vllm separate vllm 64
grid shared-vllm shared-a vllm 64
grid separate-ctx separate ctx1024 64
grid shared-ctx shared-a ctx1024 64
true
