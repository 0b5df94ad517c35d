#!/usr/bin/env bash
# Session 24, call 1: set_dense_lora_defer (qkv_proj / o_proj LoRA on the side stream beside the plain base GEMM, the
# delta added by qk_norm_rope / the post-attention RMSNorm). Its GPU tests and the norm kernels' tests, then one A/B
# process (fp8 128/128 batch 64, 0 / 4 / 8 adapters, rank 16, all targets, traced): defer, and defer without PDL
# between the side stream's shrink and delta kernel. Files: tests.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_dense_lora_defer.py \
    tests/test_kernels_norm.py > "$OUT/tests.log" 2>&1
echo "tests (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -14
timeout 300 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "defer:MOELORA_DENSE_LORA_DEFER=1;defernopdl:MOELORA_DENSE_LORA_DEFER=1,MOELORA_FP8_LORA_PDL=0" \
    > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|Traceback|^A/B|^variant|^default|^defer" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8* "$OUT"/traces/*nopdl*
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -26; done
true
