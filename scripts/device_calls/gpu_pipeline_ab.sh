#!/usr/bin/env bash
# For the next device call (written in session 17, when no device was lent after call 2): the two switches session
# 17 left off until measured end to end.
#   MOELORA_FUSED_LORA_PIPELINE=1: the routed per-pair LoRA kernel's shrink and expand loops pipelined 3 deep for
#     4-warp launches (from 64 tokens), B read in whole rank rows there. Call 2 per call at 64 tokens, 4 adapters:
#     gate_up / down 20.1 / 12.7 µs against 23.4 / 16.4 (call 1).
#   MOELORA_LORA_EVEN_R=1: the dense expands (lora_expand, the FP8 GEMM's LoRA tile) and the grouped routed kernel
#     (batch 256) read h and B in whole rank rows (no 2-byte loads; the grouped kernel's B then goes through cp.async).
# Two calls (one would pass the 600 s limit; call 2 of session 17 ran out of time in the tests at 150 s):
#   bash scripts/device_calls/gpu_pipeline_ab.sh tests   GPU tests with both on (routed, dense, grouped, FP8 subsets; ~250 s)
#   bash scripts/device_calls/gpu_pipeline_ab.sh bench   bench decode fp8 128/128, 0 / 4 / 8 adapters: batch 64 with the default
#                                           and with the pipeline on, then batch 64 and 256 with both on (~400 s)
# Then flip the defaults that win and run the grid (gpu_session16_e.sh's bench line).
# Files: tests.log; bench_{default,pipe,both}.log, {default,pipe,both}/.
source "$(dirname "$0")/../gpu_prelude.sh"
part=${1:-tests}
if [ "$part" = tests ]; then
MOELORA_FUSED_LORA_PIPELINE=1 MOELORA_LORA_EVEN_R=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE \
    --tb=short -m gpu tests/test_kernels_lora_fused.py tests/test_kernels_lora.py \
    tests/test_kernels_moe_lora_grouped.py tests/test_fp8_gpu.py \
    -k "lora or grouped or moe_layer or linear" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
fi
[ "$part" = bench ] && for run in default pipe both; do
    case $run in
        default) env="MOELORA_FUSED_LORA_PIPELINE=0 MOELORA_LORA_EVEN_R=0" ;;
        pipe) env="MOELORA_FUSED_LORA_PIPELINE=1 MOELORA_LORA_EVEN_R=0" ;;
        both) env="MOELORA_FUSED_LORA_PIPELINE=1 MOELORA_LORA_EVEN_R=1" ;;
    esac
    batches=64; limit=110; [ $run = both ] && batches=64,256 && limit=170
    env $env timeout $limit python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches $batches \
        --adapter-counts 0,4,8 --out "$OUT/$run" > "$OUT/bench_$run.log" 2>&1
    echo "$run ($env)"; grep -v "^WARN" "$OUT/bench_$run.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
true
