#!/usr/bin/env bash
# Session 19, call 4 (issue 7; ~270 s of device time left): the same-call A/B that call 3 lost to its time limit —
# bench decode fp8 128/128 batch 64 with 4 and 8 adapters, MOELORA_LORA_SHRINK_PDL=0 then =1 (the first run pays the
# kernel compilation). Files: bench_pdl{0,1}.log, pdl{0,1}/.
source "$(dirname "$0")/../gpu_prelude.sh"
for v in 0 1; do
    limit=$([ $v = 0 ] && echo 135 || echo 65)
    MOELORA_LORA_SHRINK_PDL=$v timeout $limit python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
        --adapter-counts 4,8 --out "$OUT/pdl$v" > "$OUT/bench_pdl$v.log" 2>&1
    echo "shrink pdl $v (rc $?):"; grep -v "^WARN" "$OUT/bench_pdl$v.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
true
