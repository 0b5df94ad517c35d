#!/usr/bin/env bash
# For the next device call (written in session 18, after its device time ran out): the routed-expert LoRA deltas
# in the activations' dtype (MOELORA_LORA_DELTA_DTYPE=activation: the side stream's store-mode deltas and the SiLU /
# combine reads at half the bytes, ~7 MB less traffic a layer at 64 tokens; estimated ~0.08 ms a step at batch 64).
# (1) the GPU tests of the overlapped MoE path and the fused kernels with it on; (2) bench decode fp8 128/128 batch
# 64 and 256, 0 / 4 / 8 adapters, default then with it on (~170 s each). Flip the default if it wins.
# Files: tests.log, bench_{fp32,activation}.log, {fp32,activation}/.
source "$(dirname "$0")/../gpu_prelude.sh"
MOELORA_LORA_DELTA_DTYPE=activation timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/test_kernels_lora_fused.py tests/test_kernels_fused_moe.py tests/test_kernels_moe_lora_grouped.py \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/tests.log" | cut -c1-300 | tail -8
for kind in fp32 activation; do
    MOELORA_LORA_DELTA_DTYPE=$kind timeout 180 python3 -m moelora bench decode --dtype fp8 --workloads vllm \
        --batches 64,256 --adapter-counts 0,4,8 --out "$OUT/$kind" > "$OUT/bench_$kind.log" 2>&1
    echo "delta $kind:"; grep -v "^WARN" "$OUT/bench_$kind.log" | grep -E "tok/s|Error|error|Traceback" | cut -c1-190
done
true
