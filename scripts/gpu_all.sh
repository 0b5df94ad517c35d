#!/usr/bin/env bash
# One device call over everything GPU-side: install, every GPU test file (summary in gpu_tests.log), the fused-MoE
# layer micro-benchmark, then `moelora bench decode` (Qwen3-30B-A3B dims, 48 layers). Env: TESTS (pytest files),
# BENCH_ARGS (extra bench decode arguments), T_TESTS / T_BENCH (timeouts in s). Files into $OUT (<= 5).
source "$(dirname "$0")/gpu_prelude.sh"
TESTS=${TESTS:-"tests/test_kernels_fused_moe.py tests/test_kernels_norm.py tests/test_graphs_overlap.py tests/test_cuda_graphs.py tests/test_parity.py tests/test_fp8_gpu.py tests/test_deepseek_gpu.py tests/test_kernels_mla_triton.py"}
timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -rfE $TESTS 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-300 | tail -25
[ -n "${MICRO:-1}" ] && timeout 60 python3 scripts/bench_fused_moe.py --profile 2>&1 | tee "$OUT/micro.log" | tail -12
timeout ${T_BENCH:-240} python3 -m moelora bench decode --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | tail -40
