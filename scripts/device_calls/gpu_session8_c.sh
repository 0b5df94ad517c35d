#!/usr/bin/env bash
# Session 8, third call (~8 minutes; on one GPU the two parts run one after the other, bf16 left out). New since call 2 (2e52a5d): the dense FP8 split-K rule
# from call 2's sweep (qkv unsplit and o_proj 4 splits at 64 tokens), the decode attention kernel writing 0 to
# padding rows (no zero-filled output per layer), routing weights in bf16 from the routing kernel (no cast), and
# the decoder norms / SiLU-and-mul quantizing their outputs for the FP8 GEMMs (3 of the 4 quantization launches
# per layer gone). Predicted at fp8 batch 64: ~0.25 ms (dense GEMMs) + ~0.1 (fills, casts) + ~0.3 (quantization)
# off the 12.5 ms step, ~5,400 tok/s.
# GPU 0: GPU tests: test_fp8_gpu.py, the attention kernels, graph decode, parity, the routing kernel.
# GPU 1: bench decode fp8 128/128 batch 64/256 with 0/4/8 adapters (profiles), ctx1024 batch 64 with 0/4/8,
#   then bf16 128/128 batch 64/256 with 0/4.
# Files: tests.log, bench.log, fp8/ fp8ctx/ bf16/ decode-*.json.
source "$(dirname "$0")/../gpu_prelude.sh"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
bench() {
  export CUDA_VISIBLE_DEVICES=$(( NGPU > 1 ? 1 : 0 ))
  timeout 230 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --profile-steps 2 --out "$OUT/fp8" > "$OUT/bench.log" 2>&1
  timeout 130 python3 -m moelora bench decode --dtype fp8 --workloads ctx1024 --batches 64 --adapter-counts 0,4 \
      --out "$OUT/fp8ctx" >> "$OUT/bench.log" 2>&1
  [ "$NGPU" -gt 1 ] && timeout 130 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm \
      --batches 64,256 --adapter-counts 0,4 --out "$OUT/bf16" >> "$OUT/bench.log" 2>&1
}
if [ "$NGPU" -gt 1 ]; then bench & BENCH=$!; else bench; BENCH=; fi
export CUDA_VISIBLE_DEVICES=0
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py tests/test_kernels_attention.py \
    > "$OUT/tests.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_cuda_graphs.py tests/test_parity.py \
    tests/test_graphs_overlap.py -m gpu >> "$OUT/tests.log" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_fused_moe.py -k route \
    >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -12
[ -n "$BENCH" ] && wait $BENCH
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error|error" | cut -c1-160
true
