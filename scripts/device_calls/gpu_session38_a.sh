#!/usr/bin/env bash
# Session 38, call A (~5 min on a fresh machine): the down projection's routed-expert LoRA issued as soon as the
# gate_up GEMM is done, computing each row's activation itself (MOELORA_MOE_LORA_EARLY_DOWN=1, moe_lora_fused
# act_in), so that it runs beside the activation kernel (~3 µs of idle HBM a layer) as well as the down GEMM.
# Session 37's trace (an A each, 4 adapters): the down phase +8.8 µs a layer for 7.1 µs of LoRA bytes.
# (1) GPU tests first: the act_in kernel bit-equal to the kernel on silu_and_mul's output (Qwen3 shapes), the
#     bf16 layer's issue orders with the switch (eager and replayed), the FP8 layer eager and replayed;
# (2) one A/B process, two rounds, an A each, fp8 128/128 batch 64, 0 / 4 adapters: default vs early down.
# Files: tests.log, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py \
    tests/test_fp8_gpu.py -k "act_in or order_changes_nothing or down_lora_from_gate_up or fused_moe_pairs_graph" \
    > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout -s INT 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --out "$OUT/ab" --ab "down:MOELORA_MOE_LORA_EARLY_DOWN=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^down" | cut -c1-190
true
