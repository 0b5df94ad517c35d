#!/usr/bin/env bash
# Session 25, call 4: the deferred dense shrink now splits K 4 ways by default (DEFER_SHRINK_MAX_SPLITS; measured
# as MOELORA_LORA_SHRINK_SPLITS=4 in calls 2 and 3): the deferral's GPU tests and the producer-shrink test.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    "tests/test_fp8_gpu.py::test_norm_and_attention_write_the_dense_lora_shrinks_in_a_decode_step" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -14
true
