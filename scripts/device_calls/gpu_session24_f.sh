#!/usr/bin/env bash
# Session 24, call 5: the two mode-4 tests corrected (they expected mode 4 where mode4_ok falls back to mode 2:
# 3 and 256 rows); the deferral's tests again. Files: t.log.
source "$(dirname "$0")/../gpu_prelude.sh"
F=tests/test_fp8_gpu.py
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "$F::test_fp8_lora_expand_in_the_gemm_epilogue_equals_the_expand_kernel" \
    "$F::test_fp8_lora_program_first_is_bit_equal_to_the_lora_partial" tests/test_dense_lora_defer.py > "$OUT/t.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/t.log" | cut -c1-250 | tail -12
true
