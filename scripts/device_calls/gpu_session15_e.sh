#!/usr/bin/env bash
# Session 15, call 5 (one H200): PDL after the shrink now also for the expand after the K steps (mode 0: every
# size above 64 rows, e.g. batch 256 and prefill chunks): the K steps beside the shrink, the epilogue waits.
# (1) GPU tests: the PDL test (now also 256 rows), the epilogue modes, the demo model in FP8 with graphs and
# adapters; (2) scripts/bench_fp8_lora_epilogue.py at 256 tokens with the nopdl column; (3) bench decode fp8
# 128/128 batch 256, 0 / 4 / 8 adapters, default then MOELORA_FP8_LORA_PDL=0.
# Files: tests.log, epilogue.log, epilogue.json, bench.log, pdl/, nopdl/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "pdl or epilogue or demo_model_in_fp8" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 60 python3 scripts/bench_fp8_lora_epilogue.py --tokens 256 --adapters 4,8 \
    --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-200 | tail -5
timeout 75 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 \
    --adapter-counts 0,4,8 --out "$OUT/pdl" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_PDL=0 timeout 75 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 \
    --adapter-counts 0,4,8 --out "$OUT/nopdl" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
