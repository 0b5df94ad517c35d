#!/usr/bin/env bash
# Session 36, call B (~7 min): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the routed LoRA expand in the bf16 expert GEMM's epilogue (new; Qwen3-30B-A3B shapes, modes 1-3,
#     against fp32 beside the delta path) and the FP8 one; the long mixed prefill against PEFT (bf16 now takes the
#     epilogue too); the fused-MoE kernels' GPU tests (the bf16 expert GEMM kernel changed).
#  2. bf16 prefill, one process, 0 / 4 adapters: the default (the epilogue, mode 1, gate_up's activation in its GEMM),
#     off (the delta path), epi3 (down's expand in the prefetch form).
#  3. FP8 prefill again, 0 / 4 adapters: the default (mode 1) and epi3 (call A: 82.5% / 83.9% kept).
#  4. bf16 decode, 128/128, batch 64, 0 / 4 adapters (last measured in session 8).
# Files: tests.log, bf16.log/json, fp8.log/json, decode.log + decode/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 200 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short tests/test_prefill_lora_epilogue.py \
    tests/test_long_prefill_gpu.py tests/test_kernels_fused_moe.py > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  |mean \|d log p\||f32_epi" "$OUT/tests.log" | cut -c1-300 | tail -30
timeout -s INT 130 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --no-profile \
    --variants "off:MOELORA_PREFILL_LORA_EPILOGUE=0;epi3:MOELORA_PREFILL_LORA_EPILOGUE=3" \
    --json "$OUT/bf16.json" > "$OUT/bf16.log" 2>&1
echo "bf16 prefill (rc $?):"; grep -A8 "^variant " "$OUT/bf16.log"; grep -E "Error|Traceback" "$OUT/bf16.log" | tail -3
timeout -s INT 90 python3 scripts/profile_prefill.py --dtype fp8 --adapters 0,4 --no-profile \
    --variants "epi3:MOELORA_PREFILL_LORA_EPILOGUE=3" --json "$OUT/fp8.json" > "$OUT/fp8.log" 2>&1
echo "fp8 prefill (rc $?):"; grep -A4 "^variant " "$OUT/fp8.log"; grep -E "Error|Traceback" "$OUT/fp8.log" | tail -3
timeout -s INT 120 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64 --adapter-counts 0,4 \
    --out "$OUT/decode" > "$OUT/decode.log" 2>&1
echo "bf16 decode (rc $?):"; grep -v "^WARN" "$OUT/decode.log" | grep -E "tok/s|Error|Traceback" | cut -c1-200
true
