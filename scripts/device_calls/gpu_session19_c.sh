#!/usr/bin/env bash
# Session 19, call 3 (issue 7): (1) GPU tests of the dense shrink launched with PDL after its producer
# (MOELORA_LORA_SHRINK_PDL=1: RMSNorm / decode attention let it start at once, it reads its first A tiles while they
# run) and the FP8 LoRA PDL tests, the demo model in FP8 with graphs under it; (2) bench decode fp8 128/128 batch 64,
# 0 / 4 / 8 adapters, MOELORA_LORA_SHRINK_PDL=0 then =1; (3) the grid with this session's defaults: 128/128 batch
# 256 and ctx 1,024 batch 64 / 256.
# Files: tests.log, bench_pdl{0,1}.log, pdl{0,1}/, bench_b256.log, b256/, bench_ctx.log, ctx/.
source "$(dirname "$0")/../gpu_prelude.sh"
MOELORA_LORA_SHRINK_PDL=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/test_fp8_gpu.py -k "launched_with_pdl or demo_model_in_fp8" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
for v in 0 1; do
    MOELORA_LORA_SHRINK_PDL=$v timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
        --adapter-counts 0,4,8 --out "$OUT/pdl$v" > "$OUT/bench_pdl$v.log" 2>&1
    echo "shrink pdl $v (rc $?):"; grep -v "^WARN" "$OUT/bench_pdl$v.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 --adapter-counts 0,4,8 \
    --out "$OUT/b256" > "$OUT/bench_b256.log" 2>&1
echo "b256 (rc $?):"; grep -v "^WARN" "$OUT/bench_b256.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64,256 --adapter-counts 0,4,8 \
    --out "$OUT/ctx" > "$OUT/bench_ctx.log" 2>&1
echo "ctx1024 (rc $?):"; grep -v "^WARN" "$OUT/bench_ctx.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
