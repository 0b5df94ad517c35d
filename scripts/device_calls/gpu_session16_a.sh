#!/usr/bin/env bash
# Session 16, call 1 (one H200): the dense FP8 GEMM with the LoRA shrink inline (set_fp8_lora_split mode 3: no
# shrink launch, no h; every program accumulates its K steps' shrink from the unquantized x it quantizes, then adds
# its partial expand). (1) GPU tests: the epilogue modes (now with 3), the unquantized-activation test over modes
# 2 / 3, PDL; (2) scripts/bench_fp8_lora_epilogue.py with the inline column; (3) bench decode fp8 128/128:
# default (mode 2 + PDL up to 64 rows, mode 0 + PDL above) at batch 64 and 256 — batch 256 with PDL on the
# expand after the K steps was not measured in session 15 — then MOELORA_FP8_LORA_SPLIT=3 at batch 64.
# Files: tests.log, epilogue.log, epilogue.json, bench.log, default/, inline/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue_equals or unquantized or pdl" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 100 python3 scripts/bench_fp8_lora_epilogue.py --tokens 16,64,256 --adapters 4,8 \
    --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-200 | tail -14
timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/default" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_SPLIT=3 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/inline" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
