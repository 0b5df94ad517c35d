"""Triton availability and version checks, in one place."""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
except ImportError:  # the CPU path needs no Triton
    HAS_TRITON = False
    TRITON_VERSION = (0, 0)

MIN_TRITON = (3, 6)


class DeviceError(RuntimeError):
    """This machine lacks what a requested path needs (a CUDA GPU, its compute capability, Triton); the message
    says what to install or which option to change. The command line prints it without a traceback."""


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> list[str]:
    """[the value of environment variable `name`] (unset or empty: default), checked against choices."""
    v = os.environ.get(name, default) or default
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")
    return [v]


def _env_int_default(name: str, default: int, minimum: int | None = None) -> int:
    """The integer in environment variable `name` (unset or empty: default); anything else, or a value below
    `minimum`, is an error naming it."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be an integer{bound}, got {raw!r}")
    return value


_DETERMINISTIC = [os.environ.get("MOELORA_DETERMINISTIC", "0") == "1"]


def set_deterministic(enabled: bool) -> None:
    """Run-to-run identical LoRA kernels: no split-K atomics (fp32 partial sums then add in a fixed order).
    Slower for decode batches of a few tokens; used by tests that compare graph replay with eager bit for bit.
    Also on with MOELORA_DETERMINISTIC=1."""
    _DETERMINISTIC[0] = bool(enabled)


def deterministic() -> bool:
    return _DETERMINISTIC[0]


_FUSED_LORA = [os.environ.get("MOELORA_FUSED_LORA", "1") != "0"]


def set_fused_lora(enabled: bool) -> None:
    """Routed-expert LoRA deltas of decode-sized batches (P <= GEMV_MAX_PAIRS pairs) through the fused kernel
    (kernels/moe_lora/fused_triton.py: shrink and expand in one launch per projection, no h buffer, no
    zero-fill). On by default: on the H200 it took gate_up 1.2-1.6x and down 1.1-1.3x less time than the
    three-launch chain (1-128 tokens, 4 and 8 adapters, rank 16), 25.2 ms against 26.3 ms per decode step at
    batch 64 with 4 adapters (bench/results/decode-fused-lora-*.json). Off with MOELORA_FUSED_LORA=0."""
    _FUSED_LORA[0] = bool(enabled)


def fused_lora() -> bool:
    return _FUSED_LORA[0]


_GROUPED_LORA = [os.environ.get("MOELORA_GROUPED_LORA", "1") != "0"]


def set_grouped_lora(enabled: bool) -> None:
    """With set_fused_lora on: routed-expert LoRA deltas of GROUPED_MIN_PAIRS..2,048 pairs (default from 2,048:
    batch 256 at top-8; MOELORA_GROUPED_MIN_PAIRS) through the grouped kernel (kernels/moe_lora/grouped_triton.py:
    pairs grouped by (slot, expert), each group's A and B read once, one alignment a layer) instead of the per-pair
    fused kernel, when max_loras x E <= GROUPED_MAX_GROUPS. On by default: on the H200 (Qwen3-30B-A3B
    fp8, rank 16, one run) batch 256 decoded 11,438 tok/s with 4 adapters and 10,341 with 8 against 10,565 /
    9,809 per-pair; at batch 64 it was no faster (4,182 against 4,194 with 4 adapters, 3,860 against 4,068 with
    8). Off with MOELORA_GROUPED_LORA=0. CUDA graphs keep the path they captured: set it before capture."""
    _GROUPED_LORA[0] = bool(enabled)


def grouped_lora() -> bool:
    return _GROUPED_LORA[0]


def _defer_env() -> list[str]:
    v = os.environ.get("MOELORA_DENSE_LORA_DEFER", "fp8") or "fp8"
    if v not in ("0", "1", "fp8"):
        raise ValueError(f"MOELORA_DENSE_LORA_DEFER must be 0, 1 or fp8, got {v!r}")
    return [v]


_DENSE_LORA_DEFER = _defer_env()


def set_dense_lora_defer(mode: bool | str) -> None:
    """Dense LoRA deferred to the next kernel (MOELORA_DENSE_LORA_DEFER): at decode sizes on a GPU, a
    decoder layer's qkv_proj and o_proj run their plain base GEMM on the main stream while their LoRA shrink and a
    delta kernel (kernels/lora/delta_triton.py, every row written) run on the side stream; the kernel reading the
    GEMM's output next adds the delta as it loads it (qk_norm_rope: q, k and the v written to the cache; the
    post-attention RMSNorm: o_proj's output before the residual add). No add or zero-fill launch. The delta is
    rounded to the activation dtype before it is added, as PEFT rounds it (the FP8 GEMM's LoRA epilogue adds it
    in fp32). Modes: "fp8" (the default) on FP8 bases, where it was measured (fp8 128/128 batch 64,
    three A/B processes: +1.1% / +0.7% / +0.6% with 4 adapters, +2.2% / +1.9% / +1.8% with 8); "1" (or True) on every base; "0" (or
    False) never. CUDA graphs record the streams: set it before they are captured."""
    mode = {True: "1", False: "0"}.get(mode, mode) if isinstance(mode, bool) else str(mode)
    if mode not in ("0", "1", "fp8"):
        raise ValueError(f"set_dense_lora_defer: mode must be True / False / '0' / '1' / 'fp8', got {mode!r}")
    _DENSE_LORA_DEFER[0] = mode


def dense_lora_defer() -> str:
    """set_dense_lora_defer's mode: "0", "1" or "fp8"."""
    return _DENSE_LORA_DEFER[0]


def _env_k_per_split() -> list[int]:
    raw = os.environ.get("MOELORA_DENSE_DEFER_K_PER_SPLIT", "") or "0"
    if not raw.isdigit() or (int(raw) and (int(raw) < 64 or int(raw) & (int(raw) - 1))):
        raise ValueError(f"MOELORA_DENSE_DEFER_K_PER_SPLIT must be 0 (the default) or a power of two >= 64, got {raw!r}")
    return [int(raw)]


_DENSE_DEFER_K_PER_SPLIT = _env_k_per_split()


def set_dense_defer_k_per_split(k: int = 0) -> None:
    """The deferred shrink's split-K by its input width (MOELORA_DENSE_DEFER_K_PER_SPLIT): k > 0 splits H into
    min(8, H // k) parts, so each walks k inputs (k=512: qkv's 2,048 in 4 splits, o_proj's 4,096 in 8); 0: the
    default, DEFER_SHRINK_K_PER_SPLIT (layers/linear.py, 512). set_lora_shrink_config's splits,
    when set, win. The same sums up to fp32 order; CUDA graphs keep what they captured."""
    if k < 0 or (k and (k < 64 or k & (k - 1))):
        raise ValueError(f"set_dense_defer_k_per_split: 0 or a power of two >= 64, got {k}")
    _DENSE_DEFER_K_PER_SPLIT[0] = int(k)


def dense_defer_k_per_split() -> int:
    """set_dense_defer_k_per_split's k; 0 = the default (DEFER_SHRINK_K_PER_SPLIT)."""
    return _DENSE_DEFER_K_PER_SPLIT[0]


_LORA_SHARED_A = [os.environ.get("MOELORA_LORA_SHARED_A", "1") != "0"]


def set_lora_shared_a(enabled: bool) -> None:
    """Routed-expert gate / up slices that hold the same A (LoRAWeights.a_src: e.g. PEFT's target_parameters on
    fused gate_up experts, transformers 5's Qwen3-MoE layout) read one copy of it in the fused decode kernel
    and the grouped one: the up programs read the gate's copy, which the gate programs of the same pair (group) read
    too, from L2, so HBM sees that A once instead of twice (a quarter of a rank-16 Qwen3-30B-A3B pair's bytes).
    On by default (MOELORA_LORA_SHARED_A=0 turns it off): fp8 128/128 batch 64, shared-A adapters (bench
    decode --expert-lora-layout shared-a), one A/B process: +0.96% / +1.25% with 4 / 8 adapters. The values read are
    the same either way, so are the results. CUDA graphs keep what they captured: set it before."""
    _LORA_SHARED_A[0] = bool(enabled)


def lora_shared_a() -> bool:
    return _LORA_SHARED_A[0]


_MOE_LORA_EARLY_MODES = ("0", "1", "2")
_MOE_LORA_EARLY = _env_choice("MOELORA_MOE_LORA_EARLY", "2", _MOE_LORA_EARLY_MODES)


def set_moe_lora_early(mode: bool | str) -> None:
    """gate_up's routed-expert LoRA kernel issued before the experts' alignment is done (MOELORA_MOE_LORA_EARLY):
    on the Triton fast path, overlapping on the side stream, with the fused kernel, it waits only for the routing
    (it reads x, the top-k ids and the slots, not the alignment), so it runs beside the alignment (one program,
    ~3.9 µs a layer at batch 64) instead of after it. Why: the gate_up GEMM starts ~10 µs after its LoRA kernel
    began (the LoRA kernel's CTAs fill the SMs first); starting that kernel earlier would start the GEMM earlier.
    "1" (True): the alignment on the main stream. Measured (fp8 128/128 batch 64, one A/B process, two rounds):
    -1.47% / -1.14% with 4 / 8 adapters; its trace had the alignment at 21 µs instead of 4: its one program, on the
    main stream's normal priority, waited behind the LoRA kernel's 1,024 high-priority CTAs.
    "2" (the default): the alignment launched on a stream of its own above the side stream's
    priority (streams.align_stream), so its program is placed before the LoRA kernel's, which fills the rest of the
    GPU beside it. The same A/B process: +1.68% / +1.93% with 4 / 8 adapters (90.6% / 89.6% kept); trace:
    the alignment 4.4 µs, the gate_up GEMM starting right after it beside the LoRA kernel, the layer 241.1 -> 236.9
    µs; the early launch with the side stream at normal priority gave +0.97% / +1.10%.
    "0" (False): off. The same kernels and values (GPU test: bit-equal); CUDA graphs keep what they captured."""
    raw = {True: "1", False: "0"}.get(mode, mode) if isinstance(mode, bool) else str(mode)
    if raw not in _MOE_LORA_EARLY_MODES:
        raise ValueError(f"set_moe_lora_early: expected False/True or '0', '1', '2', got {mode!r}")
    _MOE_LORA_EARLY[0] = raw


def moe_lora_early() -> bool:
    """set_moe_lora_early on (mode "1" or "2")."""
    return _MOE_LORA_EARLY[0] != "0"


def moe_lora_early_mode() -> str:
    """set_moe_lora_early's mode: "0", "1" or "2" (the alignment on its own higher-priority stream)."""
    return _MOE_LORA_EARLY[0]


_MOE_LORA_EARLY_DOWN = [os.environ.get("MOELORA_MOE_LORA_EARLY_DOWN", "1") != "0"]


def set_moe_lora_early_down(enabled: bool) -> None:
    """The down projection's routed-expert LoRA kernel issued as soon as the gate_up GEMM is done, before the
    activation kernel (MOELORA_MOE_LORA_EARLY_DOWN=1): with set_moe_lora_early on, the fused per-pair kernel, SiLU,
    it reads gate_up's output and delta and computes each row's activation itself (moe_lora_fused(act_in=True): the
    numbers silu_and_mul writes, by the same operations), so it runs beside the activation kernel as well as the
    down GEMM. Why: a trace (an A each, 4 adapters) had the down phase +8.8 µs a layer for 7.1 µs of
    LoRA bytes, the activation's ~3 µs leaving the HBM idle just before it. On by default (fp8 128/128 batch 64, 4 adapters with an A each, one A/B process, two rounds: +0.75% (+0.82% / +0.68%),
    89.7% -> 90.4% kept); =0 turns it off. The same values bit for bit (GPU test); CUDA graphs keep what they
    captured."""
    _MOE_LORA_EARLY_DOWN[0] = bool(enabled)


def moe_lora_early_down() -> bool:
    return _MOE_LORA_EARLY_DOWN[0]


_LORA_EVEN_R = [os.environ.get("MOELORA_LORA_EVEN_R", "1") != "0"]


def set_lora_even_r(enabled: bool) -> None:
    """LoRA expands with tensor-core dots (lora_expand, the FP8 GEMM's LoRA tile, the grouped routed-expert kernel):
    when the buffers' rank is a multiple of the rank tile, h and B are read in whole rank rows (16-byte loads) and
    the entries past each slot's rank zeroed after the load, instead of under a per-element rank mask (2-byte
    loads); the same values. On by default (fp8 128/128 with the routed kernel pipelined: batch 64 with
    4 / 8 adapters 5,180 / 5,029 tok/s against 5,151 / 4,978 without; batch 256 13,633 / 12,386 against
    13,390 / 11,994 before); MOELORA_LORA_EVEN_R=0 turns it off. (The per-pair routed kernel takes that form with
    its pipelined loops, set_fused_lora_pipeline.)"""
    _LORA_EVEN_R[0] = bool(enabled)


def lora_even_r() -> bool:
    return _LORA_EVEN_R[0]


def _delta_env() -> list[str]:
    v = os.environ.get("MOELORA_LORA_DELTA_DTYPE", "activation") or "activation"
    if v not in ("fp32", "activation"):
        raise ValueError(f"MOELORA_LORA_DELTA_DTYPE must be fp32 or activation, got {v!r}")
    return [v]


_LORA_DELTA = _delta_env()


def set_lora_delta_dtype(kind: str) -> None:
    """The dtype of the routed-expert LoRA deltas the side stream hands the activation and combine kernels:
    "activation" (default: the activations' dtype, bf16 / fp16; the delta is rounded once before it is added, as
    PEFT's bf16 LoRA output is) or "fp32" (MOELORA_LORA_DELTA_DTYPE=fp32: twice the bytes written and read, ~15 MB a
    layer at 64 tokens). Measured (batch 64 fp8, 128/128, 0 / 4 / 8 adapters, tok/s): activation 6,115 /
    5,196 / 5,039 against fp32 6,124 / 5,150 / 4,993. CUDA graphs record the buffers: set it before they are
    captured."""
    if kind not in ("fp32", "activation"):
        raise ValueError(f"set_lora_delta_dtype: expected fp32 or activation, got {kind!r}")
    _LORA_DELTA[0] = kind


def lora_delta_dtype(activation_dtype):
    """torch dtype of a LoRA delta buffer beside activations of activation_dtype (set_lora_delta_dtype)."""
    import torch

    return torch.float32 if _LORA_DELTA[0] == "fp32" else activation_dtype


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton() -> None:
    if not HAS_TRITON:
        raise DeviceError("the GPU kernels need Triton: pip install 'triton>=3.6' (it comes with CUDA builds of torch)")
    if TRITON_VERSION < MIN_TRITON:
        raise DeviceError(f"Triton {TRITON_VERSION} is too old for moelora's kernels; install triton>=3.6")


def dot_precision(dtype) -> str | None:
    """fp32 operands: exact IEEE products (Triton would pick tf32); 16-bit operands: Triton's default."""
    import torch

    return "ieee" if dtype == torch.float32 else None
