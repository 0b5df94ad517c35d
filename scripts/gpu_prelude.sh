# Sourced by the one-call device scripts: strict pipes, unbuffered Python, $OUT made, the project installed
# (no dependencies: the device image has them), and the versions printed. Give the tree's commit in the run command
# (MOELORA_COMMIT=<sha> bash scripts/...): the device copy's .git may be another tree's.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the server's packages the device image lacks (fastapi, uvicorn, pydantic, ...: every `moelora` command imports the
# CLI, which imports the server), carried as wheels in .whl (`.whl` in the call's carry), into the image's own
# site-packages so that any PYTHONPATH (gpu_bench.sh TREES) still finds them
if [ -d .whl ] && [ "${SKIP_WHEELS:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
fi
[ "${SKIP_INSTALL:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
