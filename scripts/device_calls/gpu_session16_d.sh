#!/usr/bin/env bash
# Session 16, call 4 (one H200): call 3's routed-expert epilogue runs failed to compile on Triton 3.6 (a name
# defined only inside a constexpr branch of the shrink-only kernel; now both branches define it, checked offline
# with Triton 3.6's sm_90 compiler). Call 3 measured the default (with the o_proj rule) at batch 64 / 256.
# (1) GPU tests: the routed epilogue test, the FP8 MoE layer, the fast path; (2) bench decode fp8 128/128 at
# batch 64 and 256, 0 / 4 / 8 adapters, with MOELORA_FP8_MOE_LORA_EPILOGUE=1.
# Files: tests.log, bench.log, moe_epi/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "expert_gemm_epilogue or moe_layer or fast_path_equal" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
MOELORA_FP8_MOE_LORA_EPILOGUE=1 timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,256 --adapter-counts 0,4,8 --out "$OUT/moe_epi" > "$OUT/bench.log" 2>&1
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
true
