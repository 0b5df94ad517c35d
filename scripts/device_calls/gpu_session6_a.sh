#!/usr/bin/env bash
# Planned first call of session 6 on nvidia-h200-x2 (~6 minutes). Nothing below has run on a GPU yet.
#   GPU 0: the GPU runs of the session-5 CPU work (EP pair dropping kernels, FP8 pre-quantization), then FP8
#          prefill with and without pre-quantization (scripts/device_calls/gpu_fp8_prequant.sh);
#   GPU 1: bench decode --profile-steps 3 at batch 64 with 0 and 4 adapters, bf16 then fp8: where the LoRA
#          tax (~4.4 ms a step) goes, kernel by kernel (issue 7);
#   then both: the 2-GPU test of EP pair dropping against the masking (bf16).
# Second call: RUN_TESTS=0 bash scripts/device_calls/gpu_ep_drop.sh (ep2 bench, off then on). Set MOELORA_COMMIT.
#   GPU 1 last: FP8 decode with every GEMM input pre-quantized (MOELORA_FP8_PREQUANT_MIN_ROWS=1), batch 64/256.
# Files: g0.log (+ report-*-prequant-*.json), g1.log, prof-bf16/ prof-fp8/ fp8-prequant/ decode-*.json,
# ep_test.log (8).
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
( export CUDA_VISIBLE_DEVICES=0 SKIP_INSTALL=1
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_ep_dropped_pairs.py
  T_P=120 bash "$D/gpu_fp8_prequant.sh" ) > "$OUT/g0.log" 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  for dt in bfloat16 fp8; do
    timeout 120 python3 -m moelora bench decode --dtype $dt --workloads vllm --batches 64 --adapter-counts 0,4 \
        --profile-steps 3 --out "$OUT/prof-${dt/bfloat16/bf16}"
  done
  # FP8 decode with every GEMM input quantized once beforehand (the gate_up GEMM re-quantizes each token row
  # in each of its K x N/BLOCK_N programs): compare with the fp8 rows above (64) and the report (256)
  MOELORA_FP8_PREQUANT_MIN_ROWS=1 timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
      --batches 64,256 --adapter-counts 0,4 --out "$OUT/fp8-prequant" ) > "$OUT/g1.log" 2>&1
wait
cat "$OUT/tests.log" "$OUT/prefill.log" >> "$OUT/g0.log" && rm -f "$OUT/tests.log" "$OUT/prefill.log"  # 8 files at most
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py -k "leaving_out_nonlocal" \
    > "$OUT/ep_test.log" 2>&1
for f in "$OUT"/*.log; do echo "== $f"; grep -v "^WARN" "$f" | grep -E "passed|failed|^FAILED|tok/s|prefill|  +[0-9.]+%|profile" | cut -c1-200 | head -60; done
