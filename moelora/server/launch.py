"""Build the engine + app from CLI arguments and run uvicorn; or run a server in a thread (tests, benchmarks).

`moelora serve` takes vLLM's flag names where moelora has the feature (`vllm serve MODEL --enable-lora
--lora-modules sql=/path --max-loras 4` runs as is); vLLM flags for features moelora lacks are accepted by the
parser only to be rejected with the reason (`check_args`), and every value is range-checked by its `type=`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from decimal import Decimal
from typing import NamedTuple

import uvicorn

from moelora.demo import adapter_paths, model_path
from moelora.distributed import check_launch, free_port
from moelora.engine.llm_engine import EngineArgs, LLMEngine
from moelora.engine.workers import WorkerFailed, run_worker
from moelora.kernels.config import KernelConfig
from moelora.server.app import ServerSettings, build_app
from moelora.server.async_engine import AsyncEngine

log = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"  # INFO 12-06 23:59:01 moelora.adapters: message
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"


class LaunchError(Exception):
    """The server cannot start for a reason the message states with what to do (printed as one line)."""


# ---- value checks: argparse `type=` functions, each error one line naming the accepted range -------------------

def int_in(lo: int, hi: int | None = None):
    """An integer within lo..hi (hi None: no upper bound)."""
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {text!r}")
        return value

    parse.__name__ = f"int>={lo}" if hi is None else f"int[{lo},{hi}]"
    return parse


KERNEL_CONFIG_HELP = (
    "kernel choices, a JSON object of KernelConfig fields by section, as vLLM's --compilation-config (e.g. "
    "'{\"side_stream_priority\": \"normal\", \"moe_lora\": {\"early\": false}}'); an unknown field or a value of "
    "the wrong type is an error. Every field with its default and meaning: docs/configuration.md. Default: the "
    "defaults (what was measured fastest)")


QUANTIZATION_HELP = (
    "fp8: block-scaled FP8 base (128x128 blocks; needs compute capability >= 8.9); nvfp4: NVFP4 weight-only "
    "(ModelOpt layout). A bf16 checkpoint is quantized at load time; an FP8 or NVFP4 checkpoint stays quantized on "
    "a GPU without this flag")
CPU_THREADS_HELP = ("CPU: torch's threads (default: MOELORA_CPU_THREADS or OMP_NUM_THREADS when set, else a count "
                    "that does not oversubscribe the machine)")


def kernel_config(text: str) -> KernelConfig:
    """--kernel-config JSON -> KernelConfig (KernelConfig.from_json: strict), its error as argparse's one line."""
    try:
        return KernelConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def float_in(lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """A float within lo..hi (hi None: no upper bound); *_open excludes that end."""
    rng = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}" if hi is not None
           else f"{'>' if lo_open else '>='} {lo:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value == value and (value > lo if lo_open else value >= lo)
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a number {rng}, got {text!r}")
        return value

    parse.__name__ = f"float {rng}"
    return parse


_SUFFIX = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def context_length(text: str) -> int:
    """--max-model-len: a positive integer, or as vLLM in human-readable form (1k = 1000, 1K = 1024, 25.6k)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    value = None
    if m:
        number, suffix = m.groups()
        exact = Decimal(number) * _SUFFIX.get(suffix, 1)
        value = int(exact) if exact == int(exact) else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens (e.g. 4096, 32k = 32000, 32K = "
                                         f"32768), got {text!r}")
    return value


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


def dtype_name(text: str) -> str:
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_DTYPES)} (or vLLM's half / float), "
                                         f"got {text!r}")
    return name


def generation_config(text: str) -> str:
    """--generation-config: "auto" (the model folder's generation_config.json), "vllm" (none), or a folder."""
    if text in ("auto", "vllm"):
        return text
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected auto, vllm or a folder holding generation_config.json; "
                                         f"{text!r} is not a folder")
    if not os.path.isfile(os.path.join(text, "generation_config.json")):
        raise argparse.ArgumentTypeError(f"no generation_config.json in {text!r}: pass auto, vllm or a folder "
                                         f"that holds one")
    return text


class LoRAModule(NamedTuple):
    """One adapter to load at start-up: --lora NAME=PATH, or vLLM's --lora-modules NAME=PATH / JSON."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_spec(text: str) -> LoRAModule:
    """--lora NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def lora_module(text: str) -> LoRAModule:
    """vLLM's --lora-modules item: NAME=PATH or '{"name": ..., "path": ..., "base_model_name": ...}'."""
    if not text.lstrip().startswith("{"):
        try:
            return lora_spec(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected NAME=PATH or JSON {{\"name\": ..., \"path\": ...}}, got {text!r} (a model path goes "
                f"before --lora-modules, or in --model)") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(d) - set(LoRAModule._fields))
    if unknown or not all(isinstance(d.get(k), str) and d[k] for k in ("name", "path")):
        raise argparse.ArgumentTypeError(
            f"expected JSON with string fields name, path and optionally base_model_name"
            f"{f' (unknown: {unknown})' if unknown else ''}, got {text!r}")
    base = d.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"base_model_name must be a string, got {text!r}")
    return LoRAModule(d["name"], d["path"], base)


# ---- vLLM flags for features moelora does not have: parsed, then rejected with the reason ----------------------

_LOCAL_ONLY = ("moelora loads local folders only: download it first (huggingface-cli download REPO --revision R "
               "--local-dir DIR) and pass DIR as the model")
# (flags, add_argument keywords, why / what to do); a value other than the default is a use of the feature
UNSUPPORTED = [
    (("--pipeline-parallel-size", "-pp"), dict(type=int, default=1, metavar="N"),
     "moelora splits a model over ranks with --tp (tensor parallel) and --ep (expert parallel), not pipeline "
     "stages: use those"),
    (("--data-parallel-size", "-dp"), dict(type=int, default=1, metavar="N"),
     "run one `moelora serve` per replica (each on its own --port) behind a load balancer"),
    (("--enable-expert-parallel",), dict(action="store_true"),
     "moelora sets expert parallelism on its own: pass --ep N (N x --tp ranks in all)"),
    (("--speculative-config",), dict(default=None, metavar="JSON"),
     "moelora has no speculative decoding: leave it out"),
    (("--kv-cache-dtype",), dict(default="auto", metavar="DTYPE"),
     "the KV cache is kept in the model's dtype (--dtype): leave it out"),
    (("--cpu-offload-gb",), dict(type=float, default=0.0, metavar="GB"),
     "weights stay on the device: use --quantization fp8 or more ranks (--tp / --ep) to fit a larger model"),
    (("--lora-dtype",), dict(default="auto", metavar="DTYPE"),
     "adapters take the base model's dtype (--dtype): leave it out"),
    (("--tokenizer",), dict(default=None, metavar="PATH"),
     "the tokenizer is read from the model folder (tokenizer.json, tokenizer_config.json): put it there"),
    (("--chat-template",), dict(default=None, metavar="TEMPLATE"),
     "the chat template is the model folder's (chat_template in tokenizer_config.json, or chat_template.jinja): "
     "put it there"),
    (("--revision",), dict(default=None, metavar="REV"), _LOCAL_ONLY),
    (("--tokenizer-revision",), dict(default=None, metavar="REV"), _LOCAL_ONLY),
    (("--code-revision",), dict(default=None, metavar="REV"), _LOCAL_ONLY),
    (("--download-dir",), dict(default=None, metavar="DIR"), _LOCAL_ONLY),
    (("--enable-auto-tool-choice",), dict(action="store_true"), "the chat endpoint has no tool calling: leave it out"),
    (("--tool-call-parser",), dict(default=None, metavar="NAME"),
     "the chat endpoint has no tool calling: leave it out"),
    (("--reasoning-parser",), dict(default=None, metavar="NAME"),
     "the model's text is returned as it is (no reasoning_content): leave it out"),
]


def _dest(flags: tuple[str, ...]) -> str:
    return flags[0].lstrip("-").replace("-", "_")


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder, as `vllm serve MODEL` (or --model)")
    m.add_argument("--model", default=None, help="model folder; default: the bundled demo model with its 3 adapters")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name of the base model in the API (default: the folder name); one name")
    m.add_argument("--dtype", type=dtype_name, default=None,
                   help="auto | float32 | bfloat16 | float16 (vLLM's half, float too; default: float32 on CPU, the "
                   "checkpoint's on GPU)")
    m.add_argument("--quantization", "-q", default=None, choices=["fp8", "nvfp4"], help=QUANTIZATION_HELP)
    m.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="auto = safetensors (the only format read); dummy: random weights")
    m.add_argument("--max-model-len", type=context_length, default=None, metavar="TOKENS",
                   help="context length (default: the model's); 32k = 32000 and 32K = 32768 as in vLLM")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; moelora runs no code from a model folder (it implements "
                   "the architectures it serves: `moelora info MODEL` shows what it reads)")
    m.add_argument("--generation-config", type=generation_config, default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for fields a request leaves out: auto (default) reads the model folder's "
                   "generation_config.json, vllm ignores it, or a folder holding one")

    a = p.add_argument_group("adapters (LoRA is always on: every request may name an adapter)")
    a.add_argument("--lora", action="append", type=lora_spec, default=[], metavar="NAME=PATH",
                   help="load a PEFT adapter at start-up (repeatable)")
    a.add_argument("--lora-modules", action="extend", nargs="+", type=lora_module, default=[],
                   metavar="NAME=PATH|JSON",
                   help="vLLM's spelling of --lora: NAME=PATH or '{\"name\": N, \"path\": P, \"base_model_name\": B}', "
                   "several per flag, repeatable; merged with --lora")
    a.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines; adapters are always on in moelora")
    a.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="only load adapters from under DIR (repeatable; symlinks and .. are resolved)")
    a.add_argument("--max-loras", metavar="N", type=int_in(1), default=8,
                   help="adapters in one batch / LoRA slots (>= 1, default 8)")
    a.add_argument("--max-lora-rank", metavar="N", type=int_in(1), default=64,
                   help="largest adapter rank accepted (default 64)")
    a.add_argument("--max-cpu-loras", metavar="N", type=int_in(1), default=None,
                   help="adapters kept in CPU memory, >= --max-loras as in vLLM (default: all)")

    e = p.add_argument_group("engine")
    e.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    e.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", metavar="N",
                   type=int_in(1), default=1,
                   help="ranks splitting attention heads, dense layers and the vocabulary (one process each; default 1)")
    e.add_argument("--ep", "--expert-parallel-size", dest="expert_parallel_size", metavar="N", type=int_in(1),
                   default=1, help="ranks splitting the routed experts (world = tp x ep processes; default 1)")
    e.add_argument("--max-num-seqs", metavar="N", type=int_in(1), default=64,
                   help="requests running at once (default 64)")
    e.add_argument("--max-num-batched-tokens", metavar="N", type=int_in(1), default=2048,
                   help="tokens per engine step (default 2048)")
    e.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted for vLLM's command lines; long prompts are always prefilled in chunks of "
                   "--max-num-batched-tokens")
    e.add_argument("--block-size", metavar="N", type=int_in(1), default=16,
                   help="KV cache block size in tokens (default 16)")
    e.add_argument("--kv-cache-memory", type=int_in(1), default=None, metavar="BYTES",
                   help="bytes for the KV cache (default: automatic)")
    e.add_argument("--gpu-memory-utilization", metavar="FRACTION", type=float_in(0, 1, lo_open=True), default=0.9,
                   help="share of the GPU's memory, in (0, 1], for this server's weights, adapter slots, activations, "
                   "CUDA graphs and KV cache together (default 0.9); per server, as vLLM's: memory other processes "
                   "hold at start-up is not in it, so two servers on one GPU may take 0.45 each")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes already computed, keyed by adapter content (the same "
                   "prefix under another adapter or the base model is never shared); freed prefixes stay until "
                   "their memory is needed, least recently used first. Default on; --no-enable-prefix-caching "
                   "turns it off")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each decode step before the last one's tokens are read, hiding the "
                        "host's work behind the GPU (single GPU; rows asking for logprobs or penalties keep the "
                        "synchronous step). Default: on for a GPU, off on the CPU")
    e.add_argument("--lora-overlap", default="on", choices=["on", "off"],
                   help="GPU: run the routed-expert LoRA chains and shared experts on a side CUDA stream beside "
                        "the base expert GEMMs (default on)")
    e.add_argument("--max-graph-batch-size", metavar="N", type=int_in(1), default=64,
                   help="largest decode batch captured as a CUDA graph; larger batches run eagerly (default 64)")
    e.add_argument("--max-prefill-graph-tokens", metavar="N", type=int_in(0), default=0,
                   help="also replay prefill and mixed steps of up to N tokens (buckets of 32..512) from CUDA graphs: "
                        "512 made a 256-token prefill 4-6x faster on an H100, whose host work otherwise exceeds its "
                        "GPU time. Single GPU, not MLA models. Default 0 (off, until validated further)")
    e.add_argument("--cpu-threads", type=int_in(1), default=None, metavar="N", help=CPU_THREADS_HELP)
    e.add_argument("--kernel-config", type=kernel_config, default=None, metavar="JSON", help=KERNEL_CONFIG_HELP)

    h = p.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int_in(1, 65535), default=8000, help="default 8000")
    h.add_argument("--api-key", default=os.environ.get("MOELORA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or MOELORA_API_KEY)")
    h.add_argument("--max-logprobs", metavar="N", type=int_in(0), default=20,
                   help="largest logprobs / top_logprobs / prompt_logprobs a request may ask for (default 20)")
    h.add_argument("--max-n", metavar="N", type=int_in(1), default=16, help="largest n per request (default 16)")
    h.add_argument("--max-body-bytes", metavar="BYTES", type=int_in(1), default=1 << 20,
                   help="largest request body (default 1 MiB)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help="moelora's log lines (stderr) and uvicorn's; info (default) also logs one line per "
                   "HTTP request")
    g.add_argument("--uvicorn-log-level", default=None, type=str.lower, choices=[*LOG_LEVELS, "critical", "trace"],
                   help="uvicorn's level alone (default: --log-level)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines (moelora logs no request contents)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM's command lines (moelora logs no periodic stats; see /metrics)")

    u = p.add_argument_group("vLLM flags for features moelora does not have (rejected, with the reason)")
    for flags, kw, reason in UNSUPPORTED:
        u.add_argument(*flags, dest=_dest(flags), help=reason.split(":")[0], **kw)


def check_args(args: argparse.Namespace) -> None:
    """Checks across flags, after parsing (a ValueError with a one-line message; `moelora serve` prints it as a
    usage error). Also resolves the positional MODEL into args.model."""
    for flags, kw, reason in UNSUPPORTED:
        default = kw.get("default", False)  # store_true flags default to False
        value = getattr(args, _dest(flags), default)  # a Namespace built without them: the default
        if value != default:
            shown = flags[0] if isinstance(value, bool) else f"{flags[0]} {value:g}" if isinstance(value, float) \
                else f"{flags[0]} {value}"
            raise ValueError(f"{shown} is not supported: {reason}")
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and os.path.normpath(args.model) != os.path.normpath(tag):
            raise ValueError(f"two models: {tag!r} (positional) and --model {args.model!r}: pass one")
        args.model = tag
    names = args.served_model_name
    if isinstance(names, list) and len(names) > 1:
        raise ValueError(f"--served-model-name takes one name here, got {names}: moelora serves the base model "
                         f"under one name (a model path goes before the flags, or in --model)")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"--max-cpu-loras ({args.max_cpu_loras}) must be >= --max-loras ({args.max_loras})")
    lora_modules(args)


def lora_modules(args: argparse.Namespace) -> dict[str, LoRAModule]:
    """--lora and --lora-modules merged by name; one name given two different paths is an error (ValueError)."""
    out: dict[str, LoRAModule] = {}
    for mod in [*args.lora, *getattr(args, "lora_modules", [])]:
        if isinstance(mod, str):  # a Namespace built by hand
            try:
                mod = lora_spec(mod)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--lora: {e}") from None
        old = out.get(mod.name)
        if old is not None and os.path.normpath(old.path) != os.path.normpath(mod.path):
            raise ValueError(f"adapter {mod.name!r} given twice, as {old.path!r} and {mod.path!r}: give it once")
        out[mod.name] = mod if old is None or mod.base_model_name else old
    return out


def engine_args(args: argparse.Namespace) -> tuple[EngineArgs, dict[str, str], str]:
    """(EngineArgs, adapters to load at start-up, the served model name) from the serve arguments."""
    try:
        check_args(args)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    mods = lora_modules(args)
    adapters = {name: mod.path for name, mod in mods.items()}
    model = args.model
    names = args.served_model_name
    name = names[0] if isinstance(names, list) else names
    if model is None:
        model = model_path()
        adapters = {**adapter_paths(), **adapters}
        served = name or "moelora-demo"
    else:
        served = name or os.path.basename(os.path.normpath(model))
    for mod in mods.values():
        if mod.base_model_name is not None and mod.base_model_name != served:
            log.warning("adapter %r: base_model_name %r is not the served model %r; moelora serves one base model, "
                        "which /v1/models lists as the adapter's parent", mod.name, mod.base_model_name, served)
    eargs = EngineArgs(
        model=model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        dtype=args.dtype, device=args.device, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, show_progress=True,
        kv_cache_memory_bytes=args.kv_cache_memory, quantization=args.quantization, cpu_threads=args.cpu_threads,
        load_format="auto" if args.load_format == "safetensors" else args.load_format, enforce_eager=args.enforce_eager,
        lora_overlap=args.lora_overlap == "on", async_scheduling=args.async_scheduling,
        gpu_memory_utilization=args.gpu_memory_utilization, max_graph_batch_size=args.max_graph_batch_size,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        kernel_config=getattr(args, "kernel_config", None))
    return eargs, adapters, served


def build_from_args(args: argparse.Namespace):
    eargs, adapters, served = engine_args(args)
    engine = AsyncEngine(LLMEngine(eargs, adapters))
    settings = ServerSettings(served_model_name=served, model_path=eargs.model, api_key=args.api_key,
                              lora_roots=list(args.lora_root), max_body_bytes=args.max_body_bytes, max_n=args.max_n,
                              max_logprobs=args.max_logprobs, generation_config=args.generation_config)
    return engine, build_app(engine, settings)


# ---- logging -----------------------------------------------------------------------------------------------------

class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it per test)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str = "info") -> None:
    """The "moelora" loggers at `level`, one handler on stderr ("INFO 12-06 23:59:01 moelora.adapters: message").
    Idempotent: a second call changes the level and keeps the one handler. The records still propagate to the
    root logger, which has no handler in `moelora serve` (and pytest's capture in tests)."""
    logger = logging.getLogger("moelora")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
        logger.addHandler(handler)


def uvicorn_logging(level: str, access_log: bool = True) -> dict:
    """uvicorn.Config keywords: its level, and its access log (one line per request) at info and below only."""
    return dict(log_level=level, access_log=access_log and level in ("trace", "debug", "info"))


# ---- the port, checked before the model loads ----------------------------------------------------------------------

_BIND_ERRORS = {
    errno.EADDRINUSE: "address already in use (another server?): stop it or pick another --port",
    errno.EACCES: "permission denied (ports below 1024 need privileges): pick another --port, e.g. 8000",
    errno.EADDRNOTAVAIL: "no such address on this machine: check --host (0.0.0.0 for every interface)",
}


def check_bind(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn will (SO_REUSEADDR) and let it go; LaunchError naming the address otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except socket.gaierror as e:
        raise LaunchError(f"cannot listen on {shown}: unknown host ({e.strerror}): check --host") from None
    except OSError as e:
        why = _BIND_ERRORS.get(e.errno, f"{e.strerror or e}: check --host and --port")
        raise LaunchError(f"cannot listen on {shown}: {why}") from None


def torchrun_launch(args: argparse.Namespace):
    """The torchrun launch this process belongs to (None without torchrun); exits with the reason when
    WORLD_SIZE is not --tp x --ep."""
    try:
        return check_launch(args.tensor_parallel_size, args.expert_parallel_size)
    except ValueError as e:
        raise SystemExit(f"moelora: {e}") from None


def serve(args: argparse.Namespace) -> int:
    """Serve HTTP; under torchrun, rank 0 does and ranks 1..N-1 run the worker loop."""
    launch = torchrun_launch(args)
    configure_logging(args.log_level)
    if launch is not None and launch.rank != 0:
        return run_worker(engine_args(args)[0])
    check_bind(args.host, args.port)  # before the model loads: a taken port fails in a second, not after minutes
    engine, app = build_from_args(args)
    uv_level = args.uvicorn_log_level or args.log_level
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           **uvicorn_logging(uv_level, not args.disable_uvicorn_access_log)))
    engine.on_fatal = lambda message: setattr(server, "should_exit", True)  # a dead worker stops the server
    engine.start()
    print(f"moelora: serving {app.state.settings.served_model_name!r} with adapters {engine.engine.list_adapters()} "
          f"on http://{args.host}:{args.port}/v1 ({engine.engine.device})", flush=True)
    workers = engine.engine.workers
    external = workers is not None and workers.external
    if external:  # uvicorn re-raises the SIGTERM it shut down for: catch it to say why torchrun stopped us
        signal.signal(signal.SIGTERM, _raise_terminated)
    with contextlib.suppress(_Terminated):
        server.run()  # its lifespan has stopped the engine thread when this returns
    if engine.fatal_error is None and external:
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


class ServerThread:
    """uvicorn in a background thread on 127.0.0.1 (tests and benchmarks); quiet (warning, no access log) unless
    log_level says otherwise."""

    def __init__(self, engine, app, port: int | None = None, log_level: str = "warning") -> None:
        self.engine = engine
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    **uvicorn_logging(log_level)))
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
