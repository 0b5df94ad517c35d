#!/usr/bin/env bash
# Session 34, call 2 (fresh machine, ~6.5 min after four refused starts; the FP8 tests first: the new prefill
# default is a default path). The one-launch chain's GPU tests and A/B (gpu_next_session35.sh) wait for a later session. Set MOELORA_COMMIT from the dev machine.
#  1. GPU tests of this session's GPU changes: the one-launch chain with the grouped shrink and the spin sleep
#     (tests/test_lora_chain.py, the one-launch decode steps of test_dense_lora_defer.py); the FP8 grouped GEMM at
#     a prefill size under the new prefill default ("experts") and call 1's unrun rest of tests/test_fp8_gpu.py
#     (its 200 s limit stopped it after 109 of 132; ids in scripts/device_calls/fp8_gpu_rest_s34.txt); the grouped
#     routed-expert LoRA at prefill (MOELORA_GROUPED_PREFILL, new, off): its kernel and layer tests.
#  2. scripts/profile_prefill.py, fp8, 16 x 2,048 tokens, 0 / 1 / 4 adapters, one engine: the defaults (the new
#     FP8 prefill tiles, "experts"), then the grouped routed-expert LoRA at prefill (MOELORA_GROUPED_PREFILL=1),
#     then the old FP8 prefill tiles (narrow); the kernels of each under torch.profiler and the LoRA tax by kernel.
# Files: tests.log, prefill.log, prefill.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    $(cat scripts/device_calls/fp8_gpu_rest_s34.txt) tests/test_fp8_gpu.py::test_fp8_grouped_gemm_qwen3_experts \
    > "$OUT/tests.log" 2>&1
echo "fp8 tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -6
timeout -s INT 50 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_moe_lora_grouped.py \
    -k "prefill" >> "$OUT/tests.log" 2>&1
echo "grouped prefill tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -4
timeout -s INT 130 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --lines 12 \
    --variants "grouped:MOELORA_GROUPED_PREFILL=1;narrow:MOELORA_FP8_PREFILL_CONFIG=narrow" \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "prefill (rc $?):"; grep -A10 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
true
