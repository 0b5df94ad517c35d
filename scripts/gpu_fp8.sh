#!/usr/bin/env bash
# One device call for FP8 / NVFP4 (issue 7), from the repo root on an H200 (moelora pip-installed there):
#  1. the FP8/NVFP4 GPU tests (kernels at Qwen3-30B-A3B shapes vs the references and vs bf16 on the dequantized
#     weights, LoRA on the unquantized activations, FP8 and NVFP4 checkpoints + adapter vs PEFT, the demo model
#     in FP8 with CUDA graphs vs eager and its adapters' exact match) and the CPU FP8/NVFP4 tests;
#  2. scripts/bench_fp8_kernels.py: the FP8 / NVFP4 / bf16 expert and dense GEMMs against their byte floors;
#  3. `moelora bench decode --dtype fp8` and `--dtype nvfp4` at Qwen3-30B-A3B dimensions (8 layers, ctx1024 grid).
# Under 10 minutes (tests <= 240 s, kernels <= 60 s, each decode benchmark <= 130 s). Writes 3 files into $OUT:
# fp8_gpu_tests.log, fp8_bench.log (kernels + both decode runs), fp8_bench_decode.json (both decode runs' JSON).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TMP=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_fp8_gpu.py tests/test_fp8.py tests/test_nvfp4.py 2>&1 \
    | tee "$OUT/fp8_gpu_tests.log" | tail -15
timeout 60 python3 scripts/bench_fp8_kernels.py 2>&1 | tee "$OUT/fp8_bench.log" | tail -9
for dt in fp8 nvfp4; do
    timeout 130 python3 -m moelora bench decode --dtype $dt --layers 8 --batches 1,16,64 --adapter-counts 0,1,4,8 \
        --workloads ctx1024 --decode-steps 16 --out "$TMP/$dt" 2>&1 | tee -a "$OUT/fp8_bench.log" | tail -14
done
python3 - "$TMP" "$OUT/fp8_bench_decode.json" <<'PY'
import glob, json, sys
runs = {p.split("/")[-2]: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + "/*/decode-*.json"))}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
print("bench JSON:", {k: len(v.get("rows", [])) for k, v in runs.items()})
PY
