#!/usr/bin/env bash
# Written in session 25 after its device time ran out, for the next session's first call. Session 25 showed the
# plain dense GEMMs lose ~5 µs each only to the deferred chain sharing their SMs (serial: 9.6 / 8.5 µs again), and
# that fewer shrink programs helped o_proj (4 K splits, now the default). The qkv GEMM (80 programs on 132 SMs) stayed
# at 13.7 beside the delta kernel's 160 programs (32 x 64 tiles). Here: (1) the deferral's GPU tests (the tile test
# compiled in bf16); (2) one A/B process, fp8 128/128 batch 64, traced: the delta kernel with 64 x 128 tiles (qkv 40
# programs, o_proj 16), 32 x 128, 64 x 64. Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" --ab-rounds 2 \
    --ab "t64x128:MOELORA_LORA_DELTA_TILE=64x128;t32x128:MOELORA_LORA_DELTA_TILE=32x128;t64x64:MOELORA_LORA_DELTA_TILE=64x64" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^t[0-9]" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8* "$OUT"/traces/*1.json.gz
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24 | grep -E "us$|fp8_gemm|shrink|delta"; done
true
