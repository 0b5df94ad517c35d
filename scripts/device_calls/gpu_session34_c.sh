#!/usr/bin/env bash
# Session 34, call 3 (warm after call 2, ~6 min). Set MOELORA_COMMIT from the dev machine.
#  1. scripts/profile_prefill.py, fp8, 16 x 2,048 tokens, 0 / 1 / 4 adapters, one engine: the defaults (the new
#     FP8 prefill tiles, "experts"), then the grouped routed-expert LoRA at prefill (MOELORA_GROUPED_PREFILL=1),
#     then the old FP8 prefill tiles (narrow); the kernels of each under torch.profiler and the LoRA tax by kernel.
#  2. The bf16 base at today's defaults, batch 64, 0 / 4 / 8 adapters, 128/128 (last measured in session 8).
# Files: prefill.log, prefill.json, bf16/ + bf16.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 220 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,1,4 --lines 12 \
    --variants "grouped:MOELORA_GROUPED_PREFILL=1;narrow:MOELORA_FP8_PREFILL_CONFIG=narrow" \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "prefill (rc $?):"; grep -A12 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
timeout -s INT 160 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1
echo "bf16 (rc $?):"; grep -v "^WARN" "$OUT/bf16.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
