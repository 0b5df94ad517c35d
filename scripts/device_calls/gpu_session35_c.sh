#!/usr/bin/env bash
# Session 35, call C (call B's prefill steps again: its --ab variant had commas; the last of the session's device time): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the routed LoRA in the FP8 expert GEMM's epilogue at prefill (its two GPU tests failed in call A,
#     under a bound since rewritten; now modes 1, 2, 3); the grouped
#     prefill kernel at its new 4-warp launch; test_fp8_gpu.py's LoRA, MoE-layer and expert tests (the GEMM's LoRA
#     epilogue changed for grouped launches).
#  2. FP8 prefill, one process, 0 / 4 adapters: default (now the epilogue, mode 1), off (the delta path at the 4-warp
#     grouped launch), epi2 / epi3 (the slot groups unrolled / metadata prefetched), old8 (the delta path at session
#     34's 8-warp launch).
#  3. bf16 prefill (the delta path), 0 / 4 adapters: default and old8.
# Files: tests-{epi,grouped,fp8}.log, prefill.log/json, bf16.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
V="off:MOELORA_PREFILL_LORA_EPILOGUE=0;epi2:MOELORA_PREFILL_LORA_EPILOGUE=2;epi3:MOELORA_PREFILL_LORA_EPILOGUE=3"
V="$V;old8:MOELORA_PREFILL_LORA_EPILOGUE=0,MOELORA_GROUPED_PREFILL_CONFIG=128x128x8x3"
timeout -s INT 150 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --no-profile --variants "$V" \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "fp8 prefill (rc $?):"; grep -A8 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
timeout -s INT 55 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --no-profile \
    --variants "old8:MOELORA_GROUPED_PREFILL_CONFIG=128x128x8x3" --json "$OUT/bf16.json" > "$OUT/bf16.log" 2>&1
echo "bf16 prefill (rc $?):"; grep -A4 "^variant " "$OUT/bf16.log"; grep -E "Error|Traceback" "$OUT/bf16.log" | tail -3
true
