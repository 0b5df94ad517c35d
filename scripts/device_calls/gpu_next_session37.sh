#!/usr/bin/env bash
# For session 37 (written in session 36, not run): set MOELORA_COMMIT from the dev machine. ~9 min on a fresh machine.
#  1. GPU tests left unfinished in session 36: tests/test_kernels_fused_moe.py in full (the bf16 expert GEMM kernel
#     took the LoRA-epilogue parameters; 138 + 17 passed before limits); the dense expand's prefill tiles.
#  2. Prefill at session 36's defaults together (FP8 epilogue mode 3; bf16 on the delta path with the dense expand at
#     128 x 64), profiled, 0 / 4 adapters, FP8 then bf16 (fresh compiles: generous limits).
# Files: tests.log, fp8.log/json, bf16.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_fused_moe.py \
    tests/test_kernels_lora.py -k "not test_kernels_lora or prefill_tile" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
for d in fp8 bf16; do
  timeout -s INT 110 python3 scripts/profile_prefill.py --dtype $d --adapters 0,4 --lines 12 --json "$OUT/$d.json" \
      > "$OUT/$d.log" 2>&1
  echo "$d prefill (rc $?):"; grep -v "^WARN" "$OUT/$d.log" | grep -A12 "LoRA tax"; grep -A3 "^variant " "$OUT/$d.log"
done
true
