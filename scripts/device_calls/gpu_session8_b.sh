#!/usr/bin/env bash
# Session 8, second call, on nvidia-h200-x2 (~7 minutes). New since call 1: FP8 GEMM defaults from call 1's sweep
# (experts: 64-wide tiles, 4 stages; dense: 64-row blocks at decode sizes) and split-K for the dense FP8 GEMM
# (partials in a workspace, the last split to arrive adds them and resets its counter).
# GPU 0: test_fp8_gpu.py (FP8 layers against the dequantized bf16 computation, graphs and overlap), the dense LoRA
#   kernels, then the dense sweep with split-K (qkv / o at 1-256 tokens) and bench_lora_fused qkv/o with the
#   partial-sum buffer the engine uses.
# GPU 1: bench decode fp8, 128/128 batch 64/256 with 0/4/8 adapters (profiles), then ctx1024 batch 64 with 0/4
#   (the floor target's workload). Call 1 at 56fb254: 4,821 / 3,898 / 3,791 and 12,176 / 8,696 / 8,414 tok/s.
# Files: tests.log, sweep.log, sweep.json, lora_dense.log, bench.log, fp8/ fp8ctx/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --profile-steps 2 --out "$OUT/fp8" > "$OUT/bench.log" 2>&1
  timeout 150 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4 \
      --out "$OUT/fp8ctx" >> "$OUT/bench.log" 2>&1
) &
BENCH=$!
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py tests/test_kernels_lora.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 150 python3 scripts/sweep_fp8_gemm.py --cases qkv,o --tokens 1,16,64,256 --json "$OUT/sweep.json" \
    > "$OUT/sweep.log" 2>&1
grep -E "HBM|default|best|failed" "$OUT/sweep.log" | cut -c1-160
timeout 40 python3 scripts/bench_lora_fused.py --cases qkv,o --tokens 1,64,256 --adapters 4 --ranks 16 \
    > "$OUT/lora_dense.log" 2>&1
tail -n 7 "$OUT/lora_dense.log" | cut -c1-120
wait $BENCH
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error|error" | cut -c1-160
true
