#!/usr/bin/env bash
# Session 34, call 1 (fresh machine; ~9.5 min). Set MOELORA_COMMIT from the dev machine.
#  1. Session 33's three GPU tests, never run (Qwen2-MoE shared expert on the side stream under graphs; no graph-pool
#     segment on the side streams; a graph batch's padding rows at slot -1), then the whole FP8 GPU file (session 33
#     changed fp8_gemm_config's signature, which every FP8 GEMM reads).
#  2. bench report --parts prefill, bf16 and fp8 (last: session 6, fp8 32,129 against bf16 56,979 tok/s).
#  3. scripts/sweep_fp8_prefill.py --quick at 16,384 tokens.
# Files: tests.log, prefill/ + prefill.log, sweep.json + sweep.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 130 python3 -m pytest -q -m gpu tests/test_graphs_overlap.py -k "shared_expert or padding_rows or allocates_nothing" -rA > "$OUT/tests.log" 2>&1
echo "graph tests (rc $?):"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -6
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_fp8_gpu.py >> "$OUT/tests.log" 2>&1
echo "fp8 gpu tests (rc $?):"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
timeout -s INT 150 python3 -m moelora bench report --parts prefill --models qwen3-30b-a3b --dtypes bf16,fp8 \
    --ranks 16 --no-plot --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
echo "prefill (rc $?):"; grep -E "prefill adapters|Error|Traceback" "$OUT/prefill.log" | tail -8
timeout -s INT 95 python3 scripts/sweep_fp8_prefill.py --quick --tokens 16384 --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep (rc $?):"; tail -25 "$OUT/sweep.log"
true
