#!/usr/bin/env bash
# Session 15, call 1 (one H200): the dense FP8 GEMM's LoRA expand as one more split-K partial, computed by its own
# program beside the K steps (set_fp8_lora_split / MOELORA_FP8_LORA_SPLIT, default mode 2 up to 64 rows), against
# the expand after the K steps (mode 0, session 14's form). (1) GPU tests: the three modes against the expand
# kernel, eager and in a graph, and the FP8 LoRA tests; (2) scripts/bench_fp8_lora_epilogue.py: µs per qkv /
# o_proj call per mode; (3) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters, default then mode 0.
# Files: tests.log, epilogue.log, epilogue.json, bench.log, split2/, after/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue or lora" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 110 python3 scripts/bench_fp8_lora_epilogue.py --tokens 16,64,256 --adapters 4,8 \
    --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-200 | tail -16
timeout 100 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/split2" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_SPLIT=0 timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/after" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
