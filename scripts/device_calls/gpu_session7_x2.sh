#!/usr/bin/env bash
# Session 7, second call on nvidia-h200-x2 (issue 10). The first call (gpu_ep_drop.sh) ran EP=2 with the non-local
# pairs left out (on) but its off run, the 2-GPU on/off test and tp2 at batch 256 ran past their time limits.
#  1. bench decode --ep 2, pairs left out off then on again (the same machine, back to back), batch 64 and 256,
#     0 and 4 adapters;
#  2. the 2-GPU test that leaving the pairs out changes nothing (bf16, graphs and overlap on);
#  3. scripts/bench_ep_collectives.py: all-reduce vs all-gather/reduce-scatter vs all-to-all at decode sizes.
# Files: bench.log, tests.log, coll.log, ep2-off/ ep2-on/ coll/ *.json.
source "$(dirname "$0")/../gpu_prelude.sh"
for on in 0 1; do
  d=$([ $on = 1 ] && echo on || echo off)
  MOELORA_EP_DROP_NONLOCAL=$on timeout ${T_EP2:-170} python3 -m moelora bench decode --workloads vllm --batches 64,256 \
      --adapter-counts 0,4 --ep 2 --out "$OUT/ep2-$d" >> "$OUT/bench.log" 2>&1
done
grep -v "^WARN" "$OUT/bench.log" | grep -E "tok/s|start-up|Error" | cut -c1-200
timeout ${T_COLL:-60} python3 scripts/bench_ep_collectives.py --out "$OUT/coll" > "$OUT/coll.log" 2>&1; tail -10 "$OUT/coll.log"
timeout ${T_PAR:-200} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_parallel_gpu.py \
    -k "leaving_out_nonlocal" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300
true
