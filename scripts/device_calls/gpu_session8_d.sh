#!/usr/bin/env bash
# Session 8, fourth call (one H200, ~6 minutes): call 3 (6b84b79) hit "an illegal memory access" in bench decode
# fp8 at batch 256 with 8 adapters (after batch 64 0/4/8 and 256 0/4 ran). Reproduce it alone, then bisect with
# the new switches: MOELORA_FP8_SPLIT_K=0 (dense split-K off), MOELORA_FP8_PRODUCER_QUANT=0 (norm / SiLU
# quantization off); last, eager with CUDA_LAUNCH_BLOCKING=1 to name the kernel.
source "$(dirname "$0")/../gpu_prelude.sh"
run() {  # name, adapter counts, extra flag ('-' for none), env...
  local name=$1 counts=$2 flag=$3; shift 3
  [ "$flag" = - ] && flag=
  env "$@" timeout 120 python3 -m moelora bench decode --dtype fp8 --workloads vllm --batches 256 \
      --adapter-counts "$counts" $flag --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name ($*): rc $? $(grep -E 'tok/s' "$OUT/$name.log" | cut -c1-110) $(grep -m1 -E 'Error' "$OUT/$name.log" | cut -c1-100)"
}
run repro 4,8 - A=1
run split_off 8 - MOELORA_FP8_SPLIT_K=0
run producer_off 8 - MOELORA_FP8_PRODUCER_QUANT=0
grep -q "illegal" "$OUT/repro.log" && run eager_blocking 8 --enforce-eager CUDA_LAUNCH_BLOCKING=1
grep -B12 -m1 "illegal" "$OUT/eager_blocking.log" 2>/dev/null | grep -E "File|Error" | tail -8 | cut -c1-200
true
