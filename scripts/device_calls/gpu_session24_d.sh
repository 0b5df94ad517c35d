#!/usr/bin/env bash
# Session 24, call 4: the decode grid with the session's defaults (dense LoRA deferred on FP8 bases): fp8, both
# workloads, batch 64 / 256, 0 / 4 / 8 rank-16 adapters on every target. Files: bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 480 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
echo "grid (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|Traceback|start-up" | cut -c1-190
true
