#!/usr/bin/env bash
# Session 28 call 1 (~9.5 min): (1) scripts/bench_defer_chain.py: the deferred dense chain beside its GEMM, µs per
# call, 15 launch variants in one process; (2) one A/B process, one round, shared-A adapters, fp8 128/128 batch 64,
# 0 / 4 adapters: the routed-expert projections with their GEMM issued first (both / gate_up only), the side stream
# at normal priority, the deferred shrink split by width / 8 ways / at 2 warps, the delta at 2 warps; (3) the GPU
# tests of session 27's defaults (the deferred dense shrink in K tiles of 128, the fused routed-expert kernel's grid
# slice first) and session 28's switches, as many as the time left allows.
# Files: chain.log, chain.json, ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 120 python3 scripts/bench_defer_chain.py --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "chain beside its GEMM (rc $?):"; grep -v "^WARN" "$OUT/chain.log" | cut -c1-250 | tail -8
timeout -s INT 210 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --expert-lora-layout shared-a --ab-rounds 1 --out "$OUT/ab" \
    --ab "mgemm:MOELORA_MOE_LORA_ORDER=gemm;mgu:MOELORA_MOE_LORA_ORDER=gate_up;normal:MOELORA_SIDE_STREAM_PRIORITY=normal;kps512:MOELORA_DENSE_DEFER_K_PER_SPLIT=512;s8:MOELORA_LORA_SHRINK_SPLITS=8;sw2:MOELORA_LORA_SHRINK_WARPS=2;dw2:MOELORA_LORA_DELTA_WARPS=2" \
    > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^kps|^s8 |^sw|^dw|^mg|^normal" | cut -c1-190
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=12 tests/test_streams.py \
    tests/test_dense_lora_defer.py tests/test_kernels_lora.py tests/test_kernels_lora_fused.py \
    tests/test_kernels_moe_lora_grouped.py::test_gpu_grouped_equals_per_pair_at_qwen3_shapes \
    -k "not dense_fused and not test_moe_fused_matches_reference and not apply_dense_lora" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  |s call" "$OUT/tests.log" | cut -c1-250 | tail -24
true
