#!/usr/bin/env bash
# Session 23, call 4: the grid with the current defaults (set_fp8_lora_split mode 4 since session 22): fp8, 128/128
# and ctx 1,024, batch 64 and 256, 0 / 4 / 8 adapters (rank 16, all targets). Files: bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 480 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|Traceback|start-up" | cut -c1-190
true
