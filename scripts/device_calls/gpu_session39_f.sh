#!/usr/bin/env bash
# Session 39, call F (~4 min): call E's best attention grid (8 programs per SM: +0.66% / +0.68% on ctx 1,024 at
# batch 64 with 0 / 4 adapters, -0.17% / +0.09% on 128/128) at batch 256 too, where it turns the direct one-split
# launch into two splits and a reduce. One A/B process, one round, fp8, both workloads, batch 64 and 256, 0 and 4
# adapters (--ab-base). Files: ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 330 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64,256 \
    --adapter-counts 0,4 --ab-base --out "$OUT/ab" --ab "sm8:MOELORA_ATTN_SPLITS_PER_SM=8" > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^sm8" | cut -c1-200
true
