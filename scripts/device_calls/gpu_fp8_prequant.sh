#!/usr/bin/env bash
# Device call on one H200 (issue 7): FP8 prefill was 15,345 tok/s against bf16's 56,979 (report of session 5).
# Suspect: the in-kernel activation quantization, repeated by every column tile of every GEMM. This call runs
# the prequant test on the GPU, then prefill (16 x 2,048 tokens, Qwen3-30B-A3B fp8, rank 16, 0/1/4 adapters)
# with MOELORA_FP8_PREQUANT_MIN_ROWS=0 (in the kernel) and =1024 (quantize_act_group once for >= 1,024 rows).
# If faster, make 1024 the default (kernels/fp8_triton.py _PREQUANT_MIN_ROWS). ~3 minutes.
# Files: tests.log, prefill.log, report-*-prequant-{0,1024}.json.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_fp8.py -k "prequantized_inputs" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300
for n in 0 1024; do
  MOELORA_FP8_PREQUANT_MIN_ROWS=$n timeout ${T_P:-150} python3 -m moelora bench report --models qwen3-30b-a3b \
      --dtypes fp8 --ranks 16 --parts prefill --tag prequant-$n --out "$OUT" --no-plot >> "$OUT/prefill.log" 2>&1
done
tr '\r' '\n' < "$OUT/prefill.log" | grep -v '^bench report:' | grep -E "prefill|Error" | tail -12
true
