#!/usr/bin/env bash
# One device call: install, GPU tests (kernels compiled at real shapes, parity with the kernels in place),
# then `moelora bench kernels`. Logs and JSON go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_moe_lora.py tests/test_parity.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 -m moelora bench kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" | tail -100
