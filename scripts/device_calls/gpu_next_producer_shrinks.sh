#!/usr/bin/env bash
# For the next device call (written in session 20, which had no device time): the dense-LoRA switches that attack
# what is left of the batch-64 tax that is not bytes (attention-only adapters: +0.67 / +0.89 ms a step with 4 / 8
# adapters for 0.03 / 0.08 ms of bytes; session 19), in ONE bench process (bench decode --ab: same GPU, weights and
# requests, graphs recaptured per variant):
#   norm     MOELORA_LORA_NORM_SHRINK=1    the RMSNorm before qkv writes qkv's LoRA shrink (no shrink launch, no wait)
#   overlap  MOELORA_DENSE_LORA_OVERLAP=1  the qkv / o_proj LoRA chains on the side stream, delta added after
#   both     norm + MOELORA_LORA_ATTN_SHRINK=1 (the decode attention writes o_proj's shrink): no dense shrink launch
#   both0    both + MOELORA_FP8_LORA_SPLIT=0: the GEMM's LoRA tile after its K steps in every tile program (no extra
#            LoRA program, no split-K partial for it) — lost to the LoRA program while it waited for the shrink
#            (session 18: qkv 19.9 against 17.3 µs a call), but with h ready before the GEMM starts it may not
# (MOELORA_LORA_SHRINK_PDL=1 changes nothing once both shrinks come from their producers; measure it alone later)
# (the newest code last: a CUDA error ends the process, and the variants before it keep their rows in ab/)
# (1) the A/B, fp8 128/128 batch 64, 0 / 4 / 8 adapters on all targets (~95 s of compilation first, ~50 s for the
# default's cases, then ~55 s a variant: ~365 s), (2) in the time left, their GPU tests and the default-path ones
# session 19 changed without a run (RMSNorm kernel, attention). Flip a default only if it wins in (1) and its tests
# pass (those (2) does not reach: in the next call). Run with timeout_s=600. Files: bench.log, ab/, tests.log.
source "$(dirname "$0")/../gpu_prelude.sh"
N=MOELORA_LORA_NORM_SHRINK=1; A=MOELORA_LORA_ATTN_SHRINK=1
timeout 390 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 64 --adapter-counts 0,4,8 \
    --ab "norm:$N;overlap:MOELORA_DENSE_LORA_OVERLAP=1;both:$N,$A;both0:$N,$A,MOELORA_FP8_LORA_SPLIT=0" \
    --out "$OUT/ab" > "$OUT/bench.log" 2>&1
echo "bench (rc $?):"; grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|Error|error|Traceback|^A/B|^variant|^default|^norm|^both|^overlap" | cut -c1-190
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_dense_lora_overlap.py \
    tests/test_kernels_attention.py tests/test_kernels_norm.py > "$OUT/tests.log" 2>&1
echo "tests a (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_fp8_gpu.py \
    -k "overlap or shrink_launched_with_pdl or norm_writes or attention_write or norms_and" >> "$OUT/tests.log" 2>&1
echo "tests b (rc $?):"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
true
