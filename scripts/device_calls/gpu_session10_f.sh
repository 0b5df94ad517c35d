#!/usr/bin/env bash
# Session 10, call 6 (one H200), the final code: with the side stream at high priority, does the grouped
# routed-expert LoRA kernel (fewer bytes, slower alone) win at batch 64/128? bench decode fp8 128/128, 4/8 adapters:
# the defaults (per-pair below 2,048 pairs), then MOELORA_GROUPED_MIN_PAIRS=512. Files: bench.log, pp/ grp/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 95 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 4,8 \
    --out "$OUT/pp" > "$OUT/bench.log" 2>&1
MOELORA_GROUPED_MIN_PAIRS=512 timeout 95 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 \
    --adapter-counts 4,8 --out "$OUT/grp" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
