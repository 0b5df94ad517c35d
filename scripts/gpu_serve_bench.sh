#!/usr/bin/env bash
# One device call for the server (the wheels the device image lacks carried: `.whl` in the call's carry,
# gpu_prelude.sh): `moelora bench serve` against `moelora serve` at Qwen3-30B-A3B dimensions (dummy FP8 weights,
# the demo's one-token-per-character tokenizer, 4 random rank-16 adapters on q/k/v/o), with prefix caching on and
# off, each on two workloads: every adapter's requests sharing a prefix of SHARED_PREFIX tokens, and nothing shared
# (prompts of about as many tokens); then the GPU tests. JSON and logs go to $OUT.
# Usage: MOELORA_COMMIT=<sha> bash scripts/gpu_serve_bench.sh [pytest files...]
# env: SHARED_PREFIX (1000), NUM_REQUESTS (128), CONCURRENCY (16; a list, "8 16", measures each on the same
# servers), OUTPUT_LEN (32), SERVE_ARGS (extra serve flags,
# default --quantization fp8), PRESET (QWEN3_30B_A3B, or TINY for a check of this script on the CPU with
# SERVE_ARGS="--device cpu" and no tests: `bash scripts/gpu_serve_bench.sh none`). Each server is warmed up with
# both workloads as measured (another seed, not recorded) before its measured runs; each concurrency's runs take
# their own seed (their own prompts and prefixes: nothing cached by an earlier level is hit). Each run's summary
# JSON goes to $OUT/serve-prefix-{on,off}-{shared,unshared}-c<concurrency>.json; a table of them is printed last.
# $OUT/builds_{on,off}.txt: each Triton kernel variant the server built, in order, the measured runs marked.
# The servers' and the runs' logs: $OUT/logs.tgz (a call returns only so many files).
source "$(dirname "$0")/gpu_prelude.sh"  # with the carried wheels
SHARED_PREFIX=${SHARED_PREFIX:-1000}
N=${NUM_REQUESTS:-128}
CS=${CONCURRENCY:-16}
L=${OUTPUT_LEN:-32}
WORK=/tmp/serve-bench
python3 - "$WORK" <<'EOF'
import json, os, shutil, sys
import torch
from safetensors.torch import save_file
from moelora_bench import decode
from moelora.demo import model_path

QWEN3_30B_A3B = getattr(decode, os.environ.get("PRESET", "QWEN3_30B_A3B"))

work = sys.argv[1]
model = os.path.join(work, "model")
os.makedirs(model, exist_ok=True)
with open(os.path.join(model, "config.json"), "w") as f:
    json.dump(QWEN3_30B_A3B, f)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model_path(), name), model)
cfg, r = QWEN3_30B_A3B, 16
H, D = cfg["hidden_size"], cfg.get("head_dim", 128)
shapes = {"q_proj": (H, cfg["num_attention_heads"] * D), "k_proj": (H, cfg["num_key_value_heads"] * D),
          "v_proj": (H, cfg["num_key_value_heads"] * D), "o_proj": (cfg["num_attention_heads"] * D, H)}
for i in range(4):
    g = torch.Generator().manual_seed(i)
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (fin, fout) in shapes.items():
            p = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            t[f"{p}.lora_A.weight"] = (torch.randn(r, fin, generator=g) / fin ** 0.5).bfloat16()
            t[f"{p}.lora_B.weight"] = (torch.randn(fout, r, generator=g) * 0.01).bfloat16()
    folder = os.path.join(work, f"a{i}")
    os.makedirs(folder, exist_ok=True)
    save_file(t, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                   "target_modules": list(shapes)}, f)
print("model and adapters in", work)
EOF
# one server at a time (the memory plan counts every process's use of the GPU, so two servers at once would each
# see the other's weights as their own), caching off first: its warm-up compiles most kernels, Triton's disk cache
# then serves them to the second server
bench() {  # concurrency seed out [bench serve args...]: one `bench serve` run against the server up now
    local C=$1 seed=$2 out=$3; shift 3
    python3 -m moelora bench serve --url http://127.0.0.1:8123 --models a0,a1,a2,a3 --num-requests $N \
        --concurrency $C --output-len $L:$L --seed $seed --no-progress --out "$out" "$@"
}
SHAPES=(shared "--shared-prefix-len $SHARED_PREFIX" unshared "--prompt-len 170:200")
for caching in off on; do
    flag=--enable-prefix-caching; [ $caching = off ] && flag=--no-enable-prefix-caching
    : > "$OUT/serve_$caching.log"  # appended to by the server and by this script's markers
    python3 -m moelora serve "$WORK/model" --load-format dummy ${SERVE_ARGS:---quantization fp8} --max-loras 4 \
        --lora a0=$WORK/a0 --lora a1=$WORK/a1 --lora a2=$WORK/a2 --lora a3=$WORK/a3 --max-model-len 4096 \
        --port 8123 --log-level info --uvicorn-log-level warning $flag >> "$OUT/serve_$caching.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
        curl -sf localhost:8123/health >/dev/null && break
        kill -0 $pid 2>/dev/null || break  # the server exited (its log says why)
        sleep 1
    done
    if ! curl -sf localhost:8123/health >/dev/null; then
        echo "server ($caching) did not start"; tail -5 "$OUT/serve_$caching.log"; kill $pid 2>/dev/null; continue
    fi
    # warm-up, not recorded: each workload as measured (another seed), so that every kernel its chunk sizes and
    # cache hits need is compiled before the measured runs (Triton compiles at first use: seconds a kernel, which
    # 16 warm-up requests left to the first measured run); with caching on, the warm-up's own prefixes are cached
    for C in $CS; do
        for i in 1 3; do bench $C $((1000 + C)) "$WORK/warmup" ${SHAPES[$i]} > /dev/null 2>&1; done
        for i in 0 2; do
            run=$caching-${SHAPES[$i]}-c$C
            rm -rf "$WORK/out-$run"; mkdir -p "$WORK/out-$run"
            echo "== measured run $run" >> "$OUT/serve_$caching.log"
            bench $C $C "$WORK/out-$run" ${SHAPES[$((i + 1))]} > "$OUT/bench-$run.log" 2>&1
            cp "$WORK"/out-$run/serve-*.json "$OUT/serve-prefix-$run.json"
        done
    done
    kill $pid; wait $pid 2>/dev/null
    # the Triton kernel variants the server built (its INFO log), under the measured run they fell in
    grep -E "^== measured run|kernel variant built" "$OUT/serve_$caching.log" \
        | sed -E 's/.*variant built: //' > "$OUT/builds_$caching.txt"
done
python3 - "$OUT" <<'EOF'
import json, sys, glob, os
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "serve-prefix-*.json"))):
    d = json.load(open(f))
    rows[os.path.basename(f)[13:-5]] = d
print(f"{'run':22s} {'TTFT p50 ms':>12s} {'out tok/s':>10s} {'hit rate':>9s} {'errors':>7s} "
      f"{'prefill steps (mean ms)':>24s} {'decode steps (mean ms)':>23s} {'kernels built':>13s}")
for k, d in rows.items():
    pc, st = d.get("prefix_cache") or {}, d.get("steps") or {}
    steps = [f"{st[kind]['steps']} ({st[kind]['mean_ms']})" if kind in st else "-" for kind in ("prefill", "decode")]
    print(f"{k:22s} {d['ttft_ms']['p50']:12.1f} {d['output_tokens_per_s']:10.1f} {str(pc.get('hit_rate')):>9s} "
          f"{d['errors']['count']:7d} {steps[0]:>24s} {steps[1]:>23s} {str(d.get('triton_kernel_builds')):>13s}")
EOF
(cd "$OUT" && tar -czf logs.tgz serve_*.log bench-*.log 2>/dev/null && rm -f serve_*.log bench-*.log)
TESTS=${*:-tests/test_prefix_cache_gpu.py}
[ "$TESTS" = none ] || timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs $TESTS 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|assert" | tail -15
