#!/usr/bin/env bash
# One device call (one H200), prepared in session 13, not yet run: can the side stream's routed-expert LoRA kernel
# run beside the FP8 expert GEMM? Session 13 found it beside other kernels for only 450 of its 2,036 us a step
# (batch 64, 4 adapters): the GEMM's five CTAs per SM leave 4,096 registers, a LoRA CTA takes 7,168. GPU tests of
# the switches below, then bench decode fp8 128/128 batch 64 with 0 / 4 / 8 adapters and the kernels' timeline for:
#   default · MOELORA_FP8_LORA_HOIST=1 (dense epilogue, h hoisted) · MOELORA_FUSED_LORA_WARPS=2 (LoRA CTAs of
#   4,096 registers at <= 64 a thread) · MOELORA_FP8_EXPERT_MAXNREG=80 (GEMM CTAs of 10,240: 14,336 left).
# Files: tests.log, bench.log, default/ hoist/ warps2/ gemm80/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "hoisted or epilogue_equals" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
run() {  # name, env...
    local name=$1; shift
    env "$@" timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
        --adapter-counts 0,4,8 --profile-steps 3 --out "$OUT/$name" >> "$OUT/bench.log" 2>&1
}
run default MOELORA_NONE=1
run hoist MOELORA_FP8_LORA_HOIST=1
run warps2 MOELORA_FUSED_LORA_WARPS=2 MOELORA_FUSED_LORA_MAXNREG=64
run gemm80 MOELORA_FP8_EXPERT_MAXNREG=80
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|timeline|Error|Traceback" | cut -c1-260
true
