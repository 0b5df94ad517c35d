#!/usr/bin/env bash
# Session 17, call 2 (one H200): LoRA B (and dense h) tiles read in whole rank rows when the buffers' rank equals
# the rank tile (EVEN_R: 16-byte loads instead of 2-byte ones under a per-element rank mask; entries past the rank
# zeroed after the load) in the per-pair routed kernel, the FP8 GEMM's LoRA tile and the dense expand; the routed
# kernel's expand loop can be pipelined (MOELORA_FUSED_LORA_EXPAND_STAGES) and its tiles widened
# (MOELORA_FUSED_LORA_TILE). (1) GPU tests; (2) the kernels per call, 16 / 64 tokens, 4 / 8 adapters, and a sweep of
# the routed kernel's tiles and stages at 64 tokens; (3) bench decode fp8 128/128 batch 64, 0 / 4 / 8 adapters,
# default, then with the expand pipelined 3 deep.
# Files: tests.log, kernels.log, sweep.log, bench_default.log, bench_estages.log, default/, estages/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    tests/test_kernels_lora_fused.py tests/test_kernels_lora.py -k "lora or moe_layer or linear" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
timeout 60 python3 scripts/bench_lora_fused.py --tokens 16,64 --adapters 4,8 --ranks 16 \
    > "$OUT/kernels.log" 2>&1; grep -E "gate_up|down|qkv|   o |Error" "$OUT/kernels.log" | cut -c1-150
timeout 130 python3 scripts/bench_lora_fused.py --tokens 64 --adapters 4 --ranks 16 --cases gate_up,down \
    --sweep-tiles > "$OUT/sweep.log" 2>&1; grep -E "best|Error" "$OUT/sweep.log" | cut -c1-200
timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 \
    --adapter-counts 0,4,8 --out "$OUT/default" > "$OUT/bench_default.log" 2>&1
grep -v "^WARN" "$OUT/bench_default.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
MOELORA_FUSED_LORA_EXPAND_STAGES=3 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64 --adapter-counts 0,4,8 --out "$OUT/estages" > "$OUT/bench_estages.log" 2>&1
grep -v "^WARN" "$OUT/bench_estages.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
