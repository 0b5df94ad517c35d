#!/usr/bin/env bash
# Planned first call of session 7 on one H200 (~8 minutes). Nothing below has run on a GPU yet.
#  1. the GPU tests session 6 did not reach with its final code: test_fp8_gpu.py (47 of 55 ran at e893425, all
#     passed), test_kernels_lora_fused.py -m gpu, the grouped kernel's launch-override test;
#  2. scripts/bench_lora_fused.py --sweep at 64 and 256 tokens, 4 adapters, rank 16 (gate_up, down): the grouped
#     kernel (MOELORA_GROUPED_LORA=1, off by default, 2x slower than the per-pair kernel untuned) over
#     block_d x split_n x warps x stages, beside the per-pair fused kernel and the byte floor. If a config beats
#     the per-pair kernel, make it the default config, then bench decode with MOELORA_GROUPED_LORA=1 vs 0.
# Files: tests.log, sweep.log.
D="$(dirname "$0")"
source "$D/gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py \
    tests/test_kernels_lora_fused.py -m gpu > "$OUT/tests.log" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_grouped.py \
    -k "gpu_grouped or overrides" >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 280 python3 scripts/bench_lora_fused.py --tokens 64,256 --adapters 4 --ranks 16 --cases gate_up,down \
    --sweep 2>&1 | tee "$OUT/sweep.log" | tail -40
true
