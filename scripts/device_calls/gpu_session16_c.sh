#!/usr/bin/env bash
# Session 16, call 3 (one H200): the routed-expert LoRA expand inside the FP8 expert GEMM's epilogue
# (MOELORA_FP8_MOE_LORA_EPILOGUE=1: the shrink alone, moe_lora_fused_shrink, on the main stream, then both expert
# GEMMs add the expand; no delta buffers, no side stream), and the dense LoRA program above 64 rows while the
# launch stays within 264 programs (o_proj at 256 rows). (1) GPU tests: the new epilogue test, the FP8 MoE layer,
# the fast path, the dense epilogue modes and PDL; (2) bench decode fp8 128/128 at batch 64 and 256, 0 / 4 / 8
# adapters: the default, then MOELORA_FP8_MOE_LORA_EPILOGUE=1.
# Files: tests.log, bench.log, default/, moe_epi/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "expert_gemm_epilogue or moe_layer or fast_path_equal or epilogue_equals or pdl" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 \
    --adapter-counts 0,4,8 --out "$OUT/default" > "$OUT/bench.log" 2>&1
MOELORA_FP8_MOE_LORA_EPILOGUE=1 timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,256 --adapter-counts 0,4,8 --out "$OUT/moe_epi" >> "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
