#!/usr/bin/env bash
# Session 23, call 1: set_lora_consumer_expand (the FP8 qkv / o_proj LoRA expand added by qk_norm_rope and the
# post-attention RMSNorm; the GEMM plain, with PDL beside the shrink). (1) its GPU tests and the PEFT parity test with
# it off / on; (2) A/B at fp8 128/128 batch 64, 0 / 4 / 8 adapters (rank 16, all targets), profiled with traces, one
# layer's kernels for 4 adapters; (3) the FP8 demo model (graphs = eager, exact-match) with it off / on.
# Files: tests.log, bench.log, ab/, traces/, demo.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_lora_deferred_gpu.py \
    tests/test_fp8_gpu.py -k "deferred or consumer or after_shrink or peft_on_dequantized" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -12
timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --ab "consumer:MOELORA_LORA_CONSUMER_EXPAND=1" --out "$OUT/ab" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^consumer" | cut -c1-190
cd "$OUT/traces" 2>/dev/null && for f in trace-vllm-b64-a4-all-fused-consumer0.json.gz; do
  [ -f "$f" ] && python3 -m moelora.bench.trace "$f" 2>&1 | head -24
done
cd - > /dev/null
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
timeout 200 python3 -m pytest -v -s -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py -k "demo_model_in_fp8" \
    > "$OUT/demo.log" 2>&1
echo "demo (rc $?):"; grep -E "PASSED|FAILED|passed|failed|exact|^E  " "$OUT/demo.log" | cut -c1-300 | tail -8
true
