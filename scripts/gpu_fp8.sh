#!/usr/bin/env bash
# One device call for FP8 (issue 7), from the repo root on an H200 (moelora pip-installed there):
# the FP8 GPU tests (kernels at Qwen3-30B-A3B shapes vs the references and vs bf16 on the dequantized weights,
# LoRA on the unquantized activations, an FP8 checkpoint + adapter vs PEFT, the demo model in FP8 with graphs)
# and `moelora bench decode --dtype fp8` (smoke-sized grid). Writes 3 files into $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_fp8_gpu.py tests/test_fp8.py 2>&1 | tee "$OUT/fp8_gpu_tests.log" | tail -15
# decode at Qwen3-30B-A3B dimensions, FP8 base: 8 layers keep it inside one device call; batches 1/16/64, 0/1/4/8 adapters
timeout 420 python3 -m moelora bench decode --dtype fp8 --layers 8 --batches 1,16,64 --adapter-counts 0,1,4,8 \
    --workloads ctx1024 --decode-steps 16 --out "$OUT" 2>&1 | tee "$OUT/fp8_bench_decode.log" | tail -16
