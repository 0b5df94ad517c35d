#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 11): the full `moelora bench report` split over the two GPUs, one
# process per GPU at the same time (each measures its own GPU's ceilings; the host's CPUs are shared, say so):
#   GPU 0: Qwen3-30B-A3B decode, bf16 and fp8, ranks 16 and 64 (tag qwen3-decode);
#   GPU 1: DeepSeek-V2-Lite decode, bf16 and fp8, rank 16 (tag deepseek-decode), then Qwen3-30B-A3B prefill and
#          transformers + PEFT (tag qwen3-prefill-peft).
# Each stops with SIGINT at its limit and keeps what it measured (the JSON is written after every case).
# Afterwards, here: moelora bench plot OUT/report-*.json --out bench/results. Set MOELORA_COMMIT.
# Files: report-*-{qwen3-decode,deepseek-decode,qwen3-prefill-peft}.json and their logs.
source "$(dirname "$0")/gpu_prelude.sh"
R="python3 -m moelora bench report --out $OUT --no-plot"
CUDA_VISIBLE_DEVICES=0 timeout -s INT ${T_Q:-540} $R --models qwen3-30b-a3b --parts decode --tag qwen3-decode \
    > "$OUT/qwen3-decode.log" 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  timeout -s INT ${T_D:-200} $R --models deepseek-v2-lite --parts decode --ranks 16 --tag deepseek-decode \
      > "$OUT/deepseek-decode.log" 2>&1
  timeout -s INT ${T_P:-320} $R --models qwen3-30b-a3b --dtypes bf16,fp8 --parts prefill,peft \
      --tag qwen3-prefill-peft > "$OUT/qwen3-prefill-peft.log" 2>&1 ) &
wait
for f in "$OUT"/*.log; do echo "== $f"; tr '\r' '\n' < "$f" | grep -v '^bench report:' | grep -E "tok/s|Error" | tail -40; done
