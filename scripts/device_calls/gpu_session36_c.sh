#!/usr/bin/env bash
# Session 36, call C (~5 min): set MOELORA_COMMIT from the dev machine.
#  1. GPU tests: the dense LoRA kernels (tests/test_kernels_lora.py: shrink / expand against the reference at a
#     4096-wide layer's qkv shapes, and the expand at the forced prefill tiles, new).
#  2. bf16 prefill, one process, 0 / 4 adapters: the dense expand's prefill tile (MOELORA_LORA_EXPAND_PREFILL_TILE)
#     at 128x128x8, 128x128x4, 128x64x4, 64x128x4 against the default (64 x 64, 4 warps).
#  3. bf16 prefill profiled at the default: the LoRA tax by kernel with the epilogue.
# Files: tests.log, tile.log/json, prof.log/json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora.py \
    > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
V="t128x8:MOELORA_LORA_EXPAND_PREFILL_TILE=128x128x8;t128x4:MOELORA_LORA_EXPAND_PREFILL_TILE=128x128x4"
V="$V;t128n64:MOELORA_LORA_EXPAND_PREFILL_TILE=128x64x4;t64n128:MOELORA_LORA_EXPAND_PREFILL_TILE=64x128x4"
timeout -s INT 150 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --no-profile --variants "$V" \
    --json "$OUT/tile.json" > "$OUT/tile.log" 2>&1
echo "bf16 prefill, expand tiles (rc $?):"; grep -A12 "^variant " "$OUT/tile.log"; grep -E "Error|Traceback" "$OUT/tile.log" | tail -3
timeout -s INT 80 python3 scripts/profile_prefill.py --dtype bf16 --adapters 0,4 --lines 14 \
    --json "$OUT/prof.json" > "$OUT/prof.log" 2>&1
echo "bf16 prefill profiled (rc $?):"; grep -v "^WARN" "$OUT/prof.log" | grep -A16 "LoRA tax"; grep -A4 "^variant " "$OUT/prof.log"
true
