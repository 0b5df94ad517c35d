#!/usr/bin/env bash
# For a next device call (written in session 21): why the producer shrinks lost (session 21: -2.2% to -2.4% at
# fp8 128/128 batch 64) — the same A/B with 3 profiled steps per case, so each variant's row carries
# profile_vs_default (which kernels grew: the RMSNorm / attention kernels carrying the shrink, or the GEMM's LoRA
# program). ~95 s of compilation, ~60 s for the default's cases, ~60 s a variant. Files: bench.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
N=MOELORA_LORA_NORM_SHRINK=1; A=MOELORA_LORA_ATTN_SHRINK=1
timeout 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --profile-steps 3 --ab "norm:$N;attn:$A;both:$N,$A" --out "$OUT/ab" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|against the default|^ +[+-][0-9]|Error|Traceback|^A/B|^variant|^default|^norm|^attn|^both" | cut -c1-190
true
