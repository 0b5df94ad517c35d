#!/usr/bin/env bash
# For the next device call (written in session 19 after its device time ran out): the three dense-LoRA switches that
# attack what is left of the batch-64 tax that is not bytes (attention-only adapters: +0.67 / +0.89 ms a step with 4 / 8
# adapters for 0.03 / 0.08 ms of bytes), measured in one call against the default:
#   MOELORA_DENSE_LORA_OVERLAP=1  the qkv / o_proj LoRA chains on the side stream beside their base GEMM (the FP8 GEMM
#                                 without its LoRA epilogue), the delta added after the join
#   MOELORA_LORA_SHRINK_PDL=1     the shrink launched with PDL after the RMSNorm / attention that writes its input
#   MOELORA_LORA_NORM_SHRINK=1    the RMSNorm before qkv writes qkv's shrink itself (no shrink launch, no wait)
# (1) their GPU tests; (2) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters on all targets and on attention only,
# default, then each switch (~95 s of compilation in the first run, ~90 s each after; ~560 s in all). Flip a default
# only if it wins. Files: tests.log, bench_{default,overlap,norm,pdl}.log, {default,overlap,norm,pdl}/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_dense_lora_overlap.py \
    tests/test_fp8_gpu.py -k "overlap or shrink_launched_with_pdl or norm_writes" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
for name in default overlap norm pdl; do  # pdl last: session 19 measured it in part
    case $name in
        overlap) env=MOELORA_DENSE_LORA_OVERLAP=1 ;;
        pdl) env=MOELORA_LORA_SHRINK_PDL=1 ;;
        norm) env=MOELORA_LORA_NORM_SHRINK=1 ;;
        *) env=MOELORA_UNUSED=0 ;;
    esac
    env "$env" timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
        --adapter-counts 0,4,8 --lora-targets all,attention --out "$OUT/$name" > "$OUT/bench_$name.log" 2>&1
    echo "$name (rc $?):"; grep -v "^WARN" "$OUT/bench_$name.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
true
