#!/usr/bin/env bash
# One device call (issue 7): the FP8 experts on the Triton fast path (MOELORA_FUSED_MOE_QUANT=1; 5 launches per
# MoE layer instead of ~20) — its GPU tests, then bench decode FP8 at batch 64/128 with 0/4/8 adapters with it
# off and on. If on is faster, make it the default (fused_moe_triton._FAST["quantized"]).
# Files: fp8_fast_tests.log, bench.log, off/ on/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py tests/test_fp8.py \
    2>&1 | tee "$OUT/fp8_fast_tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-400 | tail -10
B="python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8"
MOELORA_FUSED_MOE_QUANT=0 timeout ${T_OFF:-150} $B --out "$OUT/off" 2>&1 | tee "$OUT/bench.log" | grep -v "^WARN" | tail -7
MOELORA_FUSED_MOE_QUANT=1 timeout ${T_ON:-150} $B --out "$OUT/on" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -7
