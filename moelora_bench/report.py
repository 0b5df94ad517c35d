"""`moelora bench report`: one command for the numbers a user chooses a server by, on the GPU at hand.

1. ceilings: HBM copy bandwidth (GB/s) and dense matmul throughput (TFLOP/s, bf16 and fp8 when available);
2. decode sweeps with the `bench decode` machinery (dummy weights at real dimensions): batch x distinct
   adapters x rank x dtype x model, each step beside its byte floor;
3. prefill throughput (2k-token prompts) beside its FLOP floor;
4. the same mixed-adapter decode workload on transformers + PEFT (`baseline_hf.py`).

Each engine is built once per (model, dtype, rank) and serves every case of that triple. The JSON
(`bench/results/report-<date>-<device>.json`) is rewritten after every case, so a run cut short keeps what
it measured; `moelora bench plot` draws the PNGs from one or more such files.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time

import torch

from moelora.config import ModelConfig
from moelora.engine.kv_cache import KVCache
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.sampling_params import SamplingParams
from moelora.models.loader import build_model
from moelora.server.launch import KERNEL_CONFIG_HELP, kernel_config
from moelora_bench import decode, presets
from moelora_bench.baseline_hf import run_peft_baseline
from moelora_bench.common import hbm_bandwidth_gbs, time_ms, write_result
from moelora_bench.figures import add_kept, floor_ms, matmul_flops, mean, prefill_flop_floor_s, step_over_floor
from moelora_bench.plot import plot_files
from moelora_bench.summary import markdown

LABELS = {"deepseekv2lite": "DeepSeek-V2-Lite"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
QUANTIZED = {"fp8": 1.0, "nvfp4": 0.5625}  # base-weight bytes per element (nvfp4: 4 bits + an e4m3 scale per 16)


def engine_dtype(dtype: str) -> dict:
    """EngineArgs fields for a report dtype: bf16/fp16/fp32 directly; fp8/nvfp4 as a quantized base with bf16
    activations and LoRA (EngineArgs.quantization), or passed as the dtype (and refused) where the engine
    has no quantization field."""
    if dtype in QUANTIZED:
        if "quantization" in {f.name for f in dataclasses.fields(EngineArgs)}:
            return {"dtype": "bfloat16", "quantization": dtype}
        return {"dtype": dtype}
    return {"dtype": DTYPES.get(dtype, dtype)}

# grids: (quick, full, tiny); a command-line option replaces one entry
GRIDS: dict[str, dict] = {
    "full": dict(models="qwen3-30b-a3b,deepseek-v2-lite", dtypes="bf16,fp8", ranks="16,64",
                 batches="1,16,64,128,256", adapter_counts="0,1,4,8,32", workload="vllm", decode_steps=32,
                 prefill_prompts=16, prefill_len=2048, prefill_adapters="0,1,4", hf_layers=12,
                 hf_batches="1,16,64,128", hf_adapter_counts="0,1,4,8", hf_new_tokens=32),
    "quick": dict(models="qwen3-30b-a3b", dtypes="bf16", ranks="16", batches="1,16,64", adapter_counts="0,1,4,8",
                  workload="vllm", decode_steps=32, prefill_prompts=8, prefill_len=2048, prefill_adapters="0,4",
                  hf_layers=6, hf_batches="1,16,64", hf_adapter_counts="0,1,4", hf_new_tokens=16),
    "tiny": dict(models="qwen3-30b-a3b", dtypes="bf16,fp8", ranks="4", batches="1,3", adapter_counts="0,1,2",
                 workload="ctx", decode_steps=3, prefill_prompts=2, prefill_len=64, prefill_adapters="0,2",
                 hf_layers=2, hf_batches="1,3", hf_adapter_counts="0,2", hf_new_tokens=3),
}
RESERVE_BYTES = 8 << 30  # GPU memory left for activations, CUDA graphs and the allocator's slack


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a subset (Qwen3-30B-A3B, bf16, rank 16, batch 1/16/64 x 0/1/4/8 adapters; transformers + "
                        "PEFT at 6 of 48 layers): about three minutes on an H200")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same family: a smoke test on the CPU")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and the plots (default %(default)s)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    p.add_argument("--parts", default="decode,prefill,peft",
                   help="what to run, a comma list of decode, prefill, peft (default: all; the ceilings always)")
    p.add_argument("--models", default=None, help="comma list of qwen3-30b-a3b, deepseek-v2-lite")
    p.add_argument("--dtypes", default=None,
                   help="comma list of bf16, fp8, nvfp4 (base weights; activations and LoRA bf16); default bf16,fp8 "
                        "(--quick: bf16); one the engine refuses is skipped with a note")
    p.add_argument("--ranks", default=None, help="LoRA ranks (default 16,64; --quick 16)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64,128,256)")
    p.add_argument("--adapter-counts", default=None, help="distinct adapters per batch (default 0,1,4,8,32)")
    p.add_argument("--workload", choices=["vllm", "ctx"], default=None,
                   help="vllm: 128-token prompts, 128 generated (as FIELD_NOTES' vLLM runs; default); ctx: "
                        "--decode-steps steps after 1,024-token prompts")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per ctx case")
    p.add_argument("--prefill-prompts", type=int, default=None, help="prompts per prefill case (default 16)")
    p.add_argument("--prefill-len", type=int, default=None, help="prefill prompt length in tokens (default 2048)")
    p.add_argument("--hf-layers", type=int, default=None,
                   help="layers of the transformers + PEFT model (default 12; --quick 6); its tokens/s is scaled "
                        "to the full layer count and both figures are kept")
    p.add_argument("--hf-mode", choices=["default", "static"], default="default",
                   help="transformers generate(): default (dynamic cache) or static (static cache + torch.compile, "
                        "compiles once per batch shape)")
    p.add_argument("--tag", default=None,
                   help="suffix of the JSON's name (report-<date>-<device>-TAG.json), for the parts of a split run")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNGs at the end")
    p.add_argument("--kernel-config", type=kernel_config, default=None, metavar="JSON",
                   help=KERNEL_CONFIG_HELP + " Every engine of the report takes it.")


def _grid(args: argparse.Namespace) -> dict:
    g = dict(GRIDS["tiny" if args.tiny else "quick" if args.quick else "full"])
    for k in g:
        v = getattr(args, k, None)
        if v is not None:
            g[k] = v
    ints = lambda s: [int(x) for x in str(s).split(",") if x != ""]  # noqa: E731
    for k in ("ranks", "batches", "adapter_counts", "prefill_adapters", "hf_batches", "hf_adapter_counts"):
        g[k] = ints(g[k])
    g["models"] = [m for m in g["models"].split(",") if m]
    g["dtypes"] = [d for d in g["dtypes"].split(",") if d]
    g["parts"] = set(args.parts.split(","))
    return g


# ---- models -------------------------------------------------------------------------------------------------
def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _preset(name: str, tiny: bool) -> dict | None:
    """An HF config dict from moelora_bench/presets.py: the constant named like the model (DEEPSEEK_V2_LITE,
    with _TINY for --tiny), or an entry of a PRESETS / TINY_PRESETS table; None if there is none."""
    const = "".join(c if c.isalnum() else "_" for c in name).upper() + ("_TINY" if tiny else "")
    if isinstance(getattr(presets, const, None), dict):
        return dict(getattr(presets, const))
    table = getattr(presets, "TINY_PRESETS" if tiny else "PRESETS", None) or {}
    for key, cfg in table.items():
        if _norm(key) == _norm(name):
            return dict(cfg.get("config", cfg))
    return None


def model_configs(names: list[str], tiny: bool) -> tuple[list[tuple[str, dict]], list[str]]:
    """[(label, HF config dict)] for the names asked; notes for those not available."""
    out, notes = [], []
    for name in names:
        if _norm(name) == _norm("qwen3-30b-a3b"):
            cfg = decode.TINY if tiny else decode.QWEN3_30B_A3B
            out.append(("tiny Qwen3-MoE" if tiny else "Qwen3-30B-A3B", dict(cfg)))
            continue
        cfg = _preset(name, tiny)
        if cfg is None:
            notes.append(f"model {name!r}: no preset for it in moelora_bench/presets.py; skipped")
        else:
            out.append((("tiny " if tiny else "") + LABELS.get(_norm(name), name), cfg))
    return out, notes


def _write_config(cfg: dict) -> str:
    folder = tempfile.mkdtemp(prefix="moelora-report-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


# ---- ceilings -----------------------------------------------------------------------------------------------
def bandwidth_gbs(device: torch.device) -> float:
    """Copy bandwidth of the device (bytes read + written per second, GB/s)."""
    if device.type == "cuda":
        return hbm_bandwidth_gbs()
    src = torch.randn(16 << 20)  # 64 MB on the CPU
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def matmul_tflops(device: torch.device, dtype: str) -> float | None:
    """Dense n^3 matmul TFLOP/s (n = 8192 on a GPU, 512 on the CPU); fp8 through torch._scaled_mm with
    per-tensor scales; None where the device or this torch cannot run it."""
    n = 8192 if device.type == "cuda" else 512
    try:
        if dtype == "fp8":
            if device.type != "cuda":
                return None
            a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
            one = torch.ones((), device=device)
            fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        else:
            dt = torch.bfloat16 if device.type == "cuda" else torch.float32
            a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
            fn = lambda: a @ b  # noqa: E731
        return matmul_flops(n, n, n) / (time_ms(fn) * 1e-3) / 1e12
    except (RuntimeError, TypeError, AttributeError):
        return None


# ---- engines ------------------------------------------------------------------------------------------------
def _meta_sizes(folder: str, dtype: str, rank: int) -> dict:
    """Weight bytes, one LoRA slot's bytes and active parameters per token, from a model on the meta device."""
    cfg = ModelConfig.from_pretrained(folder)
    m = build_model(cfg, None, dtype="bfloat16", device="meta", load_format="none", max_loras=1, max_lora_rank=rank)
    weights = active = 0
    for name, p in m.named_parameters():
        quantized = dtype in QUANTIZED and p.dim() >= 2 and "embed" not in name and "lm_head" not in name
        weights += p.numel() * (QUANTIZED[dtype] if quantized else 2)
        if "embed" in name or "lm_head" in name:
            continue
        routed = ".experts." in name and "shared" not in name
        active += p.numel() * (cfg.num_experts_per_tok / cfg.num_experts if routed else 1)
    slot = sum(b.numel() * 2 for n, b in m.named_buffers() if n.endswith((".a", ".b_cat")))
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim  # x context: QK^T and PV per token
    return {"weight_bytes": weights, "slot_bytes": slot, "active_params": active, "attn_flops_per_ctx": attn}


def _kv_bytes(folder: str, dtype: str, tokens: int, block_size: int = 16) -> int:
    cfg = ModelConfig.from_pretrained(folder)
    kv_dtype = torch.bfloat16 if dtype in QUANTIZED or dtype == "bfloat16" else getattr(torch, dtype)
    return KVCache.bytes_per_block(cfg, block_size, kv_dtype) * (-(-tokens // block_size))


def _slots_that_fit(device: torch.device, sizes: dict, kv_bytes: int, wanted: int) -> int:
    """LoRA slots that fit beside the weights, the KV cache, one set of random factors and a reserve."""
    if device.type != "cuda":
        return wanted
    total = torch.cuda.get_device_properties(device).total_memory
    free = total - sizes["weight_bytes"] - kv_bytes - RESERVE_BYTES - sizes["slot_bytes"]
    return max(0, min(wanted, int(free // sizes["slot_bytes"])))


def _build_engine(folder: str, dtype: str, rank: int, slots: int, g: dict, device: torch.device,
                  kv_bytes: int | None) -> LLMEngine:
    max_seqs = max(max(g["batches"]), g["prefill_prompts"])
    return LLMEngine(EngineArgs(
        model=folder, max_loras=max(slots, 1), max_lora_rank=rank, **engine_dtype(dtype),
        device=str(device), load_format="dummy", max_num_seqs=max_seqs, max_num_batched_tokens=8192,
        max_model_len=max(g["prefill_len"], _ctx_len(g)) + 64, kv_cache_memory_bytes=kv_bytes,
        max_graph_batch_size=max(g["batches"]), kernel_config=g.get("kernel_config"),
        max_prefill_graph_tokens=g.get("max_prefill_graph_tokens", EngineArgs.max_prefill_graph_tokens),
        kernel_warmup=False,  # each case runs its own warm-up pass before the timed one
    ))


def _ctx_len(g: dict) -> int:
    """Tokens a decode sequence holds at most: prompt + generated."""
    if g["workload"] == "vllm":
        return 256
    return 1024 + g["decode_steps"] + 1


def _register_adapters(engine: LLMEngine, count: int, rank: int) -> None:
    """`count` adapters named ad0.. sharing one set of random factors (values do not change the speed;
    each adapter still gets its own slot)."""
    dtype = engine.model.dtype
    if not dtype.is_floating_point or dtype.itemsize < 2:  # a quantized base: LoRA factors stay bf16
        dtype = torch.bfloat16
    factors = decode.random_adapter("factors", engine.model.lora_targets(), rank, 0, engine.device, dtype)
    for i in range(count):
        engine.registry.register(decode.LoRAAdapter(name=f"ad{i}", path="<memory>", modules=factors.modules))


def _drop_requests(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
        engine.pop_finished(rid)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill_case(engine: LLMEngine, prompts: int, prompt_len: int, n_adapters: int, seed: int) -> dict:
    """Prefill tokens/s: `prompts` prompts of `prompt_len` tokens (adapters spread round-robin), each
    generating one token; timed from the first step until all have finished."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(prompts):
        rid = f"prefill-{seed}-{n_adapters}-{i}"
        prompt = torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(rid, prompt, params, f"ad{i % n_adapters}" if n_adapters else None)
        ids.append(rid)
    _sync(engine.device)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine.device)
    dt = time.perf_counter() - t0
    for rid in ids:
        engine.pop_finished(rid)
    return {"prompts": prompts, "prompt_len": prompt_len, "adapters": n_adapters, "seconds": dt,
            "tokens_per_s": prompts * prompt_len / dt}


# ---- the sweep ----------------------------------------------------------------------------------------------
class Report:
    """The JSON being built; saved after every case."""

    def __init__(self, out_dir: str, settings: dict, tag: str | None = None) -> None:
        self.out_dir = out_dir
        self.suffix = f"-{tag}" if tag else ""
        self.data: dict = {"settings": settings, "notes": [], "ceilings": {}, "engines": [], "decode": [],
                           "prefill": [], "peft": None}
        self.path: str | None = None
        self.t0 = time.perf_counter()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def save(self) -> str:
        add_kept(self.data["decode"])
        add_kept(self.data["prefill"])
        self.data["elapsed_s"] = time.perf_counter() - self.t0
        self.path = write_result("report", self.data, self.out_dir, self.suffix)
        return self.path


def _engine_case_count(g: dict) -> int:
    decode_cases = len(g["batches"]) * len(g["adapter_counts"]) * ("decode" in g["parts"])
    return decode_cases + len(g["prefill_adapters"]) * ("prefill" in g["parts"])


def _case_count(g: dict, n_models: int) -> int:
    peft = len(g["hf_batches"]) * len(g["hf_adapter_counts"]) * ("peft" in g["parts"])
    return n_models * len(g["dtypes"]) * len(g["ranks"]) * _engine_case_count(g) + peft


def run_report(args: argparse.Namespace) -> str:
    """Run the sweep; returns the JSON path."""
    from tqdm import tqdm

    g = _grid(args)
    g["tiny"] = args.tiny
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models, notes = model_configs(g["models"], args.tiny)
    settings = {k: (sorted(v) if isinstance(v, set) else v) for k, v in g.items()}
    g["kernel_config"] = getattr(args, "kernel_config", None)  # None: the defaults
    settings["kernel_config"] = g["kernel_config"].diff() if g["kernel_config"] else {}
    vllm = g["workload"] == "vllm"
    settings.update(quick=args.quick, hf_mode=args.hf_mode, decode_prompt_len=128 if vllm else 1024,
                    decode_new_tokens=128 if vllm else g["decode_steps"] + 1)
    rep = Report(args.out, settings, args.tag)
    for n in notes:
        rep.note(n)
    rep.note("dummy (random) weights at the real dimensions; adapters on q/k/v/o and every expert's gate/up/down, "
             "spread round-robin over the batch; all adapters of a run share one set of random factor values, "
             "each in its own slot")
    bw = bandwidth_gbs(device)
    rep.data["ceilings"] = {"copy_gbs": bw, "matmul_tflops": {d: matmul_tflops(device, d) for d in ("bf16", "fp8")}}
    tflops = rep.data["ceilings"]["matmul_tflops"]["bf16"]
    rep.save()
    bar = tqdm(total=_case_count(g, len(models)), desc="bench report", unit="case", dynamic_ncols=True, mininterval=2.0)
    try:
        for label, cfg in models:
            folder = _write_config(cfg)
            for dtype in g["dtypes"]:
                for rank in g["ranks"]:
                    _engine_cases(rep, bar, g, label, folder, dtype, rank, device, bw, tflops)
        if "peft" in g["parts"]:
            _peft_cases(rep, bar, g, models, device)
    finally:
        bar.close()
        path = rep.save()
    with open(path) as f:
        print(markdown(json.load(f)))
    print(f"results: {path}")
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is not installed: run `moelora bench plot FILE` where it is (pip install moelora[bench])")
        else:
            for png in plot_files([path], args.out):
                print(f"plot: {png}")
    return path


def _engine_cases(rep: Report, bar, g: dict, label: str, folder: str, dtype: str, rank: int,
                  device: torch.device, bw: float, tflops: float | None) -> None:
    """Every decode and prefill case of one engine (model, dtype, rank)."""
    n_cases = _engine_case_count(g)
    if not n_cases:
        return
    bar.set_postfix_str(f"building {label} {dtype} r{rank}")
    sizes = _meta_sizes(folder, dtype, rank)
    kv_tokens = max(max(g["batches"]) * (_ctx_len(g) + 16), g["prefill_prompts"] * (g["prefill_len"] + 16))
    kv_bytes = _kv_bytes(folder, engine_dtype(dtype)["dtype"], kv_tokens) if device.type == "cuda" else None
    wanted = max(g["adapter_counts"] + g["prefill_adapters"])
    slots = _slots_that_fit(device, sizes, kv_bytes or 0, wanted)
    skipped = [n for n in sorted(set(g["adapter_counts"] + g["prefill_adapters"])) if n > slots]
    if skipped:
        rep.note(f"{label} {dtype} rank {rank}: {slots} LoRA slots fit in GPU memory (one slot "
                 f"{sizes['slot_bytes'] / 2**30:.2f} GiB); cases with {skipped} adapters skipped")
    t0 = time.perf_counter()
    try:
        engine = _build_engine(folder, dtype, rank, slots, g, device, kv_bytes)
    except Exception as e:  # e.g. fp8 before the engine supports it
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rep.note(f"{label} {dtype} rank {rank}: engine refused ({type(e).__name__}: {str(e)[:200]}); its cases skipped")
        bar.update(n_cases)
        rep.save()
        return
    _register_adapters(engine, slots, rank)
    for n in sorted({0, min(1, slots)}):  # untimed: first replays, adapter loads, lazy initialisation
        decode._case(engine, 1, n, "ctx1024", 4, seed=99)
    build_s = time.perf_counter() - t0
    rep.data["engines"].append({"model": label, "dtype": dtype, "rank": rank, "max_loras": slots, "build_s": build_s,
                                "layers": engine.config.num_hidden_layers, "graphs": engine.runner.graphs is not None,
                                "weight_bytes": sizes["weight_bytes"], "slot_bytes": sizes["slot_bytes"]})
    common = {"model": label, "dtype": dtype, "engine_rank": rank}
    try:
        if "decode" in g["parts"]:
            for batch in g["batches"]:
                for n in g["adapter_counts"]:
                    bar.set_postfix_str(f"{label} {dtype} r{rank} decode b{batch} a{n}")
                    if n > slots:
                        bar.update()
                        continue
                    row = _decode_row(engine, g, batch, n, rank, bw, common)
                    if row is not None:
                        rep.data["decode"].append(row)
                        bar.write(f"{label} {dtype} r{rank} decode batch {batch:4d} adapters {n:2d}: "
                                  f"{row['tokens_per_s']:9.1f} tok/s  step {row['step_ms']:7.2f} ms  "
                                  f"x floor {row['step_over_floor'] or float('nan'):.2f}")
                    else:
                        rep.note(f"{label} {dtype} r{rank} decode batch {batch} adapters {n}: failed")
                    bar.update()
                    rep.save()
        if "prefill" in g["parts"]:
            for n in g["prefill_adapters"]:
                bar.set_postfix_str(f"{label} {dtype} r{rank} prefill a{n}")
                if n <= slots:
                    rep.data["prefill"].append(_prefill_row(engine, g, n, rank, sizes, tflops, common))
                    r = rep.data["prefill"][-1]
                    bar.write(f"{label} {dtype} r{rank} prefill adapters {n:2d}: {r['tokens_per_s']:9.0f} tok/s")
                bar.update()
                rep.save()
    finally:
        _drop_requests(engine)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _decode_row(engine: LLMEngine, g: dict, batch: int, n: int, rank: int, bw: float, common: dict) -> dict | None:
    workload = "ctx1024" if g["workload"] == "ctx" else "vllm"
    try:
        r = decode._case(engine, batch, n, workload, g["decode_steps"], seed=batch * 31 + n)
    except Exception as e:
        _drop_requests(engine)
        print(f"decode batch {batch} adapters {n} failed: {type(e).__name__}: {e}")
        return None
    touched = r.pop("experts_touched", [])
    fl = floor_ms(r["floor_bytes"], bw)
    r.update(common, rank=rank if n else 0, workload=g["workload"], floor_ms=fl,
             step_over_floor=step_over_floor(r["step_ms"], fl), experts_touched_mean=mean(touched))
    return r


def _prefill_row(engine: LLMEngine, g: dict, n: int, rank: int, sizes: dict, tflops: float | None,
                 common: dict) -> dict:
    # warm-up at the timed shapes (the same prompt count: chunked steps of the same sizes), so Triton compiles
    # and autotunes outside the timing (a 1-prompt warm-up left the first timed case 2.5x slow on the H200)
    prefill_case(engine, g["prefill_prompts"], g["prefill_len"], n, seed=5)
    r = prefill_case(engine, g["prefill_prompts"], g["prefill_len"], n, seed=6)
    tokens = r["prompts"] * r["prompt_len"]
    attn = sizes["attn_flops_per_ctx"] * r["prompt_len"] / 2  # causal: half the prompt on average
    fl = prefill_flop_floor_s(sizes["active_params"], tokens, attn, tflops)
    r.update(common, rank=rank if n else 0, flop_floor_s=fl, floor_share=(fl / r["seconds"]) if fl else None,
             active_params=sizes["active_params"])
    return r


def _peft_cases(rep: Report, bar, g: dict, models: list[tuple[str, dict]], device: torch.device) -> None:
    n_cases = len(g["hf_batches"]) * len(g["hf_adapter_counts"])
    qwen = [(label, cfg) for label, cfg in models if cfg.get("model_type") == "qwen3_moe"]
    if not qwen:
        rep.note("transformers + PEFT baseline: runs at Qwen3-30B-A3B dimensions only; not among --models")
        bar.update(n_cases)
        return
    label, cfg = qwen[0]
    full = cfg["num_hidden_layers"]
    layers = min(g["hf_layers"], full)
    bar.set_postfix_str(f"transformers + PEFT ({layers} layers)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt_len = 128 if g["workload"] == "vllm" else 1024

    def on_case(row: dict) -> None:
        bar.write(f"transformers + PEFT batch {row['batch']:4d} adapters {row['adapters']:2d}: "
                  f"{row['tokens_per_s']:9.1f} tok/s (scaled; {row['tokens_per_s_measured']:.1f} measured, "
                  f"{row['passes']} passes)")
        bar.update()

    try:
        res = run_peft_baseline(cfg, full_layers=full, layers=layers, batches=g["hf_batches"],
                                adapter_counts=g["hf_adapter_counts"], rank=g["ranks"][0], prompt_len=prompt_len,
                                new_tokens=g["hf_new_tokens"], device=device, dtype=dtype,
                                mode=rep.data["settings"]["hf_mode"], on_case=on_case)
    except Exception as e:
        rep.note(f"transformers + PEFT baseline failed: {type(e).__name__}: {str(e)[:300]}")
        return
    res["model"] = label
    add_kept(res["rows"])
    rep.data["peft"] = res
    for n in res.pop("notes"):
        rep.note(n)
