#!/usr/bin/env bash
# Session 36, call A (~7 min): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: a long mixed prefill (2,840 pairs, two adapters and rows without one) against PEFT on FP8 and bf16
#     bases, with the routed-expert LoRA epilogue off / mode 1 (the default since session 35) / mode 3, the path
#     taken checked (tests/test_long_prefill_gpu.py, new); the epilogue's kernel-level GPU tests.
#  2. FP8 prefill, one process, 0 / 4 adapters (session 35's unrun call C): the default (epilogue mode 1), off (the
#     delta path at the 4-warp grouped launch), epi2, epi3, old8 (the delta path at session 34's 8-warp launch).
#  3. bf16 prefill, profiled (the LoRA tax by kernel), 0 / 4 adapters: the default and old8.
# Files: tests.log, prefill.log/json, bf16.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 190 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/test_long_prefill_gpu.py \
    tests/test_prefill_lora_epilogue.py > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  |mean \|d log p\|" "$OUT/tests.log" | cut -c1-250 | tail -24
V="off:MOELORA_PREFILL_LORA_EPILOGUE=0;epi2:MOELORA_PREFILL_LORA_EPILOGUE=2;epi3:MOELORA_PREFILL_LORA_EPILOGUE=3"
V="$V;old8:MOELORA_PREFILL_LORA_EPILOGUE=0,MOELORA_GROUPED_PREFILL_CONFIG=128x128x8x3"
timeout -s INT 150 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --no-profile --variants "$V" \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "fp8 prefill (rc $?):"; grep -A8 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
timeout -s INT 100 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --lines 14 \
    --variants "old8:MOELORA_GROUPED_PREFILL_CONFIG=128x128x8x3" --json "$OUT/bf16.json" > "$OUT/bf16.log" 2>&1
echo "bf16 prefill (rc $?):"; grep -v "^WARN" "$OUT/bf16.log" | tail -40; grep -E "Error|Traceback" "$OUT/bf16.log" | tail -3
true
