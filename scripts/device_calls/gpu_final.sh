#!/usr/bin/env bash
# The session's last device call: the GPU tests not yet run on the merged tree, then the decode benchmarks —
# bf16 (Qwen3-30B-A3B, 48 layers), the LoRA overlap on vs off, FP8 (48 layers), DeepSeek-V2-Lite. Every part has
# its own timeout, so one slow part cannot take the others' results. Files into $OUT: gpu_tests.log,
# bench.log, and the decode JSON of each run under $OUT/{bf16,overlap,fp8,ds}/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_cuda_graphs.py tests/test_graphs_overlap.py tests/test_deepseek_gpu.py \
    "tests/test_kernels_fused_moe.py::test_fast_path_leaves_quantized_stacks_alone" \
    tests/test_kernels_attention.py -m gpu \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-400 | tail -20
timeout ${T_TESTS2:-60} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_mla_triton.py \
    tests/test_parity.py -k "mla or on_gpu or decode_steps or absorbed or graph" \
    2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | cut -c1-400 | tail -12
B="python3 -m moelora bench decode"
timeout ${T_BF16:-170} $B --out "$OUT/bf16" --workloads vllm,ctx1024 --batches 1,64,128 --adapter-counts 0,4,8 \
    --decode-steps 24 2>&1 | tee -a "$OUT/bench.log" | grep -v "^WARN" | tail -22
timeout ${T_OVL:-70} $B --out "$OUT/overlap" --workloads vllm --batches 64 --adapter-counts 4 --lora-overlap both \
    2>&1 | tee -a "$OUT/bench.log" | tail -3
timeout ${T_FP8:-100} $B --out "$OUT/fp8" --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    2>&1 | tee -a "$OUT/bench.log" | tail -6
timeout ${T_DS:-70} $B --out "$OUT/ds" --preset deepseek-v2-lite --workloads ctx1024 --batches 1,64 \
    --adapter-counts 0,4,8 --decode-steps 16 2>&1 | tee -a "$OUT/bench.log" | tail -8
