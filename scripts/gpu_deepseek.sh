#!/usr/bin/env bash
# One device call for DeepSeek (run from the repo root on the GPU machine, moelora installed):
# 1. GPU tests: the Triton MLA absorbed decode vs its reference and vs the expanded form at DeepSeek-V2-Lite head
#    dims (bf16), CUDA-graph replay vs eager on tiny V2/V3 models with mixed adapters (teacher-forced logits and
#    50 greedy tokens through LLM.generate), shared experts overlapped vs serial.
# 2. `moelora bench decode --preset deepseek-v2-lite`: no adapter vs 4 and 8 distinct rank-16 adapters, batch
#    1/16/64 after 1,024-token prompts, with the byte floor.
# Writes three files into $OUT: gpu_deepseek_tests.log, bench_decode_deepseek.log, decode-<date>-<device>.json.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree, whatever is installed
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/test_kernels_mla_triton.py tests/test_deepseek_gpu.py
} 2>&1 | tee "$OUT/gpu_deepseek_tests.log" | grep -E "passed|failed|error|graph vs eager|^FAILED|^ERROR" | tail -12
timeout 250 python3 -m moelora bench decode --preset deepseek-v2-lite --batches 1,16,64 --adapter-counts 0,4,8 \
  --lora-rank 16 --workloads ctx1024 --decode-steps 32 --out "$OUT" 2>&1 | tee "$OUT/bench_decode_deepseek.log" | tail -14
