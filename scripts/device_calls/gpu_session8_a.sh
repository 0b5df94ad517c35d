#!/usr/bin/env bash
# Session 8, first call, on nvidia-h200-x2 (two GPUs: two independent jobs side by side, ~9 minutes).
# GPU 1: bench decode fp8 then bf16 (batch 64/256; fp8 with 0/4/8 adapters and profiles): the first GPU figures
#   of session 7's host-side step (numpy graph inputs, no reservation call, sampler without [B, V] gathers) and of
#   this session's dense LoRA without the zero-fill (split-K partials summed by the expand); against the session-6
#   rows (fp8 4,709 / 3,730 / 3,713 and 11,284 / 7,968 / 7,568; bf16 3,175 / 2,614 and 10,255 / 7,114).
# GPU 0: the GPU tests of what changed (graph decode, overlap, parity, dense LoRA kernels at real shapes, the dense
#   fused qkv test), the dense LoRA kernels' times (bench_lora_fused.py qkv/o: session 7 measured 12.0 / 10.6 us at
#   64 tokens and 4 adapters for the three-launch chain), then sweep_fp8_gemm.py (the FP8 GEMM's launch parameters
#   at decode shapes).
# Files: tests.log, lora_dense.log, sweep.log, sweep.json, bench.log, fp8/ bf16/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --profile-steps 2 --out "$OUT/fp8" > "$OUT/bench.log" 2>&1
  timeout 200 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64,256 --adapter-counts 0,4 \
      --out "$OUT/bf16" >> "$OUT/bench.log" 2>&1
) &
BENCH=$!
export CUDA_VISIBLE_DEVICES=0
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora.py > "$OUT/tests.log" 2>&1
timeout 180 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_overlap.py \
    tests/test_cuda_graphs.py tests/test_graphs_overlap.py tests/test_parity.py tests/test_kernels_lora_fused.py \
    -m gpu -k "not fused or qwen3_qkv" >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 60 python3 scripts/bench_lora_fused.py --cases qkv,o --tokens 1,64,256 --adapters 4,8 --ranks 16 \
    > "$OUT/lora_dense.log" 2>&1
tail -n 13 "$OUT/lora_dense.log" | cut -c1-120
timeout 200 python3 scripts/sweep_fp8_gemm.py --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
grep -E "HBM|default|best" "$OUT/sweep.log" | cut -c1-160
wait $BENCH
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error|error" | cut -c1-160
true
