#!/usr/bin/env bash
# One H200 (session 11, call 1): the routed-expert LoRA expand in the FP8 expert GEMM's epilogue (MOELORA_FP8_MOE_LORA_EPILOGUE=1, added
# in session 10, not yet run on a GPU). 1. its GPU tests and tests/test_fp8_gpu.py (GPU code changed since their last run); 2. bench decode fp8 128/128 b64/128 x 4/8 adapters with
# the default path, then with the epilogue (same run; it takes batches below 2,048 pairs, so 64/128). Files: tests.log, bench.log, default/ epilogue/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_moe_lora_epilogue.py tests/test_fp8_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-250 | tail -8
if grep -q " passed" "$OUT/tests.log" && ! grep -q "failed" "$OUT/tests.log"; then
  timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,128 --adapter-counts 0,4,8 \
      --out "$OUT/default" > "$OUT/bench.log" 2>&1
  MOELORA_FP8_MOE_LORA_EPILOGUE=1 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
      --batches 64,128 --adapter-counts 4,8 --out "$OUT/epilogue" >> "$OUT/bench.log" 2>&1
  grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error" | cut -c1-160
fi
true
