#!/usr/bin/env bash
# Written at the end of session 28 for session 29's first device call (~9 min; the first start also costs ~2-3 min of device time): (1) the GPU tests of
# set_moe_lora_early (gate_up's routed-expert LoRA issued beside the experts' alignment) and set_moe_lora_gu_split
# (gate_up's LoRA one launch a slice): bit-equal to the default, eagerly and from graph replays, bf16 and fp32
# deltas; the issue-order switch; the overlap graph tests (their capture helper changed); the delta kernel's tile
# from a width; (2) one A/B process, two
# rounds, shared-A adapters, fp8 128/128 batch 64, 0 / 4 / 8 adapters, with kernel traces: the early gate_up LoRA,
# the split gate_up LoRA, both, and the deferred delta kernel's 64 x 128 tile on qkv only (o_proj keeps the default);
# before it, the routed-expert variants and the routed GEMM issued first (does a CUDA graph keep the issue order?)
# on one MoE layer alone, µs a call (scripts/bench_fp8_moe_lora_layer.py --shared-a).
# Files: tests.log, moe_layer.log, moe_layer.json, ab.log, ab/, traces/ (python -m moelora.bench.trace traces/*a4*).
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    tests/test_dense_lora_defer.py -k "order or overlap or tile_only or one_launch_a_slice" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
V="early:MOELORA_MOE_LORA_EARLY=1;gus:MOELORA_MOE_LORA_GU_SPLIT=1;egus:MOELORA_MOE_LORA_EARLY=1,MOELORA_MOE_LORA_GU_SPLIT=1;mgemm:MOELORA_MOE_LORA_ORDER=gemm"
Q="qkvt:MOELORA_LORA_DELTA_TILE=64x128,MOELORA_LORA_DELTA_TILE_MIN_O=4096"
timeout -s INT 80 python3 scripts/bench_fp8_moe_lora_layer.py --tokens 64 --adapters 4,8 --shared-a --variants "$V" \
    --out "$OUT/moe_layer.json" > "$OUT/moe_layer.log" 2>&1
echo "one MoE layer, µs a call (rc $?):"; grep -v "^WARN" "$OUT/moe_layer.log" | tail -4
timeout -s INT 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/ab" --profile-steps 3 --profile-trace "$OUT/traces" \
    --ab "early:MOELORA_MOE_LORA_EARLY=1;gus:MOELORA_MOE_LORA_GU_SPLIT=1;egus:MOELORA_MOE_LORA_EARLY=1,MOELORA_MOE_LORA_GU_SPLIT=1;$Q" \
    > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^early|^gus|^egus|^qkvt" | cut -c1-190
for f in "$OUT"/traces/*a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24; done
true
