#!/usr/bin/env bash
# Written at the end of session 31 for session 32's first device call (~2 min + a fresh start): where the ~2.5 µs
# the deferred dense chain costs its GEMM comes from (session 31: not the issue order, not the GEMM's occupancy).
# scripts/bench_defer_chain.py --parts times the GEMM beside (a) a one-element add on the side stream (the fork and
# join alone), (b) the shrink alone, (c) the delta kernel alone, at 64 tokens with 4 and 8 adapters. If (a) is most
# of it, the cost is the graph's cross-stream edges, and a chain without its own stream (e.g. in the GEMM's launch)
# is the thing to build; if (b) or (c), that kernel's SM or memory use. Files: parts.log, parts.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 120 python3 scripts/bench_defer_chain.py --tokens 64 --adapters 4,8 --parts --gemm-too \
    --variants "default:" --json "$OUT/parts.json" > "$OUT/parts.log" 2>&1
echo "dense chain parts, µs a call (rc $?):"; grep -v "^WARN" "$OUT/parts.log" | tail -6

# Session 32: the stages switch's GPU test again (fp8_triton's env read changed after its last GPU run).
python3 -m pytest -q -x -m gpu tests/test_fp8_gpu.py -k decode_stages 2>&1 | tail -3
true
