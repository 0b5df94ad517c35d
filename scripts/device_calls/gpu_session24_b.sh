#!/usr/bin/env bash
# Session 24, call 2: why the deferred dense LoRA's decode-step test failed (call 1: logits 5.8% / 6.4% from the
# epilogue path's): scripts/diag_dense_lora_paths.py compares five dense-LoRA paths on FP8 / bf16 bases, with and
# without a MoE layer; then the A/B of defer without PDL, traced. Files: diag.log, bench.log, ab/, traces/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 200 python3 scripts/diag_dense_lora_paths.py > "$OUT/diag.log" 2>&1
echo "diag (rc $?):"; grep -v "^WARN" "$OUT/diag.log" | tail -40 | cut -c1-220
timeout 250 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --profile-trace "$OUT/traces" --out "$OUT/ab" \
    --ab "defernopdl:MOELORA_DENSE_LORA_DEFER=1,MOELORA_FP8_LORA_PDL=0" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^defer" | cut -c1-190
rm -f "$OUT"/traces/*a0* "$OUT"/traces/*a8* "$OUT"/traces/*default*
cd "$OUT/traces" 2>/dev/null && for f in *a4*; do python3 -m moelora.bench.trace "$f" 2>&1 | head -26; done
true
