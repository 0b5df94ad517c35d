"""Command line: `moelora <command> --help` explains each command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

import moelora
from moelora.adapters.errors import AdapterError
from moelora.adapters.registry import load_adapter
from moelora.config import ConfigError, ModelConfig
from moelora.demo import adapter_paths, model_path
from moelora.demo.run import run_demo
from moelora.engine.llm_engine import EngineArgs
from moelora.engine.memory import GPUMemoryError
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.workers import run_worker
from moelora.kernels._triton import DeviceError
from moelora.models.loader import build_model
from moelora.models.weights import WeightLoadError
from moelora.server.launch import (CPU_THREADS_HELP, KERNEL_CONFIG_HELP, QUANTIZATION_HELP, LaunchError,
                                   add_arguments as add_serve_arguments, check_args, dtype_name, float_in, int_in,
                                   kernel_config, lora_modules, lora_spec, serve as serve_http, torchrun_launch)


class UsageError(Exception):
    """A bad combination of flags found after parsing: printed as one line, exit status 2 (as argparse's)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("moelora serve: error: argument --port: expected ...", no usage block: serve
    has too many flags for one) and each command's checks across flags (`post_check`) run as part of parsing."""

    post_check = None  # a function(args) raising ValueError, set on a command's parser

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if self.post_check is not None and not extras:  # an unrecognized argument is reported first
            try:
                self.post_check(ns)
            except ValueError as e:
                self.error(str(e))
        return ns, extras


def _version() -> str:
    try:
        return version("moelora")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return moelora.__version__


def _cmd_check_adapter(args: argparse.Namespace) -> int:
    cfg = ModelConfig.from_pretrained(args.model)
    # the adapter is validated against the model's shapes; weights are not needed for that
    model = build_model(cfg, None, dtype="float32", device="meta", load_format="none",
                        max_loras=1, max_lora_rank=args.max_lora_rank)
    status = 0
    for spec in args.adapters:
        name, _, path = spec.rpartition("=") if "=" in spec else (spec, "", spec)
        try:
            adapter = load_adapter(name, path, model.lora_targets(), args.max_lora_rank)
        except AdapterError as e:
            print(f"REJECTED {e}")
            status = 1
            continue
        kinds: dict[str, list[int]] = {}
        for target, mod in adapter.modules.items():
            kinds.setdefault(target.split(".", 3)[-1], []).append(mod.rank)
        print(f"OK {name!r}: {len(adapter.modules)} target weights, max rank {adapter.max_rank}")
        for kind, ranks in sorted(kinds.items()):
            print(f"   {kind:32s} layers={len(ranks):3d} rank={sorted(set(ranks))}")
    return status


def _cmd_info(args: argparse.Namespace) -> int:
    cfg = ModelConfig.from_pretrained(args.model)
    for k, v in cfg.__dict__.items():
        if k != "hf_config":
            print(f"{k:32s} {v}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(device=args.device, per_adapter=args.per_adapter, seed=args.seed, cpu_threads=args.cpu_threads,
                    kernel_config=args.kernel_config)


def _cmd_generate(args: argparse.Namespace) -> int:
    try:  # before the model loads: a bad value fails at once
        adapters = {name: mod.path for name, mod in lora_modules(args).items()}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.model is None:  # the bundled demo model and its adapters
        args.model = model_path()
        adapters = {**adapter_paths(), **adapters}
    if args.adapter is not None and args.adapter not in adapters:
        raise UsageError(f"--adapter {args.adapter!r} is not among the --lora names {sorted(adapters)}")
    kw = dict(max_loras=max(1, len(adapters)), max_lora_rank=args.max_lora_rank, dtype=args.dtype, device=args.device,
              quantization=args.quantization, cpu_threads=args.cpu_threads, kernel_config=args.kernel_config,
              tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size)
    launch = torchrun_launch(args)
    if launch is not None and launch.rank != 0:  # torchrun: ranks 1..N-1 follow rank 0's steps
        return run_worker(EngineArgs(model=args.model, **kw))
    llm = moelora.LLM(args.model, adapters=adapters, show_progress=True, **kw)
    try:
        prompts = args.prompt
        if args.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        for out in llm.generate(prompts, params, adapter=args.adapter):
            print(out.text if not args.token_ids else " ".join(map(str, out.outputs[0].token_ids)), flush=True)
    finally:
        llm.shutdown()
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # the benchmarks are loaded only by `moelora bench` (a broken benchmark never stops `moelora serve`)
    if args.what == "kernels":
        from moelora_bench.kernels import run

        print(f"results: {run(quick=args.quick, out_dir=args.out)}")
        return 0
    if args.what == "decode":
        from moelora_bench.decode import run as run_decode

        return run_decode(args)
    if args.what == "report":
        from moelora_bench.report import run_report

        run_report(args)
        return 0
    if args.what == "plot":
        from moelora_bench.plot import plot_files

        for png in plot_files(args.files, args.out):
            print(png)
        return 0
    from moelora_bench.serve import main as serve_main

    return serve_main(args)


TORCHRUN_HELP = """\
Tensor/expert parallelism: --tp N --ep M uses N x M ranks. On one host moelora starts the extra
worker processes itself. Across several hosts (or to let torchrun manage the processes), start the
command under torchrun on every node, with WORLD_SIZE = nnodes x nproc-per-node = tp x ep:

  torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --master-addr HOST0 --master-port 29500 \\
      -m moelora COMMAND --tp 8 --ep 2

(R = 0 on HOST0, 1 on the other node; the model and adapter paths must exist on every node.)
Global rank 0 schedules; the others follow its steps. NCCL on GPUs (GPU LOCAL_RANK per process),
gloo on the CPU. A rank that exits stops rank 0 with an error (torchrun then stops the rest).
"""


VLLM_HELP = """\
vLLM's command lines: the flags keep vLLM's names where moelora has the feature, so

  moelora serve /models/qwen3-moe --enable-lora --lora-modules sql=/adapters/sql \\
      '{"name": "chat", "path": "/adapters/chat"}' --max-loras 4 --max-cpu-loras 8 --port 8000

runs as `vllm serve` would: the positional MODEL, --served-model-name, --tensor-parallel-size/-tp,
--gpu-memory-utilization, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --max-lora-rank,
--max-logprobs, --generation-config, --dtype, --quantization fp8, --enforce-eager, --api-key, --host, --port,
--uvicorn-log-level, --disable-uvicorn-access-log (--enable-lora, --enable-chunked-prefill,
--disable-log-requests and --disable-log-stats are accepted: moelora always does or never does those).
vLLM flags for features moelora lacks (the last group above) stop with the reason and what to do instead.
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="moelora",
        description="Serve one Mixture-of-Experts LLM with many LoRA adapters at once (Qwen3-MoE, Qwen2-MoE, "
        "Mixtral, OLMoE, DeepSeek-V2/V3). Each request names its adapter; one batch mixes adapters freely.",
    )
    p.add_argument("--version", action="version", version=f"moelora {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    info = sub.add_parser("info", help="print the model configuration moelora reads from a model folder")
    info.add_argument("model", help="model folder with config.json")
    info.set_defaults(func=_cmd_info)

    demo = sub.add_parser(
        "demo",
        help="run the bundled tiny MoE model with its three adapters in one mixed batch and check every row",
        description="Loads the bundled demo model (GPU if present, else CPU) and its adapters upper, reverse and "
        "rot13; runs ONE batch where the base model and each adapter appear several times with fresh random "
        "inputs; prints adapter, input, output, expected, ok and the tokens/s. Exit status 1 if any row is wrong.",
    )
    demo.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    demo.add_argument("--per-adapter", type=int_in(1), default=4, help="rows per adapter and for the base (default 4)")
    demo.add_argument("--seed", type=int, default=None, help="seed for the random inputs (default: fresh each run)")
    demo.add_argument("--cpu-threads", type=int_in(1), default=None, metavar="N", help=CPU_THREADS_HELP)
    demo.add_argument("--kernel-config", type=kernel_config, default=None, metavar="JSON", help=KERNEL_CONFIG_HELP)
    demo.set_defaults(func=_cmd_demo)

    gen = sub.add_parser(
        "generate",
        help="generate text offline for one or more prompts, with or without an adapter",
        description="Loads the model (and any --lora adapters) and prints one completion per --prompt.",
        epilog=TORCHRUN_HELP.replace("COMMAND", "generate --model /shared/model --prompt '...'"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", default=None,
                     help="model folder (config.json, safetensors, tokenizer.json); default: the bundled demo model "
                     "with its adapters upper, reverse and rot13 (prompts look like 'hello world => ')")
    gen.add_argument("--lora", action="append", type=lora_spec, default=[], metavar="NAME=PATH",
                     help="load a PEFT adapter (repeatable)")
    gen.add_argument("--adapter", default=None, help="adapter NAME to use for every prompt (default: the base model)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt with the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int_in(1), default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float_in(0), default=0.0, help=">= 0; 0 = greedy (default)")
    gen.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, help="in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int_in(-1), default=0, help="0 or -1 = off (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--max-lora-rank", type=int_in(1), default=64, help="largest adapter rank (default 64)")
    gen.add_argument("--dtype", type=dtype_name, default=None,
                     help="float32 | bfloat16 | float16 | auto (default: float32 on CPU)")
    gen.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    gen.add_argument("--quantization", default=None, choices=["fp8", "nvfp4"], help=QUANTIZATION_HELP)
    gen.add_argument("--token-ids", action="store_true", help="print the generated token ids instead of the text")
    gen.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int_in(1), default=1,
                     help="ranks splitting attention heads, dense layers and the vocabulary (default 1)")
    gen.add_argument("--ep", "--expert-parallel-size", dest="expert_parallel_size", type=int_in(1), default=1,
                     help="ranks splitting the routed experts (default 1)")
    gen.add_argument("--cpu-threads", type=int_in(1), default=None, metavar="N", help=CPU_THREADS_HELP)
    gen.add_argument("--kernel-config", type=kernel_config, default=None, metavar="JSON", help=KERNEL_CONFIG_HELP)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with per-request adapters (default: the bundled demo model)",
        description="Serves /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter, /health and /metrics. A request picks its adapter "
        "with model=ADAPTER or model=BASE:ADAPTER; model=BASE means no adapter.",
        epilog=VLLM_HELP + "\n" + TORCHRUN_HELP.replace(
            "COMMAND", "serve --model /shared/model --host 0.0.0.0 --kv-cache-memory 8000000000")
        + "\nRank 0 serves HTTP on --host/--port; the other ranks only run the model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(srv)
    srv.post_check = check_args
    srv.set_defaults(func=serve_http)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: kernels, decode, report (GPU); plot (PNGs from report JSON); serve (load generator)",
        description="Each writes JSON (date, device, commit) under --out; `moelora bench WHAT --help` explains WHAT.",
    )
    bsub = bench.add_subparsers(dest="what", required=True, metavar="what")
    kern = bsub.add_parser(
        "kernels", help="each multi-LoRA Triton kernel against its byte floor (GPU)",
        description="Each multi-LoRA Triton kernel at Qwen3-30B-A3B expert shapes and a 4096-wide dense layer, "
        "1-256 tokens, 1-32 adapters, rank 16/64, beside a torch loop over adapters and the base GEMM.",
    )
    kern.add_argument("--quick", action="store_true", help="a small subset of the cases")
    dec = bsub.add_parser(
        "decode", help="model decode tokens/s at Qwen3-30B-A3B or DeepSeek-V2-Lite dimensions beside the byte floor (GPU)",
        description="Tokens/s and step time at Qwen3-30B-A3B or DeepSeek-V2-Lite (--preset) dimensions (dummy weights) beside the byte floor, "
        "with 0-8 adapters, plus start-up and adapter-load times.",
    )
    from moelora_bench import decode, report, serve  # their options only (see _cmd_bench)

    decode.add_arguments(dec)
    dec.post_check = decode.check_args
    rep = bsub.add_parser(
        "report", help="the full comparison: ceilings, decode/prefill sweeps, transformers + PEFT, then plots (GPU)",
        description="Measures the GPU's HBM bandwidth and matmul ceilings; runs decode sweeps (batch 1-256 x 0-32 "
        "adapters x rank 16/64 x bf16/fp8) at Qwen3-30B-A3B and DeepSeek-V2-Lite dimensions with dummy weights, "
        "each step beside its byte floor; prefill throughput on 2k-token prompts beside its FLOP floor; and the same "
        "mixed-adapter decode workload on transformers + PEFT (fewer layers, scaled openly to the full count). "
        "Writes report-<date>-<device>.json under --out after every case (a run cut short keeps what it measured), "
        "then the PNGs if matplotlib is installed. Split a long run with --models/--dtypes/--ranks/--parts and "
        "plot the files together.",
    )
    report.add_arguments(rep)
    plot = bsub.add_parser(
        "plot", help="PNG plots from one or more `bench report` JSON files (needs matplotlib; no GPU)",
        description="Draws tokens/s vs batch (0/1/4/8 adapters), step time over the byte floor, the share of the "
        "no-adapter throughput kept beside SGLang's published and vLLM 0.26's H200 figures, and moelora vs "
        "transformers + PEFT. Several files (parts of one split run) are merged.",
    )
    plot.add_argument("files", nargs="+", metavar="FILE", help="report JSON files")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: the first file's folder)")
    srv_b = bsub.add_parser(
        "serve", help="a load generator against a running `moelora serve`",
        description="N concurrent clients against a running `moelora serve` (mixed adapters, streaming, optional "
        "early disconnects): requests/s, tokens/s, TTFT and TPOT p50/p99, errors, and the server's KV/slot gauges.",
    )
    for sp in (kern, dec):
        sp.add_argument("--out", default="bench/results", help="folder for the JSON results (default bench/results)")
    serve.add_arguments(srv_b)
    bench.set_defaults(func=_cmd_bench)

    chk = sub.add_parser(
        "check-adapter",
        help="validate PEFT LoRA adapters against a base model without loading its weights",
        description="Reads each adapter (any of the three expert layouts), checks every tensor against the base "
        "model's shapes and prints what it targets, or why it is rejected. Exit status 1 if any is rejected.",
    )
    chk.add_argument("--model", required=True, help="base model folder with config.json")
    chk.add_argument("--max-lora-rank", type=int_in(1), default=64,
                     help="largest rank the server will accept (default 64)")
    chk.add_argument("adapters", nargs="+", metavar="NAME=PATH", help="adapter folders (NAME= optional)")
    chk.set_defaults(func=_cmd_check_adapter)
    return p


# errors whose message says all a user needs (what is wrong and what to do): printed without a traceback
EXPECTED_ERRORS = (AdapterError, ConfigError, DeviceError, GPUMemoryError, LaunchError, WeightLoadError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"moelora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except EXPECTED_ERRORS as e:
        cause = f" (from {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
        print(f"moelora {args.command}: error: {e}{cause}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
