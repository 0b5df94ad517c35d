#!/usr/bin/env bash
# Session 18, call 5 (one H200): the GPU tests of every LoRA kernel changed this session (the routed kernel pipelined
# with whole-rank-row B reads by default, B not loaded for rank-0 slots in lora_b_tile and the routed kernel: dense
# expand, FP8 GEMM LoRA tile, grouped kernel), then bench decode fp8 after 1,024-token prompts (ctx1024), batch 64
# and 256, 0 / 4 / 8 adapters, with the new defaults (the 128/128 rows are call 2's "both" run).
# Files: tests.log, bench_ctx.log, ctx1024/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_lora_fused.py \
    tests/test_kernels_lora.py tests/test_kernels_moe_lora_grouped.py tests/test_kernels_fused_moe.py \
    tests/test_fp8_gpu.py -k "lora or grouped or moe_layer or linear or fused_moe or align" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -10
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/ctx1024" > "$OUT/bench_ctx.log" 2>&1
grep -v "^WARN" "$OUT/bench_ctx.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-200
true
