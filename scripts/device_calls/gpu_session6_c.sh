#!/usr/bin/env bash
# Third call of session 6 on one H200 (~9 minutes): the GPU tests call b did not reach (norm, CUDA graphs,
# graphs + overlap, FP8 fast path, EP pair dropping, parity on the GPU) and those of the grouped decode LoRA
# kernel (compiled, Qwen3 shapes; fused_moe_pairs with graphs and the side stream), then decode at
# Qwen3-30B-A3B (bf16, fp8; batch 64/256; 0/4/8 adapters; rank 16), then fp8 with the grouped kernel off
# (MOELORA_GROUPED_LORA=0) at 4 adapters for the comparison.
# Files: tests.log, bench.log, bf16/ fp8/ fp8-pairwise/ decode-*.json.
D="$(dirname "$0")"
source "$D/../gpu_prelude.sh"
timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_grouped.py \
    tests/test_cuda_graphs.py tests/test_graphs_overlap.py tests/test_ep_dropped_pairs.py \
    "tests/test_parity.py::test_mixed_batch_on_gpu_with_kernels" tests/test_kernels_norm.py \
    "tests/test_kernels_lora_fused.py::test_gpu_fused_moe_pairs_graph_replay_and_overlap" tests/test_fp8_gpu.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -15
for dt in bfloat16 fp8; do
  timeout 120 python3 -m moelora bench decode --dtype $dt --workloads vllm --batches 64,256 --adapter-counts 0,4,8 \
      --out "$OUT/${dt/bfloat16/bf16}" 2>&1 | grep -v "^WARN" | tee -a "$OUT/bench.log" | grep -E "tok/s"
done
MOELORA_GROUPED_LORA=0 timeout 80 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64,256 \
    --adapter-counts 4 --out "$OUT/fp8-pairwise" 2>&1 | grep -v "^WARN" | tee -a "$OUT/bench.log" | grep -E "tok/s"
true
