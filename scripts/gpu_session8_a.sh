#!/usr/bin/env bash
# Planned first call of session 8 on one H200 (~8 minutes). Nothing below has run on a GPU yet.
# Session 7 changed the host side of a graph decode step after its last GPU run: the graph's input tensors built
# with numpy (DecodeGraphs.run -> decode_host_inputs), one token read without concatenating prompt and output,
# no KV allocation call when a step needs no block, and sampling without the [B, V] gather/scatter or
# log-softmax it did not need (scripts/bench_host_step.py on the CPU: batch 256 2.6 -> 0.4 ms, batch 64
# 0.7 -> 0.2 ms a step). Expected on the H200: the step's host part (step - runner, plus the run() inputs
# inside the runner's span) shrinks; tokens/s up a few percent at batch 256.
#  1. GPU tests of what changed: CUDA-graph decode (graphs equal eager, padding, LoRA slots), the engine's
#     overlap test, sampling through the engine (parity tests with graphs), the dense fused qkv test;
#  2. bench decode fp8 and bf16, batch 64 and 256, 0 and 4 adapters, --repeat 2: against the session-6 rows
#     (decode-s6-{bf16,fp8}-...json: fp8 4,709 / 3,730 / 11,284 / 7,968; bf16 3,175 / 2,614 / 10,255 / 7,114).
# Files: tests.log, bench.log, fp8/ bf16/ decode-*.json.
source "$(dirname "$0")/gpu_prelude.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_cuda_graphs.py \
    tests/test_graphs_overlap.py tests/test_parity.py -m gpu > "$OUT/tests.log" 2>&1
# the dense fused qkv GPU test against its rounded-h reference (changed after session 7's last GPU run)
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_lora_fused.py -m gpu \
    -k dense_fused_qwen3_qkv >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | tail -8
for dt in fp8 bfloat16; do
  timeout 150 python3 -m moelora bench decode --dtype $dt --workloads vllm --batches 64,256 --adapter-counts 0,4 \
      --repeat 2 --out "$OUT/${dt/bfloat16/bf16}" >> "$OUT/bench.log" 2>&1
done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|spread|start-up|Error" | cut -c1-200
true
