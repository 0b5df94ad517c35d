#!/usr/bin/env bash
# First call of session 6 on one H200 (the 2-GPU kinds are withheld), ~8 minutes.
#  1. the GPU runs of session 5's CPU work: EP pair-dropping kernels, the shared pair_virtual_experts
#     alignment (test_kernels_moe_lora compiled), FP8 pre-quantization;
#  2. bench decode --profile-steps 3 at batch 64 with 0 and 4 adapters, bf16 then fp8: where the step and
#     the LoRA tax go, kernel by kernel (issue 7);
#  3. FP8 decode with every GEMM input pre-quantized (MOELORA_FP8_PREQUANT_MIN_ROWS=1), batch 64/256;
#  4. FP8 prefill with pre-quantization off and at >= 1,024 rows (scripts/device_calls/gpu_fp8_prequant.sh).
# Files: g.log, prof-bf16/ prof-fp8/ fp8-prequant/ decode-*.json, report-*-prequant-{0,1024}.json.
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_ep_dropped_pairs.py \
    tests/test_kernels_moe_lora.py > "$OUT/g.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/g.log" | cut -c1-300
for dt in bfloat16 fp8; do
  timeout 110 python3 -m moelora bench decode --dtype $dt --workloads vllm --batches 64 --adapter-counts 0,4 \
      --profile-steps 3 --out "$OUT/prof-${dt/bfloat16/bf16}" 2>&1 | grep -v "^WARN" | tee -a "$OUT/g.log" | tail -24
done
MOELORA_FP8_PREQUANT_MIN_ROWS=1 timeout 110 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
    --batches 64,256 --adapter-counts 0,4 --out "$OUT/fp8-prequant" 2>&1 | grep -v "^WARN" | tee -a "$OUT/g.log" | tail -6
SKIP_INSTALL=1 T_P=100 bash "$D/gpu_fp8_prequant.sh"
cat "$OUT/tests.log" "$OUT/prefill.log" >> "$OUT/g.log" 2>/dev/null; rm -f "$OUT/tests.log" "$OUT/prefill.log"
true
