#!/usr/bin/env bash
# Session 14, call 2 (one H200): the dense LoRA epilogue of the FP8 GEMM. Call 1 measured h hoisted out of the
# slot loop faster end to end (4,715 / 4,593 against 4,651 / 4,443 tok/s, batch 64, 4 / 8 adapters): it is now the
# default ("hoist"). (1) GPU tests: the four epilogue modes bit-equal, eager and in a graph, and the FP8 LoRA tests;
# (2) scripts/bench_fp8_lora_epilogue.py: µs per qkv / o_proj call per mode; (3) bench decode fp8, the whole grid
# with the default, then 128/128 batch 64 and 256 with MOELORA_FP8_LORA_EPILOGUE_MODE=grouped.
# Files: tests.log, epilogue.log, epilogue.json, bench.log, grid/, grouped/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "modes_are_bit_equal or epilogue or lora" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 120 python3 scripts/bench_fp8_lora_epilogue.py --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-200 | tail -24
timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_EPILOGUE_MODE=grouped timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,256 --adapter-counts 0,4,8 --out "$OUT/grouped" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
