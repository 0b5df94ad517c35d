"""`moelora bench decode`: decode tokens/s and step time at real model dimensions with dummy weights,
beside the byte floor (weights, experts and LoRA factors actually touched, plus KV read, over the measured
HBM copy bandwidth: `floor_ms`; over the measured read-only bandwidth, ~5% higher on the H200: `floor_read_ms`),
with 0..8 distinct rank-r adapters (q/k/v/o and every expert's gate/up/down) spread evenly over the batch.
Also start-up time to the first token and the time to load one adapter from disk.

Workloads: "ctx1024" (decode steps right after 1,024-token prompts) and "vllm" (128-token prompts, 128
generated tokens: the workload FIELD_NOTES.md reports for vLLM 0.26 on an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from moelora.adapters.normalize import ModuleLoRA
from moelora.adapters.registry import LoRAAdapter
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.sampling_params import SamplingParams
from moelora.kernels.config import KernelConfig
from moelora.server.launch import KERNEL_CONFIG_HELP, kernel_config
from moelora_bench.ab import format_ab, parse_ab
from moelora_bench.common import hbm_bandwidth_gbs, hbm_read_bandwidth_gbs, write_result
from moelora_bench.floor import floor_bytes, mean_layer_roles
from moelora_bench.presets import DEEPSEEK_V2_LITE, DEEPSEEK_V2_LITE_TINY, floor_bytes_from_tensors
from moelora_bench.profile import format_profile, format_profile_tax, profile_tax, profile_steps as profile_steps_of
from moelora_bench.trace import format_kernel_bytes

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "dtype": "bfloat16",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "deepseek-v2-lite"],
                   help="model dimensions (default qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="override the layer count (default: the model's, 48)")
    p.add_argument("--batches", default="1,16,64,128", help="decode batch sizes (default 1,16,64,128)")
    p.add_argument("--adapter-counts", default="0,1,4,8", help="distinct adapters per batch (default 0,1,4,8)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default="all",
                   help="what the adapters adapt, a comma list swept in order: all (q/k/v/o and every expert's "
                        "gate/up/down), attention (q/k/v/o only), experts (the routed experts only); the cases with "
                        "adapters run once per entry, the floor counting only the factors adapted (default all)")
    p.add_argument("--expert-lora-layout", default="separate", choices=["separate", "shared-a"],
                   help="the routed experts' gate / up factors of the random adapters: separate (own A each, as "
                        "per-expert gate_proj / up_proj modules give) or shared-a (one A for both, as PEFT's "
                        "target_parameters on fused gate_up experts gives: transformers 5's Qwen3-MoE, OLMoE, ...); "
                        "the floor counts a shared A once (default separate)")
    p.add_argument("--workloads", default="vllm,ctx1024", help="vllm (128 in / 128 out) and/or ctx1024")
    p.add_argument("--decode-steps", type=int, default=32, help="steps timed per ctx1024 case (default 32)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | fp8 | nvfp4 (fp8, nvfp4: bf16 activations "
                   "and LoRA, the base weights quantized from the dummy weights: block-scaled FP8, NVFP4 weight-only)")
    p.add_argument("--device", default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the last one's tokens are read (engine/async_step.py); "
                        "default: the engine's (on for a GPU, off on the CPU)")
    p.add_argument("--lora-overlap", default="on", choices=["on", "off", "both"],
                   help="side-stream LoRA overlap (default on); both: the sweep with it on, then the adapter cases "
                        "again with it off (graphs recaptured)")
    p.add_argument("--kernel-config", type=kernel_config, default=None, metavar="JSON",
                   help=KERNEL_CONFIG_HELP + " The base of every --ab variant.")
    p.add_argument("--ab", default="",
                   help="in-process A/B of kernel configs, 'name:key=value[,key=value];name2:...' with dotted "
                        "KernelConfig fields (e.g. 'early0:moe_lora.early=0;nopdl:fp8.lora_pdl=0'; "
                        "docs/configuration.md lists them): after the sweep with the base config (variant "
                        "'default'), each variant's config is applied to the engine, the graphs recaptured and the "
                        "adapter cases run again; rows carry 'variant' and 'kernel_config' (its fields that differ "
                        "from the defaults), and a table of medians and kept shares ends the run")
    p.add_argument("--ab-rounds", type=int, default=1,
                   help="with --ab: the rotation default, variant 1, ... run this many times (the no-adapter case "
                        "again in each default pass), so drift spreads over every variant (default 1)")
    p.add_argument("--ab-base", action="store_true",
                   help="with --ab: each variant also runs the no-adapter case (for fields that change the base "
                        "step too, such as moe.fused_router); the table then adds each variant's kept share "
                        "against its own no-adapter median ('own')")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="per case, this many decode steps under torch.profiler before the timed ones (not timed): "
                        "the time per kernel and step in the JSON row ('profile') and the largest printed; on a "
                        "GPU also one decoder layer's kernels in order, each with the floor bytes it must read and "
                        "its share of the read bandwidth ('profile.layer', 'profile.layer_bytes'); with "
                        "--ab, each variant's profile also against the default's of the same case "
                        "('profile_vs_default': which kernels its config made slower or faster)")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="with --profile-steps on a GPU: also write each profiled case's kernels (name, stream, start, "
                        "duration) to DIR/trace-<case>.json.gz, for `python -m moelora_bench.trace` (one layer's "
                        "kernels in order, with the gaps between them)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each case this many times (same requests) and report the median by tokens/s, with "
                        "every run's tokens/s in the row ('repeats_tokens_per_s') and the spread printed; "
                        "default 1")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same family (a smoke test of the benchmark)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process per GPU; default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (world = tp x ep; default 1)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV cache bytes per rank (default: the GPU memory plan)")


TINY = {**QWEN3_30B_A3B, "vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 64, "num_experts": 8,
        "num_experts_per_tok": 2}


LORA_TARGET_SETS = ("all", "attention", "experts")


def check_target_set(which: str) -> str:
    if which not in LORA_TARGET_SETS:
        raise ValueError(f"--lora-targets: unknown entry {which!r}; expected a comma list of "
                         f"{', '.join(LORA_TARGET_SETS)}")
    return which


def target_subset(targets: dict, which: str) -> dict:
    """The targets an adapter of `--lora-targets` entry `which` adapts: all of them, the attention projections
    (q/k/v/o: `.self_attn.` in the name) or the routed experts (num_experts set)."""
    check_target_set(which)
    keep = {"all": lambda n, t: True, "attention": lambda n, t: ".self_attn." in n,
            "experts": lambda n, t: t.num_experts is not None}[which]
    return {n: t for n, t in targets.items() if keep(n, t)}


def adapter_name(i: int, which: str) -> str:
    """The bench's i-th adapter of target set `which` (ad{i} for all, ad{i}-{which} otherwise)."""
    return f"ad{i}" if which == "all" else f"ad{i}-{which}"


def random_adapter(name: str, targets, rank: int, seed: int, device, dtype, shared_gate_up_a: bool = False
                   ) -> LoRAAdapter:
    """Random LoRA factors on every target (dense: A [r, in], B [out, r]; experts: [E, r, in], [E, out, r]).
    shared_gate_up_a: each routed-expert up_proj takes its gate_proj's A (PEFT's target_parameters layout)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mods = {}
    for tname, t in targets.items():
        e = () if t.num_experts is None else (t.num_experts,)
        a = torch.randn(*e, rank, t.in_features, generator=gen, device=device, dtype=dtype) * t.in_features**-0.5
        b = torch.randn(*e, t.out_features, rank, generator=gen, device=device, dtype=dtype) * 0.01
        mods[tname] = ModuleLoRA(a, b, 2.0)
    if shared_gate_up_a:
        for tname, m in mods.items():
            gate = tname[: -len("up_proj")] + "gate_proj" if tname.endswith("experts.up_proj") else None
            if gate in mods:
                m.a = mods[gate].a
    return LoRAAdapter(name=name, path="<memory>", modules=mods)


def _host_random_adapter(name: str, targets, rank: int, seed: int, device, dtype,
                         shared_gate_up_a: bool = False) -> LoRAAdapter:
    """random_adapter drawn on `device` (fast; drawing a 1.3 GB adapter with the CPU's randn took minutes
    beside a worker) and returned in host memory, like any registered adapter (a shared A stays one tensor)."""
    ad = random_adapter(name, targets, rank, seed, device, dtype, shared_gate_up_a)
    if shared_gate_up_a:
        host: dict[int, torch.Tensor] = {}
        return LoRAAdapter(ad.name, ad.path, {k: ModuleLoRA(host.setdefault(id(m.a), m.a.cpu()), m.b.cpu(), m.scaling)
                                              for k, m in ad.modules.items()})
    return LoRAAdapter(ad.name, ad.path, {k: ModuleLoRA(m.a.cpu(), m.b.cpu(), m.scaling) for k, m in ad.modules.items()})


def _floor_bytes(engine: LLMEngine, reqs, ctx_len: int, lora_targets: str = "all") -> tuple[int, list[int]]:
    """Bytes one decode step must read, and the experts touched per layer (floor.py; MLA models: counted from
    their tensors, every LoRA target)."""
    if engine.config.mla is not None:
        if lora_targets != "all":
            raise ValueError("--lora-targets other than all: the floor of MLA presets counts every target; "
                             "use --lora-targets all with --preset deepseek-v2-lite")
        return floor_bytes_from_tensors(engine, reqs, ctx_len)
    return floor_bytes(engine, reqs, ctx_len, lora_targets)


class _RunnerTimer:
    """Time of the model runner's execute() per step (the forward and the logits: on a GPU the span between CUDA
    events recorded around it, i.e. device time plus any launch gaps inside; on the CPU wall time). The rest of
    a step's wall time is the engine's host work: scheduling, metadata, sampling, detokenization."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner, self.cuda = engine.runner, engine.device.type == "cuda"
        self.spans: list = []
        self.on = False

    def __enter__(self) -> "_RunnerTimer":
        real = self.runner.execute

        def timed(chunks, *args):
            if not self.on:
                return real(chunks, *args)
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = real(chunks, *args)
                e.record()
                self.spans.append((s, e))
                return out
            t = time.perf_counter()
            out = real(chunks, *args)
            self.spans.append(time.perf_counter() - t)
            return out

        self.runner.execute = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute  # back to the class's method

    def total_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.spans)
        return sum(self.spans) * 1e3


def _case(engine: LLMEngine, batch: int, n_adapters: int, workload: str, steps: int, seed: int,
          profile_steps: int = 0, lora_targets: str = "all", trace_path: str | None = None) -> dict:
    names = [adapter_name(i, lora_targets) for i in range(n_adapters)]
    # ctx1024: enough tokens that no request finishes inside the timed steps (requests whose prefill ended early
    # decode during the later prefill steps), so every timed step holds the whole batch
    prefill_steps = -(-batch * 1024 // engine.args.max_num_batched_tokens) + 2
    prompt_len, gen_len = (128, 128) if workload == "vllm" else (1024, steps + 1 + prefill_steps + profile_steps)
    g = torch.Generator().manual_seed(seed)
    # sampled (not greedy) tokens: a dummy-weight model decoding greedily falls into repeating one token,
    # and identical rows would all route to the same top-k experts; sampling keeps tokens spread over them
    params = SamplingParams(max_tokens=gen_len, temperature=1.0, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=g).tolist()
        rid = f"b{batch}-a{n_adapters}-{workload}-{i}"
        engine.add_request(rid, prompt, params, names[i % n_adapters] if n_adapters else None)
        ids.append(rid)
    while any(len(engine.requests[r].output_ids) == 0 for r in ids):  # prefill
        engine.step()
    prof = profile_steps_of(engine.step, profile_steps, engine.device, trace_path) if profile_steps else None  # untimed
    torch.cuda.synchronize() if engine.device.type == "cuda" else None
    t0, done_steps, tokens = time.perf_counter(), 0, 0
    ahead0 = getattr(engine, "ahead_steps", 0)
    limit = steps if workload == "ctx1024" else 10**9
    routing = None  # each MoE block's routing in the first step that served the whole batch (for the floor)
    with _RunnerTimer(engine) as timer:
        timer.on = True
        while engine.has_unfinished_requests() and done_steps < limit:
            served = len(engine.step())
            tokens += served
            done_steps += 1
            if routing is None and served == batch:
                routing = [(m, m.last_topk_ids[:batch].clone()) for m in engine.model.modules()
                           if getattr(m, "last_topk_ids", None) is not None]
        torch.cuda.synchronize() if engine.device.type == "cuda" else None
        dt = time.perf_counter() - t0
        runner_ms = timer.total_ms() / max(done_steps, 1)
    reqs = [engine.requests[r] for r in ids]
    for module, topk_ids in routing or []:
        module.last_topk_ids = topk_ids
    ctx_len = prompt_len + (gen_len // 2 if workload == "vllm" else steps // 2)
    floor, touched = _floor_bytes(engine, reqs, ctx_len, lora_targets if n_adapters else "all")
    if prof and "layer" in prof and engine.config.mla is None:  # the layer table's bytes (one rank's)
        prof["layer_bytes"] = mean_layer_roles(engine, reqs, ctx_len, lora_targets if n_adapters else "all")
    for r in ids:
        engine.abort_request(r)
        engine.pop_finished(r)
    step_ms = dt / max(done_steps, 1) * 1e3
    return {"batch": batch, "adapters": n_adapters, "workload": workload,
            "lora_targets": lora_targets if n_adapters else None, "tokens_per_s": tokens / dt,
            "step_ms": step_ms, "floor_bytes": floor, "experts_touched": touched, "decode_steps": done_steps,
            "runner_ms": runner_ms, "host_ms": step_ms - runner_ms,
            "ahead_steps": getattr(engine, "ahead_steps", 0) - ahead0, **({"profile": prof} if prof else {})}


def _repeated_case(engine: LLMEngine, batch: int, n_adapters: int, workload: str, steps: int, seed: int,
                   profile_steps: int = 0, repeat: int = 1, lora_targets: str = "all",
                   trace_path: str | None = None) -> dict:
    """_case `repeat` times with the same requests (the profile, if asked, on the first run only); the run with
    the median tokens/s is returned, with every run's tokens/s ('repeats_tokens_per_s') and the spread
    ((max - min) / median, 'repeat_spread') when repeat > 1."""
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    runs = [_case(engine, batch, n_adapters, workload, steps, seed, profile_steps if i == 0 else 0, lora_targets,
                  trace_path if i == 0 else None) for i in range(repeat)]
    if repeat == 1:
        return runs[0]
    tps = [r["tokens_per_s"] for r in runs]
    median = sorted(runs, key=lambda r: r["tokens_per_s"])[(repeat - 1) // 2]
    if "profile" in runs[0]:
        median["profile"] = runs[0]["profile"]
    return {**median, "repeats_tokens_per_s": tps, "repeat_spread": (max(tps) - min(tps)) / median["tokens_per_s"]}


def check_args(args: argparse.Namespace) -> list[tuple[str, KernelConfig]]:
    """The checks across options, before anything is built (a ValueError whose message is one line; `moelora bench
    decode` prints it as a usage error): --repeat, --ab-rounds, --lora-targets and --ab, whose variants (each the
    base --kernel-config with its fields set) are returned."""
    if getattr(args, "repeat", 1) < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if getattr(args, "ab_rounds", 1) < 1:
        raise ValueError(f"--ab-rounds must be at least 1, got {args.ab_rounds}")
    for which in _target_sets(args):
        check_target_set(which)
    variants = parse_ab(getattr(args, "ab", "") or "", getattr(args, "kernel_config", None) or KernelConfig())
    if variants and getattr(args, "tp", 1) * getattr(args, "ep", 1) > 1:
        raise ValueError("--ab compares kernel configs in one process: run it with --tp 1 --ep 1 (the workers of a "
                         "parallel engine keep the config they were built with)")
    return variants


def run(args: argparse.Namespace) -> int:
    variants = check_args(args)  # before the model is built
    presets = {"qwen3-30b-a3b": (QWEN3_30B_A3B, TINY, "Qwen3-30B-A3B"),
               "deepseek-v2-lite": (DEEPSEEK_V2_LITE, DEEPSEEK_V2_LITE_TINY, "DeepSeek-V2-Lite")}
    full, tiny, model_name = presets[getattr(args, "preset", "qwen3-30b-a3b")]
    cfg = dict(tiny if args.tiny else full)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    folder = tempfile.mkdtemp(prefix="moelora-bench-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    batches = [int(b) for b in args.batches.split(",")]
    counts = [int(c) for c in args.adapter_counts.split(",")]
    t0 = time.perf_counter()
    quant = args.dtype if args.dtype in ("fp8", "nvfp4") else None
    tp, ep = getattr(args, "tp", 1), getattr(args, "ep", 1)
    parallel = tp * ep > 1
    kv_bytes = getattr(args, "kv_cache_memory", None)
    engine = LLMEngine(EngineArgs(
        model=folder, max_loras=max(max(counts), 1), max_lora_rank=args.lora_rank,
        dtype="bfloat16" if quant else args.dtype, quantization=quant,
        device=args.device, load_format="dummy", max_num_seqs=max(batches), max_num_batched_tokens=8192,
        max_model_len=2048, enforce_eager=args.enforce_eager, lora_overlap=args.lora_overlap != "off",
        max_graph_batch_size=max(batches), tensor_parallel_size=tp, expert_parallel_size=ep,
        kv_cache_memory_bytes=kv_bytes, async_scheduling=getattr(args, "async_scheduling", None),
        kernel_config=getattr(args, "kernel_config", None),
        kernel_warmup=False,  # each case warms up before it is timed; a start-up warm-up would only add minutes
    ))
    try:
        return _sweep(engine, args, batches, counts, model_name, t0, parallel, variants)
    finally:
        engine.shutdown()


def _sweep(engine: LLMEngine, args: argparse.Namespace, batches: list[int], counts: list[int], model_name: str,
           t0: float, parallel: bool, variants: list[tuple[str, KernelConfig]]) -> int:
    engine.add_request("startup", [1, 2, 3], SamplingParams(max_tokens=1), None)
    while engine.has_unfinished_requests():
        engine.step()
    engine.pop_finished("startup")
    startup_s = time.perf_counter() - t0
    plan = getattr(engine, "memory_plan", None)
    print(f"start-up to first token {startup_s:.1f} s (dummy weights, LoRA slots, "
          f"{'CUDA graphs captured' if engine.runner.graphs is not None else 'eager'}); memory plan (GiB): "
          f"{plan.as_gib() if plan else '-'}", flush=True)
    dev, dt = engine.device, engine.model.dtype
    targets = engine.model.lora_targets()
    target_sets = _target_sets(args)
    for which in target_sets:
        for i in range(max(counts)):
            # drawn on the device (fast), kept on the host like any registered adapter: the KV cache took the
            # GPU memory budget, and the slots hold what the batches use (loaded during prefill, untimed)
            host = _host_random_adapter(adapter_name(i, which), target_subset(targets, which), args.lora_rank, i,
                                        dev, dt, args.expert_lora_layout == "shared-a")
            if parallel:  # every rank loads it from disk (the workers take adapters by path) and keeps its shard
                engine.load_adapter(host.name, _write_peft_adapter(engine, host, args.lora_rank))
            else:
                engine.registry.register(host)
    load_s, adapter_bytes = _adapter_load_time(engine, targets, args.lora_rank)
    print(f"one adapter ({adapter_bytes / 1e9:.2f} GB, rank {args.lora_rank}) loaded from disk in {load_s:.2f} s",
          flush=True)
    bw = hbm_bandwidth_gbs() if dev.type == "cuda" else None
    read_bw = hbm_read_bandwidth_gbs() if dev.type == "cuda" else None
    rows = []
    head = {"hbm_gbs": bw, "hbm_read_gbs": read_bw, "startup_to_first_token_s": startup_s, "adapter_load_s": load_s,
            "adapter_bytes": adapter_bytes, "graphs": engine.runner.graphs is not None,
            "memory_plan_gib": plan.as_gib() if plan else None,
            "tensor_parallel_size": engine.args.tensor_parallel_size,
            "expert_parallel_size": engine.args.expert_parallel_size, "expert_lora_layout": args.expert_lora_layout,
            "kernel_config": engine.kernel_config.diff()}
    if parallel:
        head["floor_note"] = ("the floor of a sharded run: the bytes of the rank that reads the most (its shard of "
                              "attention, dense LoRA and lm_head, its KV heads, its own touched experts and their "
                              "LoRA pairs) at one GPU's bandwidth; MLA models have none yet")
    overlaps = [True, False] if args.lora_overlap == "both" else [args.lora_overlap == "on"]
    cases = [(o, w, b, n, t) for o in overlaps for w in args.workloads.split(",") for b in batches
             for n in counts for t in (target_sets if n else target_sets[:1]) if o == overlaps[0] or n > 0]
    base = engine.kernel_config
    plan = [("default", base, 0, cases)]
    for rnd in range(getattr(args, "ab_rounds", 1) if variants else 0):
        if rnd:  # the default again, its no-adapter case included: drift shows there
            plan.append(("default", base, rnd, [c for c in cases if c[0] == overlaps[0]]))
        with_base = getattr(args, "ab_base", False)
        plan += [(name, cfg, rnd, [c for c in cases if c[0] == overlaps[0] and (c[3] > 0 or with_base)])
                 for name, cfg in variants]
    for variant, cfg, rnd, variant_cases in plan:
        if variants and (variant != "default" or rnd > 0):  # the first default pass runs as built
            engine.model.set_overlap(variant_cases[0][0] and engine.device.type == "cuda")
            engine.reconfigure(cfg)  # the layers' choices and the side stream; the graphs recaptured
            print(f"--- variant {variant} (round {rnd + 1}): {cfg.diff(base) or 'the base config'}", flush=True)
        for case in variant_cases:
            _run_row(engine, args, case, rows, head, bw, parallel, model_name,
                     dict(variant=variant, kernel_config=cfg.diff(), ab_round=rnd) if variants else {})
    if variants:
        print(format_ab(rows), flush=True)
    path = write_result("decode", {**head, "rows": rows}, args.out)
    print(f"results: {path}")
    return 0


def _run_row(engine: LLMEngine, args: argparse.Namespace, case: tuple, rows: list[dict], head: dict,
             bw: float | None, parallel: bool, model_name: str, tags: dict) -> None:
    """One case of the sweep: run it (recapturing first if its overlap differs), append its row (with `tags`), write
    the JSON, print the line (and its profile)."""
    overlap, workload, batch, n, which = case
    if (overlap and engine.device.type == "cuda") != engine.model.lora_overlap_state():
        _recapture(engine, overlap)
    trace_dir = getattr(args, "profile_trace", None)
    trace = None
    if trace_dir and getattr(args, "profile_steps", 0) and engine.device.type == "cuda":
        trace = os.path.join(trace_dir, f"trace-{workload}-b{batch}-a{n}-{which if n else 'none'}"
                             f"{'' if overlap else '-serial'}"
                             f"{'-' + tags['variant'] + str(tags['ab_round']) if tags else ''}.json.gz")
    r = _repeated_case(engine, batch, n, workload, args.decode_steps, seed=batch * 31 + n,
                       profile_steps=getattr(args, "profile_steps", 0), repeat=getattr(args, "repeat", 1),
                       lora_targets=which, trace_path=trace)
    if trace:
        r["profile_trace"] = os.path.basename(trace)
    r.update(tags)
    r.update(model=(f"tiny {model_name}" if args.tiny else model_name)
             + ("" if not args.layers else f" ({args.layers} layers)")
             + (f" tp{engine.args.tensor_parallel_size} ep{engine.args.expert_parallel_size}" if parallel else ""),
             dtype=args.dtype, rank=args.lora_rank if n else 0, lora_overlap=overlap,
             async_scheduling=engine.async_scheduling)
    if parallel and engine.config.mla is not None:
        r["floor_bytes"] = None
    r["floor_ms"] = r["floor_bytes"] / (bw * 1e9) * 1e3 if bw and r["floor_bytes"] else None
    read_bw = head.get("hbm_read_gbs")  # the same bytes at the read-only bandwidth: the tighter floor
    r["floor_read_ms"] = r["floor_bytes"] / (read_bw * 1e9) * 1e3 if read_bw and r["floor_bytes"] else None
    rows.append(r)
    write_result("decode", {**head, "rows": rows}, args.out)  # after every row: a cut-off run keeps its rows
    fl = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.2f} ms"
    if r["floor_read_ms"] is not None:
        fl += f" ({r['floor_read_ms']:.2f} read)"
    label = (("" if overlap else " (overlap off)")
             + (f" ({which} only)" if n and which != "all" else "")
             + (f" [{tags['variant']}]" if tags else ""))
    reps = r.get("repeats_tokens_per_s")
    spread = f"  median of {len(reps)}, spread {r['repeat_spread']:.1%}" if reps else ""
    print(f"{workload:8s} batch {batch:4d} adapters {n}{label}: {r['tokens_per_s']:9.1f} tok/s  step "
          f"{r['step_ms']:7.2f} ms (runner {r['runner_ms']:.2f})  floor {fl}  "
          f"experts/layer {sum(r['experts_touched']) / max(len(r['experts_touched']), 1):.1f}{spread}"
          + (f"  ahead {r['ahead_steps']}/{r['decode_steps']}" if engine.async_scheduling else ""),
          flush=True)
    if "profile" in r:
        print(format_profile(r["profile"]), flush=True)
        if "layer_bytes" in r["profile"]:
            print(format_kernel_bytes(r["profile"]["layer"], r["profile"]["layer_bytes"], read_bw), flush=True)
        base = next((q for q in rows if q is not r and q["adapters"] == 0 and q["batch"] == batch
                     and q.get("workload") == r.get("workload") and "profile" in q), None)
        if n and base is not None:  # the same batch without adapters was profiled: where the tax goes
            r["profile_tax"] = profile_tax(base["profile"], r["profile"])
            print(format_profile_tax(r["profile_tax"]), flush=True)
        ref = _ab_reference(rows, r)
        if ref is not None:  # an --ab variant: which kernels its config made slower or faster
            r["profile_vs_default"] = profile_tax(ref["profile"], r["profile"])
            print(format_profile_tax(r["profile_vs_default"], title=f"{tags['variant']} against the default"),
                  flush=True)
        if "profile_tax" in r or ref is not None:
            write_result("decode", {**head, "rows": rows}, args.out)


def _ab_reference(rows: list[dict], r: dict) -> dict | None:
    """For a profiled row of an --ab variant: the profiled row of the default's first run of the same case
    (workload, batch, adapters, targets, overlap), or None."""
    if r.get("variant") in (None, "default"):
        return None
    case = ("workload", "batch", "adapters", "lora_targets", "lora_overlap")
    return next((q for q in rows if q.get("variant") == "default" and "profile" in q
                 and all(q.get(k) == r.get(k) for k in case)), None)


def _target_sets(args: argparse.Namespace) -> list[str]:
    return [t.strip() for t in getattr(args, "lora_targets", "all").split(",") if t.strip()] or ["all"]


def _recapture(engine: LLMEngine, overlap: bool) -> None:
    """Switch the side-stream overlap and capture the decode graphs again (they record the streams used)."""
    engine.model.set_overlap(overlap and engine.device.type == "cuda")
    if engine.runner.graphs is not None:
        engine.runner.graphs.recapture()


def _write_peft_adapter(engine: LLMEngine, ad: LoRAAdapter, rank: int) -> str:
    """Write an adapter in PEFT's layout (2-D keys for dense targets, target_parameters for the fused experts)
    to a new temporary folder; returns the folder."""
    tensors = {}
    for name, mod in ad.modules.items():
        if mod.a.dim() == 2:
            tensors[f"base_model.model.{name}.lora_A.weight"] = mod.a
            tensors[f"base_model.model.{name}.lora_B.weight"] = mod.b
    E = engine.config.num_experts
    for i in range(engine.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        g, u, d = ad.modules.get(f"{p}.gate_proj"), ad.modules.get(f"{p}.up_proj"), ad.modules.get(f"{p}.down_proj")
        if g is None:
            continue
        tensors[f"base_model.model.{p}.base_layer.lora_A.weight"] = g.a.reshape(E * rank, -1)  # [r*E, H]
        b = torch.cat([g.b, u.b], dim=1)  # [E, 2I, r] -> [2I, r*E], columns j*E + e
        tensors[f"base_model.model.{p}.base_layer.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
        tensors[f"base_model.model.{p}.lora_A.weight"] = d.a.reshape(E * rank, -1)
        tensors[f"base_model.model.{p}.lora_B.weight"] = d.b.permute(1, 2, 0).reshape(d.b.shape[1], -1).contiguous()
    folder = tempfile.mkdtemp(prefix="moelora-adapter-")
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return folder


def _adapter_load_time(engine: LLMEngine, targets, rank: int) -> tuple[float, int]:
    """Write one random adapter in PEFT's target_parameters layout, then time reading, validating and
    copying it into a slot."""
    ad = _host_random_adapter("disk", targets, rank, 99, engine.device, torch.bfloat16)
    folder = _write_peft_adapter(engine, ad, rank)
    nbytes = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
    t0 = time.perf_counter()
    engine.load_adapter("from_disk", folder)
    engine.pool.acquire(engine.registry.get("from_disk"))
    engine.pool.release("from_disk")
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    engine.unload_adapter("from_disk")
    return dt, nbytes
