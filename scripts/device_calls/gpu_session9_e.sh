#!/usr/bin/env bash
# Session 9, call 5 (one H200), code of call 3 (5507d13): bench decode fp8 128/128 batch 64 with rank-64 adapters
# (0/4/8 adapters), which call 4 cut off at its 80 s limit during start-up. Files: bench.log, r64/decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --lora-rank 64 --out "$OUT/r64" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|loaded|start-up|Error|error" | cut -c1-160
true
