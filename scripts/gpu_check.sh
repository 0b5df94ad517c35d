#!/usr/bin/env bash
# One device call: install, GPU tests (kernels compiled at real shapes, parity with the kernels in place),
# `moelora bench kernels`, a profile of the prefill-sized expert LoRA path, and `moelora demo` on the GPU.
source "$(dirname "$0")/gpu_prelude.sh"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_lora.py tests/test_kernels_moe_lora.py tests/test_parity.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
python3 -m moelora demo --seed 3 2>&1 | tee "$OUT/demo_gpu.log" | tail -4
python3 scripts/profile_moe_lora.py 64 4 16 tiled 2>&1 | tee "$OUT/profile.log" | tail -22
python3 -m moelora bench kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" | grep -E "T=  (16|64) adapters=  8" 
