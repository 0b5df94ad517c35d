#!/usr/bin/env bash
# Session 16, call 5 (one H200): the final code. The dense LoRA expand helpers merged into one (lora_expand_tile:
# the batch's slot groups, the first 8 unrolled; or all slots in its loop), mode 1 removed; the LoRA program above
# 64 rows while the launch stays within 264 programs (o_proj at 256 rows). (1) GPU tests: the dense epilogue modes,
# PDL, the unquantized-activation test, the FP8 MoE layer, the demo model in FP8 with graphs and adapters;
# (2) the grid: bench decode fp8 on both workloads, batch 64 and 256, 0 / 4 / 8 adapters.
# Files: tests.log, bench.log, grid/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 140 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "epilogue_equals or pdl or unquantized or moe_layer or demo_model_in_fp8" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/grid" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
