#!/usr/bin/env bash
# Written in session 33 (no device time: 244 s were left of the 1,800, too few for a fresh start and a run) for the
# next session's first device call (~8 min + a fresh start). Set MOELORA_COMMIT from the dev machine.
#  1. Session 33's three new GPU tests (Qwen2-MoE's shared expert on the side stream under graph capture and no
#     graph-pool segment of the side streams on Qwen3-MoE, SGLang #28091; a graph batch's padding rows at slot -1,
#     SGLang #29157), then the GPU tests near session 33's
#     host-side changes (error classes, the switches' parsing, the graph batch's slot check): the FP8 GPU tests,
#     the command line's errors (those needing a GPU-less machine skip), the switch-parsing tests.
#  2. FP8 prefill against bf16 today (`bench report --parts prefill`, Qwen3-30B-A3B, 16 x 2,048 tokens, 0 / 4
#     adapters): the last figures are session 6's (fp8 32,129 tok/s, bf16 56,979).
#  3. scripts/sweep_fp8_prefill.py: the FP8 GEMM's launch parameters at prefill sizes beside the bf16 GEMM. If a
#     config beats the default clearly, make it fp8_gemm_config's prefill choice, then rerun 2 and the FP8 GPU tests.
#     3b: step 2's fp8 half again with MOELORA_FP8_PREFILL_CONFIG=wide (128 x 128 tiles at 8 warps; session 33, off).
#  4. The bf16 base at today's defaults, batch 64 (last measured in session 8).
# Files: tests.log, prefill/ + prefill.log, sweep.json + sweep.log, prefill-wide/ + prefill-wide.log, bf16/ + bf16.log.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout -s INT 120 python3 -m pytest -q -m gpu tests/test_graphs_overlap.py -k "shared_expert or padding_rows or allocates_nothing" > "$OUT/tests.log" 2>&1
timeout -s INT 200 python3 -m pytest -q -m gpu tests/test_fp8_gpu.py >> "$OUT/tests.log" 2>&1
timeout -s INT 90 python3 -m pytest -q tests/test_cli_errors.py tests/test_switch_env.py tests/test_docs_switches.py \
    "tests/test_fp8.py::test_fp8_prefill_config_wide_gives_the_same_sums" >> "$OUT/tests.log" 2>&1
echo "tests:"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -4
timeout -s INT 200 python3 -m moelora bench report --parts prefill --models qwen3-30b-a3b --dtypes bf16,fp8 \
    --ranks 16 --no-plot --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1
echo "prefill (rc $?):"; grep -E "prefill adapters|Error|Traceback" "$OUT/prefill.log" | tail -8
timeout -s INT 240 python3 scripts/sweep_fp8_prefill.py --tokens 16384 --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep (rc $?):"; grep -E "fp8 default|best|Error|Traceback" "$OUT/sweep.log"
# 3b. End to end with the FP8 GEMMs' prefill tiles at "wide" (MOELORA_FP8_PREFILL_CONFIG, session 33, off), fp8 only.
MOELORA_FP8_PREFILL_CONFIG=wide timeout -s INT 150 python3 -m moelora bench report --parts prefill \
    --models qwen3-30b-a3b --dtypes fp8 --ranks 16 --no-plot --out "$OUT/prefill-wide" > "$OUT/prefill-wide.log" 2>&1
echo "prefill, wide (rc $?):"; grep -E "prefill adapters|Error|Traceback" "$OUT/prefill-wide.log" | tail -4
# 4. bf16 base at today's defaults (last measured in session 8): batch 64, 0 / 4 / 8 adapters, 128/128.
timeout -s INT 150 python3 -m moelora bench decode --dtype bfloat16 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1
echo "bf16 (rc $?):"; grep -v "^WARN" "$OUT/bf16.log" | grep -E "tok/s|Error|Traceback" | cut -c1-190
true
