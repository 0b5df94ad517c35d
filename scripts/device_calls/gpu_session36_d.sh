#!/usr/bin/env bash
# Session 36, call D (short; what device time is left): set MOELORA_COMMIT from the dev machine. The defaults as
# changed after call C: FP8 prefill epilogue mode 3, bf16 stacks back on the delta path
# (MOELORA_PREFILL_LORA_EPILOGUE_PLAIN=0), the dense expand's prefill tile 128x64x4.
#  1. GPU tests: the long mixed prefill against PEFT; the epilogue's GPU tests; the dense LoRA kernels.
#  2. Prefill at the defaults, 0 / 4 adapters, bf16 then FP8.
# Files: tests.log, bf16.log/json, fp8.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_long_prefill_gpu.py \
    tests/test_prefill_lora_epilogue.py tests/test_kernels_lora.py -k "gpu or long or prefill_tile or shrink_expand" \
    > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
for d in bf16 fp8; do
  timeout -s INT 45 python3 scripts/profile_prefill.py --dtype $d --adapters 0,4 --no-profile --json "$OUT/$d.json" \
      > "$OUT/$d.log" 2>&1
  echo "$d prefill (rc $?):"; grep -A3 "^variant " "$OUT/$d.log"; grep -E "Error|Traceback" "$OUT/$d.log" | tail -3
done
true
