#!/usr/bin/env bash
# Session 9, call 3 (one H200). Grouped routed-expert LoRA on by default from 2,048 pairs (batch 256), by its own
# (slot, expert) alignment; the e4m3 group quantization now one @triton.jit helper (e4m3_groups) in the act-quant
# kernel, the producers (norms, SiLU-and-mul) and the decode attention's out_fp8.
# 1. GPU tests: test_fp8_gpu.py (FP8 paths, producers, attention out_fp8, epilogue), the grouped kernel's;
# 2. bench decode fp8 128/128 b64/128/256 x 0/4/8 adapters with the defaults; b256 4/8 with grouped off.
# Files: tests.log, bench.log, fp8/ off256/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py > "$OUT/tests.log" 2>&1
timeout 45 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_kernels_moe_lora_grouped.py \
    >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -12
if grep -q "^FAILED.*grouped" "$OUT/tests.log"; then export MOELORA_GROUPED_LORA=0; echo "grouped OFF"; fi
timeout 190 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128,256 --adapter-counts 0,4,8 \
    --out "$OUT/fp8" > "$OUT/bench.log" 2>&1
MOELORA_GROUPED_LORA=0 timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 \
    --adapter-counts 4,8 --out "$OUT/off256" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
true
