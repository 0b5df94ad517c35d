#!/usr/bin/env bash
# Second call of session 6 on one H200 (~8 minutes), after: the sort-based moe_align, FP8 inputs pre-quantized
# by default, the overlapped expert LoRA delta added inside silu_and_mul / combine, the KV writes inside
# qk_norm_rope. GPU tests of all four (compiled kernels, CUDA graphs, overlap, FP8 fast path, parity), then
# decode at Qwen3-30B-A3B (bf16, fp8; batch 64/256; 0/4/8 adapters; rank 16) with a 2-step kernel profile.
# Files: tests.log, bench.log, bf16/ fp8/ decode-*.json.
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_fused_moe.py \
    tests/test_kernels_norm.py tests/test_cuda_graphs.py tests/test_graphs_overlap.py tests/test_fp8_gpu.py \
    tests/test_ep_dropped_pairs.py "tests/test_parity.py::test_mixed_batch_on_gpu_with_kernels" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -15
for dt in bfloat16 fp8; do
  timeout 130 python3 -m moelora bench decode --dtype $dt --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --profile-steps 2 --out "$OUT/${dt/bfloat16/bf16}" 2>&1 | grep -v "^WARN" | tee -a "$OUT/bench.log" \
      | grep -E "tok/s|profile|^ +[0-9.]+%" | head -80
done
true
