#!/usr/bin/env bash
# Session 14, call 3 (one H200): the dense LoRA epilogue reduced to its measured-best form (h hoisted; the other
# three forms removed). (1) All FP8 GPU tests; (2) scripts/bench_fp8_lora_epilogue.py on the FP8 and the bf16 base,
# 16-4096 tokens: the epilogue, the separate expand, one row, and the single-slot path against the grouped kernels
# for one adapter (call 2 found it 54 against ~20 us per qkv call at 64 tokens); (3) bench decode fp8 128/128
# batch 64, 0 / 4 / 8 adapters (no regression against call 2's 6,009 / 4,728 / 4,602 tok/s).
# Files: tests.log, epilogue-fp8.{log,json}, epilogue-bf16.{log,json}, bench.log, b64/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
for dt in fp8 bfloat16; do
    timeout 150 python3 scripts/bench_fp8_lora_epilogue.py --dtype $dt --json "$OUT/epilogue-$dt.json" \
        > "$OUT/epilogue-$dt.log" 2>&1
    grep -v "^WARN" "$OUT/epilogue-$dt.log" | cut -c1-200 | tail -31
done
timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/b64" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
