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
# Triton's compiled kernels from an earlier call: a fresh machine compiles every kernel again (minutes of a call's
# device time). Carry `.triton-cache.tgz` (the last call's $OUT/triton-cache.tgz, copied to the repo root) and it is
# unpacked into Triton's cache; on exit this call's cache is packed into $OUT/triton-cache.tgz if it is at most
# TRITON_CACHE_MAX_MB (48). Kernels whose source changed since are compiled again (Triton keys its cache by source).
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .triton-cache.tgz ]; then
    mkdir -p "$TRITON_CACHE" && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE" \
        && echo "Triton cache: $(find "$TRITON_CACHE" -type f | wc -l) files from .triton-cache.tgz"
fi
pack_triton_cache() {
    [ -d "$TRITON_CACHE" ] || return 0
    tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE" . 2>/dev/null || return 0
    local mb=$(( $(stat -c %s "$OUT/triton-cache.tgz") >> 20 ))
    if [ "$mb" -gt "${TRITON_CACHE_MAX_MB:-48}" ]; then
        echo "Triton cache: ${mb} MB packed, over TRITON_CACHE_MAX_MB; not kept"; rm -f "$OUT/triton-cache.tgz"
    fi
}
trap pack_triton_cache EXIT
