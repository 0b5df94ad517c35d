#!/usr/bin/env bash
# Session 34, call 3 (warm after call 2, ~6.5 min). Set MOELORA_COMMIT from the dev machine.
#  1. FP8 prefill end to end with the new prefill default (MOELORA_FP8_PREFILL_CONFIG=experts), then with the
#     old tiles (narrow), same machine (call 1: narrow 49,889 tok/s, bf16 56,417).
#  2. The bf16 base at today's defaults, batch 64, 0 / 4 / 8 adapters, 128/128 (last measured in session 8).
# Files: prefill/ + prefill.log, prefill-narrow/ + prefill-narrow.log, bf16/ + bf16.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 110 python3 -m moelora bench report --parts prefill --models qwen3-30b-a3b --dtypes fp8 \
    --ranks 16 --no-plot --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
echo "prefill, experts (rc $?):"; grep -aoE "fp8 r16 prefill adapters +[0-9]+: +[0-9]+ tok/s|Error.*|Traceback" "$OUT/prefill.log"
MOELORA_FP8_PREFILL_CONFIG=narrow timeout -s INT 110 python3 -m moelora bench report --parts prefill \
    --models qwen3-30b-a3b --dtypes fp8 --ranks 16 --no-plot --out "$OUT/prefill-narrow" > "$OUT/prefill-narrow.log" 2>&1
echo "prefill, narrow (rc $?):"; grep -aoE "fp8 r16 prefill adapters +[0-9]+: +[0-9]+ tok/s|Error.*|Traceback" "$OUT/prefill-narrow.log"
timeout -s INT 160 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1
echo "bf16 (rc $?):"; grep -v "^WARN" "$OUT/bf16.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
