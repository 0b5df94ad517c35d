#!/usr/bin/env bash
# Session 15, call 3 (one H200): call 2 measured the LoRA split-K partial over the slot groups (mode 2) best at
# <= 64 rows (qkv / o_proj at 64 tokens, 4 adapters: 18.6 / 20.1 against 19.9 / 22.8 µs after the K steps; batch 64
# 4,789 / 4,703 against 4,723 / 4,608 tok/s). Now the GEMM is also launched with programmatic dependent launch right
# after the shrink (its K steps beside the shrink; the LoRA program waits). (1) All FP8 GPU tests, with the PDL
# test; (2) scripts/bench_fp8_lora_epilogue.py with the nopdl column; (3) bench decode fp8 128/128 batch 64,
# 0 / 4 / 8 adapters, default (PDL) then MOELORA_FP8_LORA_PDL=0.
# Files: tests.log, epilogue.log, epilogue.json, bench.log, pdl/, nopdl/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 100 python3 scripts/bench_fp8_lora_epilogue.py --tokens 16,64 --adapters 4,8 \
    --json "$OUT/epilogue.json" > "$OUT/epilogue.log" 2>&1
grep -v "^WARN" "$OUT/epilogue.log" | cut -c1-200 | tail -10
timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/pdl" > "$OUT/bench.log" 2>&1
MOELORA_FP8_LORA_PDL=0 timeout 90 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/nopdl" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
