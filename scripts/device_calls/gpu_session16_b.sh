#!/usr/bin/env bash
# Session 16, call 2 (one H200): call 1 found the inline LoRA (mode 3, x quantized inside the GEMM) slower than
# mode 2 (qkv at 64 tokens, 4 adapters: 27.7 against 17.1 µs) and out of shared memory with 8 groups at 64-row
# blocks. Now the inline form reads x beside its pre-quantized copy (no quantization inside the GEMM), with its
# pipeline stages fitted to shared memory. (1) GPU tests: the epilogue modes, the unquantized-activation test,
# PDL; (2) scripts/bench_fp8_lora_epilogue.py: inline (x beside its fp8 copy), inline_k (x quantized in the GEMM),
# base_k (the base GEMM quantizing x itself); (3) bench decode fp8 128/128 batch 64 with MOELORA_FP8_LORA_SPLIT=3,
# and batch 256 with MOELORA_FP8_LORA_PDL=0 (call 1 measured the default with PDL).
# Files: tests.log, epilogue.log, epilogue.json, bench.log, inline/, nopdl/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue_equals or unquantized or pdl" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 100 python3 scripts/bench_fp8_lora_epilogue.py --tokens 16,64,256 --adapters 4,8 \
    --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-220 | tail -14
MOELORA_FP8_LORA_SPLIT=3 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/inline" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_PDL=0 timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 \
    --adapter-counts 0,4,8 --out "$OUT/nopdl" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
