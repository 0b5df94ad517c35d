#!/usr/bin/env bash
# Session 39, call E (~6.5 min): the split-KV decode attention's grid (MOELORA_ATTN_SPLITS_PER_SM,
# MOELORA_ATTN_SPLIT_MIN_TILES). At batch 64 on 128/128 its split kernel takes 10.7 µs a layer for ~25 MB of K and
# V (5.6 µs at the read bandwidth). (1) One A/B process, 2 rounds, fp8 batch 64, both workloads, 0 and 4 adapters
# (--ab-base): min tiles 1, 8 programs per SM, both; (2) the attention GPU tests of the split rule and kernel.
# Files: ab.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 400 python3 -m moelora bench decode --dtype fp8 --workloads vllm,ctx1024 --batches 64 \
    --adapter-counts 0,4 --ab-rounds 2 --ab-base --out "$OUT/ab" \
    --ab "mt1:MOELORA_ATTN_SPLIT_MIN_TILES=1;sm8:MOELORA_ATTN_SPLITS_PER_SM=8;sm8mt1:MOELORA_ATTN_SPLITS_PER_SM=8,MOELORA_ATTN_SPLIT_MIN_TILES=1" \
    > "$OUT/ab.log" 2>&1
echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^mt1|^sm8" | cut -c1-200
timeout -s INT 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_attention.py \
    -k "split or attn" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
true
