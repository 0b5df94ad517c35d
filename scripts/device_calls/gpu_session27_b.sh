#!/usr/bin/env bash
# Session 27 call 2 (~7 min): one A/B process, two rounds, shared-A adapters, fp8 128/128 batch 64, 4 and 8 adapters:
#   first: MOELORA_FUSED_LORA_SLICE_FIRST=1 — the fused routed-expert kernel's grid slice first (+0.40% in one
#     round of session 26);
#   bk128 / bk256: MOELORA_LORA_SHRINK_BLOCK_K=128 / 256 — the deferred dense shrink's K tile (default 64): the same
#     4 K splits in 2x / 4x fewer serial steps (session 27 call 1's trace: the o_proj shrink takes 8.9 µs beside the
#     GEMM, 16 steps of 64, and ends ~1.8 µs after the GEMM).
# Files: ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 520 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --expert-lora-layout shared-a --ab-rounds 2 --out "$OUT/ab" \
    --ab "first:MOELORA_FUSED_LORA_SLICE_FIRST=1;bk128:MOELORA_LORA_SHRINK_BLOCK_K=128;bk256:MOELORA_LORA_SHRINK_BLOCK_K=256" \
    > "$OUT/ab.log" 2>&1
echo "slice first / shrink K tile (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^first|^bk" | cut -c1-190
true
