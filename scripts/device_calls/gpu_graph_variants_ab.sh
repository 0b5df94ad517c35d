#!/usr/bin/env bash
# For a next device call (written in session 18, after its device time ran out): the LoRA graph variants
# (MOELORA_LORA_GRAPH_VARIANTS=1: batches whose adapters adapt only attention / only the routed experts replay a graph
# without the other kind's LoRA kernels). Session 18 measured batch 64 fp8 with attention-only adapters at 11.87 /
# 12.10 ms a step (4 / 8 adapters) against 10.63 with none. (1) the variants' GPU test and the graph tests; (2) bench
# decode fp8 128/128 batch 64, 0 / 4 / 8 adapters on all / attention / experts targets, variants off then on.
# Files: tests.log, bench_{off,on}.log, {off,on}/.
source "$(dirname "$0")/../gpu_prelude.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/test_lora_graph_variants.py \
    tests/test_graphs_overlap.py > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
for v in 0 1; do
    name=$([ $v = 1 ] && echo on || echo off)
    MOELORA_LORA_GRAPH_VARIANTS=$v timeout 200 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
        --batches 64 --adapter-counts 0,4,8 --lora-targets all,attention,experts --out "$OUT/$name" \
        > "$OUT/bench_$name.log" 2>&1
    echo "variants $name:"; grep -v "^WARN" "$OUT/bench_$name.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-200
done
true
