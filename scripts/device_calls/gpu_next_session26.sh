#!/usr/bin/env bash
# Written in session 25 after its device time ran out, for the next session's first call (three parts, ~8 min):
# (1) GPU tests of what session 25 wrote without a GPU: the delta kernel's tile switch (test_dense_lora_defer.py) and
#     the shared-A read of the fused routed-expert kernel (test_kernels_lora_fused.py, its GPU tests);
# (2) the shared-A layout (PEFT target_parameters: gate and up share A), fp8 128/128 batch 64, one A/B process:
#     MOELORA_LORA_SHARED_A=1 against off; the floor of this layout counts that A once;
# (3) the delta kernel's tiles (session 25: the qkv GEMM at 13.7 µs beside its 160 programs of 32 x 64), traced.
# Files: tests.log, shared.log, shared/, tile.log, tile/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_lora_fused.py -k "defer or delta or tile or gpu or a_src" > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-250 | tail -10
timeout 170 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --out "$OUT/shared" --ab "sharedA:MOELORA_LORA_SHARED_A=1" > "$OUT/shared.log" 2>&1
echo "shared-a layout (rc $?):"; grep -v "^WARN" "$OUT/shared.log" | grep -E "tok/s|Error|Traceback|^A/B|^variant|^default|^sharedA" | cut -c1-190
timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/tile" \
    --ab "t64x128:MOELORA_LORA_DELTA_TILE=64x128;t32x128:MOELORA_LORA_DELTA_TILE=32x128" > "$OUT/tile.log" 2>&1
echo "tiles (rc $?):"; grep -v "^WARN" "$OUT/tile.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^t[0-9]" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8*
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -24 | grep -E "us$|fp8_gemm|shrink|delta"; done
true
