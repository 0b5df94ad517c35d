"""Build the engine + app from CLI arguments and run uvicorn; or run a server in a thread (tests, benchmarks)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time

from moelora.engine.llm_engine import EngineArgs, LLMEngine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder; default: the bundled demo model with its 3 adapters")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="load a PEFT adapter at start-up (repeatable)")
    p.add_argument("--served-model-name", default=None, help="name of the base model in the API (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MOELORA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or MOELORA_API_KEY)")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="only load adapters from under DIR (repeatable; symlinks and .. are resolved)")
    p.add_argument("--max-loras", type=int, default=8, help="adapters in one batch / LoRA slots (default 8)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted (default 64)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory (default: all)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    p.add_argument("--quantization", default=None, choices=["fp8", "nvfp4"],
                   help="fp8: block-scaled FP8 base (128x128 blocks; needs compute capability >= 8.9); nvfp4: NVFP4 "
                   "weight-only (ModelOpt layout). A bf16 checkpoint is quantized at load time; an FP8 or NVFP4 "
                   "checkpoint stays quantized on a GPU without this flag")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | auto (default: float32 on CPU, the checkpoint's on GPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default: automatic)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each decode step before the last one's tokens are read, hiding the "
                        "host's work behind the GPU (single GPU; rows asking for logprobs or penalties keep the "
                        "synchronous step). Default: on for a GPU, off on the CPU")
    p.add_argument("--lora-overlap", default="on", choices=["on", "off"],
                   help="GPU: run the routed-expert LoRA chains and shared experts on a side CUDA stream beside "
                        "the base expert GEMMs (default on)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, adapter slots, activations, CUDA graphs and the "
                        "KV cache together (default 0.9)")
    p.add_argument("--max-graph-batch-size", type=int, default=64,
                   help="largest decode batch captured as a CUDA graph; larger batches run eagerly (default 64)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                   help="ranks splitting attention heads, dense layers and the vocabulary (one process each; default 1)")
    p.add_argument("--ep", "--expert-parallel-size", dest="expert_parallel_size", type=int, default=1,
                   help="ranks splitting the routed experts (world = tp x ep processes; default 1)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    p.add_argument("--max-n", type=int, default=16, help="largest n per request (default 16)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")


def engine_args(args: argparse.Namespace) -> tuple[EngineArgs, dict[str, str], str]:
    """(EngineArgs, adapters to load at start-up, the served model name) from the serve arguments."""
    adapters = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora expects NAME=PATH, got {spec!r}")
        adapters[name] = path
    model = args.model
    if model is None:
        from moelora.demo import adapter_paths, model_path

        model = model_path()
        adapters = {**adapter_paths(), **adapters}
        served = args.served_model_name or "moelora-demo"
    else:
        served = args.served_model_name or os.path.basename(os.path.normpath(model))
    eargs = EngineArgs(
        model=model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        dtype=args.dtype, device=args.device, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory, load_format=args.load_format, show_progress=True,
        enforce_eager=args.enforce_eager, lora_overlap=args.lora_overlap == "on", quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization, max_graph_batch_size=args.max_graph_batch_size,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
        async_scheduling=args.async_scheduling,
    )
    return eargs, adapters, served


def build_from_args(args: argparse.Namespace):
    from moelora.server.app import ServerSettings, build_app  # fastapi is imported only to serve
    from moelora.server.async_engine import AsyncEngine

    eargs, adapters, served = engine_args(args)
    model = eargs.model
    engine = AsyncEngine(LLMEngine(eargs, adapters))
    settings = ServerSettings(served_model_name=served, model_path=model, api_key=args.api_key,
                              lora_roots=list(args.lora_root), max_body_bytes=args.max_body_bytes, max_n=args.max_n)
    return engine, build_app(engine, settings)


def serve(args: argparse.Namespace) -> int:
    """Serve HTTP; under torchrun, rank 0 does and ranks 1..N-1 run the worker loop."""
    import uvicorn

    from moelora.distributed import check_launch

    try:
        launch = check_launch(args.tensor_parallel_size, args.expert_parallel_size)
    except ValueError as e:
        raise SystemExit(f"moelora: {e}") from None
    if launch is not None and launch.rank != 0:
        from moelora.engine.workers import run_worker

        return run_worker(engine_args(args)[0])
    engine, app = build_from_args(args)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    engine.on_fatal = lambda message: setattr(server, "should_exit", True)  # a dead worker stops the server
    engine.start()
    print(f"moelora: serving {app.state.settings.served_model_name!r} with adapters {engine.engine.list_adapters()} "
          f"on http://{args.host}:{args.port}/v1 ({engine.engine.device})", flush=True)
    workers = engine.engine.workers
    external = workers is not None and workers.external
    if external:  # uvicorn re-raises the SIGTERM it shut down for: catch it to say why torchrun stopped us
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.run()  # its lifespan has stopped the engine thread when this returns
    except _Terminated:
        pass
    if engine.fatal_error is None and external:
        from moelora.engine.workers import WorkerFailed

        try:  # torchrun stops every rank (SIGTERM) when one fails: if that is why, say which
            workers.check(ping=True)
        except WorkerFailed as e:
            engine.fatal_error = str(e)
    engine.engine.shutdown()
    if engine.fatal_error is not None:
        print(f"moelora: stopped: {engine.fatal_error}", flush=True)
        return 1
    return 0


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame) -> None:
    raise _Terminated(signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn in a background thread on 127.0.0.1 (tests and benchmarks)."""

    def __init__(self, engine, app, port: int | None = None) -> None:
        import uvicorn

        self.engine = engine
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
