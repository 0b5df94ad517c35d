#!/usr/bin/env bash
# Session 39, call B (~7 min on a fresh machine): the grouped FP8 expert GEMM's decode tile
# (MOELORA_FP8_EXPERT_DECODE_TILE). Call A measured a plain read at 4,496 GB/s on the H200; gate_up at 64 tokens
# streams its touched weights at 88% of that (down 84%), and session 8 swept only 64- and 128-wide tiles.
# (1) GPU tests: every tile bit-equal to the default at Qwen3 shapes (3 / 64 / 256 tokens), the read-bandwidth
#     kernel compiled; (2) scripts/sweep_fp8_gemm.py over the tiles, gate_up and down at 64 and 256 tokens;
# (3) if a tile beats the default at 64 tokens by more than 1% (gate_up + down), one A/B process, 2 rounds, fp8
#     128/128 batch 64, 0 and 4 adapters (--ab-base), with the two best tiles.
# Files: tests.log, sweep.log, sweep.json, ab.log, ab/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8_gpu.py \
    tests/test_bench_bandwidth.py -k "decode_tiles_are_bit_equal or read_words" > "$OUT/tests.log" 2>&1
echo "GPU tests (rc $?):"; grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | cut -c1-250 | tail -8
timeout -s INT 170 python3 scripts/sweep_fp8_gemm.py --tokens 64,256 --cases gate_up,down --json "$OUT/sweep.json" \
    > "$OUT/sweep.log" 2>&1
echo "sweep (rc $?):"; grep -v "^WARN\|Warning\|warn(" "$OUT/sweep.log" | cut -c1-200
AB=$(python3 - "$OUT/sweep.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = [r for r in d["rows"] if r["tokens"] == 64]
default = sum({r["case"]: r["default_us"] for r in rows}.values())
tiles = {}
for r in rows:
    tiles.setdefault(f"{r['block_n']}x{r['num_warps']}x{r['num_stages']}", {})[r["case"]] = r["us"]
tot = sorted((sum(v.values()), t) for t, v in tiles.items() if len(v) == 2)
best = [t for s, t in tot[:2] if s < 0.99 * default]
print(f"# default {default:.1f} us; best {tot[:3]}", file=sys.stderr)
print(";".join(f"t{t}:MOELORA_FP8_EXPERT_DECODE_TILE={t}" for t in best))
PY
)
echo "A/B variants: '${AB}'"
if [ -n "$AB" ]; then
  timeout -s INT 260 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4 \
      --ab-rounds 2 --ab-base --out "$OUT/ab" --ab "$AB" > "$OUT/ab.log" 2>&1
  echo "A/B (rc $?):"; grep -v "^WARN" "$OUT/ab.log" | grep -E "Error|Traceback|^A/B|^variant|^default|^t[0-9]|floor" | cut -c1-200 | tail -16
fi
true
