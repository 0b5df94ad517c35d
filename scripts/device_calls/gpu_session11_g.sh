#!/usr/bin/env bash
# Session 11, call 7 (one H200): the split-K epilogue shared by the FP8 and NVFP4 GEMMs (split_k_reduce): all of
# tests/test_fp8_gpu.py. File: tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -12
true
