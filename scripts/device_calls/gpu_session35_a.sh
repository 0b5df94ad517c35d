#!/usr/bin/env bash
# Session 35, call A (~9.5 min; starts are scarce, so one call carries all): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the one-launch chain (session 34's grouped shrink and spin sleep; never run on a GPU); the grouped
#     routed-expert LoRA at prefill with gate_up's slices in one program; the routed LoRA in the FP8 expert GEMM's
#     epilogue at prefill; test_fp8_gpu.py's LoRA epilogue and MoE-layer tests (kernel_args and the B pointer changed).
#  2. FP8 prefill, one process, 0 / 4 adapters: default, gate_up's slices in one program (fuse), the epilogue (epi).
#  3. One A/B process, fp8 128/128 batch 64, 0 / 4 adapters an A each, two rounds: one launch (grouped shrink).
#  4. scripts/sweep_grouped_prefill.py (what time is left).
# Files: tests.log, prefill.log/json, ab.log + ab/, sweep.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_lora_chain.py \
    tests/test_dense_lora_defer.py tests/test_kernels_moe_lora_grouped.py tests/test_prefill_lora_epilogue.py \
    tests/test_fp8_gpu.py -k "chain or one_launch or (decode_step and one) or prefill or epilogue or moe_layer" \
    > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout -s INT 170 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --lines 8 \
    --variants "fuse:MOELORA_GROUPED_PREFILL_FUSE_SLICES=1;epi:MOELORA_PREFILL_LORA_EPILOGUE=1" \
    --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "fp8 prefill (rc $?):"; grep -A6 "^variant " "$OUT/prefill.log"; grep -E "Error|Traceback" "$OUT/prefill.log" | tail -3
timeout -s INT 185 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "one:MOELORA_DENSE_DEFER_ONE_LAUNCH=1" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^one" | cut -c1-190
timeout -s INT 50 python3 scripts/sweep_grouped_prefill.py --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "grouped prefill sweep (rc $?):"; grep -v "^WARN" "$OUT/sweep.log" | grep -E "^[a-z]|Error" | cut -c1-200
true
