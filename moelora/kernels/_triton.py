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
_FUSED_DENSE_LORA = [os.environ.get("MOELORA_FUSED_DENSE_LORA", "0") == "1"]


def set_fused_lora(enabled: bool) -> None:
    """Routed-expert LoRA deltas of decode-sized batches (P <= GEMV_MAX_PAIRS pairs) through the fused kernel
    (kernels/moe_lora_fused_triton.py: shrink and expand in one launch per projection, no h buffer, no
    zero-fill). On by default: on the H200 it took gate_up 1.2-1.6x and down 1.1-1.3x less time than the
    three-launch chain (1-128 tokens, 4 and 8 adapters, rank 16), 25.2 ms against 26.3 ms per decode step at
    batch 64 with 4 adapters (bench/results/decode-fused-lora-*.json). Off with MOELORA_FUSED_LORA=0."""
    _FUSED_LORA[0] = bool(enabled)


def fused_lora() -> bool:
    return _FUSED_LORA[0]


_GROUPED_LORA = [os.environ.get("MOELORA_GROUPED_LORA", "1") != "0"]


def set_grouped_lora(enabled: bool) -> None:
    """With set_fused_lora on: routed-expert LoRA deltas of GROUPED_MIN_PAIRS..2,048 pairs (default from 2,048:
    batch 256 at top-8; MOELORA_GROUPED_MIN_PAIRS) through the grouped kernel (kernels/moe_lora_grouped_triton.py:
    pairs grouped by (slot, expert), each group's A and B read once, one alignment a layer) instead of the per-pair
    fused kernel, when max_loras x E <= GROUPED_MAX_GROUPS. On by default: on the H200 (session 9, Qwen3-30B-A3B
    fp8, rank 16, one run) batch 256 decoded 11,438 tok/s with 4 adapters and 10,341 with 8 against 10,565 /
    9,809 per-pair; at batch 64 it was no faster (4,182 against 4,194 with 4 adapters, 3,860 against 4,068 with
    8). Off with MOELORA_GROUPED_LORA=0. CUDA graphs keep the path they captured: set it before capture."""
    _GROUPED_LORA[0] = bool(enabled)


def grouped_lora() -> bool:
    return _GROUPED_LORA[0]


def set_fused_dense_lora(enabled: bool) -> None:
    """Dense (attention) LoRA deltas of T <= FUSED_DENSE_MAX_TOKENS tokens through the fused kernel
    (kernels/lora_fused_triton.py). Off by default: on the H200 it was slower than the shrink/expand kernels
    for o_proj at every size and for qkv from 16 tokens (0.7-0.95x). On with MOELORA_FUSED_DENSE_LORA=1."""
    _FUSED_DENSE_LORA[0] = bool(enabled)


def fused_dense_lora() -> bool:
    return _FUSED_DENSE_LORA[0]


_DENSE_LORA_OVERLAP = [os.environ.get("MOELORA_DENSE_LORA_OVERLAP", "0") == "1"]


def set_dense_lora_overlap(enabled: bool) -> None:
    """Dense (attention / dense MLP) LoRA chains on the side CUDA stream beside their base GEMM, in modules whose
    `overlap` is on (--lora-overlap); modules without it compute the same delta on the main stream, then add it
    (bit-equal). On an FP8 base the GEMM then runs without its LoRA epilogue and the delta is added after it: one
    bf16 rounding more than the epilogue. Off by default (session 13, on a base twice as slow as now: no gain;
    session 21, fp8 128/128 batch 64: 5,008 / 4,900 against 5,120 / 4,966 tok/s with 4 / 8 adapters, -2.2% /
    -1.3%); on with MOELORA_DENSE_LORA_OVERLAP=1. CUDA graphs record the
    streams: set it before they are captured."""
    _DENSE_LORA_OVERLAP[0] = bool(enabled)


def dense_lora_overlap() -> bool:
    return _DENSE_LORA_OVERLAP[0]


def _defer_env() -> list[str]:
    v = os.environ.get("MOELORA_DENSE_LORA_DEFER", "fp8") or "fp8"
    if v not in ("0", "1", "fp8"):
        raise ValueError(f"MOELORA_DENSE_LORA_DEFER must be 0, 1 or fp8, got {v!r}")
    return [v]


_DENSE_LORA_DEFER = _defer_env()
_DENSE_DEFER_PDL = [os.environ.get("MOELORA_DENSE_DEFER_PDL", "0") == "1"]


def set_dense_lora_defer(mode: bool | str) -> None:
    """Dense LoRA deferred to the next kernel (session 24; MOELORA_DENSE_LORA_DEFER): at decode sizes on a GPU, a
    decoder layer's qkv_proj and o_proj run their plain base GEMM on the main stream while their LoRA shrink and a
    delta kernel (kernels/lora_delta_triton.py, every row written) run on the side stream; the kernel reading the
    GEMM's output next adds the delta as it loads it (qk_norm_rope: q, k and the v written to the cache; the
    post-attention RMSNorm: o_proj's output before the residual add). No add or zero-fill launch. The delta is
    rounded to the activation dtype before it is added, as PEFT rounds it (the FP8 GEMM's LoRA epilogue adds it
    in fp32). Modes: "fp8" (the default) on FP8 bases, where it was measured (session 24, fp8 128/128 batch 64,
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
    default, DEFER_SHRINK_K_PER_SPLIT (layers/linear.py, 512 since session 28). set_lora_shrink_config's splits,
    when set, win. The same sums up to fp32 order; CUDA graphs keep what they captured."""
    if k < 0 or (k and (k < 64 or k & (k - 1))):
        raise ValueError(f"set_dense_defer_k_per_split: 0 or a power of two >= 64, got {k}")
    _DENSE_DEFER_K_PER_SPLIT[0] = int(k)


def dense_defer_k_per_split() -> int:
    """set_dense_defer_k_per_split's k; 0 = the default (DEFER_SHRINK_K_PER_SPLIT)."""
    return _DENSE_DEFER_K_PER_SPLIT[0]


def set_dense_defer_pdl(enabled: bool) -> None:
    """The deferred chain's delta kernel launched with PDL right after its shrink (MOELORA_DENSE_DEFER_PDL=1). Off by
    default: in session 24 (fp8 128/128 batch 64, one A/B process) it lost 2-3% against the plain launch (its
    programs, started early, wait on SMs the base GEMM beside them needs). Results do not change."""
    _DENSE_DEFER_PDL[0] = bool(enabled)


def dense_defer_pdl() -> bool:
    return _DENSE_DEFER_PDL[0]


_LORA_SHARED_A = [os.environ.get("MOELORA_LORA_SHARED_A", "1") != "0"]


def set_lora_shared_a(enabled: bool) -> None:
    """Routed-expert gate / up slices that hold the same A (LoRAWeights.a_src: e.g. PEFT's target_parameters on
    fused gate_up experts, transformers 5's Qwen3-MoE layout) read one copy of it in the fused decode kernel
    and the grouped one: the up programs read the gate's copy, which the gate programs of the same pair (group) read
    too, from L2, so HBM sees that A once instead of twice (a quarter of a rank-16 Qwen3-30B-A3B pair's bytes).
    On by default (MOELORA_LORA_SHARED_A=0 turns it off): session 26, fp8 128/128 batch 64, shared-A adapters (bench
    decode --expert-lora-layout shared-a), one A/B process: +0.96% / +1.25% with 4 / 8 adapters. The values read are
    the same either way, so are the results. CUDA graphs keep what they captured: set it before."""
    _LORA_SHARED_A[0] = bool(enabled)


def lora_shared_a() -> bool:
    return _LORA_SHARED_A[0]


_LORA_SHARED_H = [os.environ.get("MOELORA_LORA_SHARED_H", "0") == "1"]


def set_lora_shared_h(enabled: bool) -> None:
    """With set_lora_shared_a on: in the fused routed-expert decode kernel, the gate program of a pair whose up
    slice reads the gate's A also expands the up slice from the same h (one shrink a pair instead of two; the up
    programs return at once) (MOELORA_LORA_SHARED_H=1). Measured in session 26 (one A/B process, shared-A
    adapters): -0.49% / -0.15% with 4 / 8 adapters, so it stays off; results do not change. CUDA graphs keep what
    they captured: set it before."""
    _LORA_SHARED_H[0] = bool(enabled)


def lora_shared_h() -> bool:
    return _LORA_SHARED_H[0]


_DENSE_DEFER_ORDER = _env_choice("MOELORA_DENSE_DEFER_ORDER", "chain", ("chain", "gemm", "serial", "main"))


def set_dense_defer_order(order: str) -> None:
    """Which of the deferred dense LoRA's two branches is issued first (MOELORA_DENSE_DEFER_ORDER): "chain" (the
    default) the side stream's shrink (and delta kernel), then the base GEMM; "gemm" the GEMM first, the chain
    after it (still waiting only for the GEMM's input). A CUDA graph keeps its nodes in capture order, and the
    order decides whose CTAs get the SMs first: session 25's trace had the GEMM at 14 µs beside a 6-µs shrink
    against 8.4-9.5 alone, as if its CTAs waited for the shrink's. "serial" (a diagnostic): no side stream, the
    chain then the GEMM on the main stream. "gemm" measured in session 25 (call 2, fp8 128/128 batch 64, one A/B
    process): -0.1% / +0.1% with 4 / 8 adapters; the o_proj GEMM still took 14.3 µs. "main": the chain on the main
    stream, issued right after the kernel that wrote its input, the GEMM on the side stream (into an output made on
    the main stream); with set_lora_shrink_pdl the shrink is PDL-launched after that producer (which lets it start
    at once) and reads its first A tiles while the producer runs — the deferred chain started 0.4 µs after its
    producer and ended 1.1-1.3 µs after its GEMM in session 29's trace (FP8 bases; unmeasured). Results do not
    change; set it before capture."""
    if order not in ("chain", "gemm", "serial", "main"):
        raise ValueError(f"set_dense_defer_order: expected 'chain', 'gemm', 'serial' or 'main', got {order!r}")
    _DENSE_DEFER_ORDER[0] = order


def dense_defer_order() -> str:
    return _DENSE_DEFER_ORDER[0]


_MOE_LORA_ORDERS = ("lora", "gemm", "gate_up", "down")


_MOE_LORA_ORDER = _env_choice("MOELORA_MOE_LORA_ORDER", "lora", _MOE_LORA_ORDERS)


def set_moe_lora_order(order: str) -> None:
    """Which branch of an overlapped routed-expert projection is issued (and captured) first
    (MOELORA_MOE_LORA_ORDER): "lora" (the default) the side stream's LoRA kernel, then the base expert GEMM; "gemm"
    the GEMM first on both projections, the LoRA kernel after it on the side stream, waiting only for the
    GEMM's input; "gate_up" / "down" the GEMM first on that projection only. Why: session 27's trace (fp8 128/128
    batch 64, 4 adapters) had the gate_up GEMM start 11.6 µs after its LoRA kernel (whose CTAs, from the
    high-priority stream, fill the SMs first), the phase 12.9 µs longer than without adapters for ~8.6 µs of
    LoRA bytes, while the down GEMM started with its LoRA kernel and grew 8.2 µs for ~7. Measured in session 28
    (fp8 128/128 batch 64, one A/B process each): "gemm" +0.08% and "gate_up" -0.00% with 4 adapters, and beside
    session 28's dense defaults +0.74% / +0.82% against +0.75% / +0.74% without it: no difference, "lora" stays.
    Results do not change; CUDA graphs keep what they captured."""
    if order not in _MOE_LORA_ORDERS:
        raise ValueError(f"set_moe_lora_order: expected one of {_MOE_LORA_ORDERS}, got {order!r}")
    _MOE_LORA_ORDER[0] = order


def moe_lora_order() -> str:
    return _MOE_LORA_ORDER[0]


_MOE_LORA_EARLY_MODES = ("0", "1", "2")
_MOE_LORA_EARLY = _env_choice("MOELORA_MOE_LORA_EARLY", "2", _MOE_LORA_EARLY_MODES)


def set_moe_lora_early(mode: bool | str) -> None:
    """gate_up's routed-expert LoRA kernel issued before the experts' alignment is done (MOELORA_MOE_LORA_EARLY):
    on the Triton fast path, overlapping on the side stream, with the fused kernel, it waits only for the routing
    (it reads x, the top-k ids and the slots, not the alignment), so it runs beside the alignment (one program,
    ~3.9 µs a layer at batch 64) instead of after it. Why: the gate_up GEMM starts ~10 µs after its LoRA kernel
    began (the LoRA kernel's CTAs fill the SMs first); starting that kernel earlier would start the GEMM earlier.
    "1" (True): the alignment on the main stream. Session 29 (fp8 128/128 batch 64, one A/B process, two rounds):
    -1.47% / -1.14% with 4 / 8 adapters; its trace had the alignment at 21 µs instead of 4: its one program, on the
    main stream's normal priority, waited behind the LoRA kernel's 1,024 high-priority CTAs.
    "2" (the default since session 29): the alignment launched on a stream of its own above the side stream's
    priority (streams.align_stream), so its program is placed before the LoRA kernel's, which fills the rest of the
    GPU beside it. Session 29, same A/B process: +1.68% / +1.93% with 4 / 8 adapters (90.6% / 89.6% kept); trace:
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
    down GEMM. Why: session 37's trace (an A each, 4 adapters) had the down phase +8.8 µs a layer for 7.1 µs of
    LoRA bytes, the activation's ~3 µs leaving the HBM idle just before it. On by default since session 38 (call
    A: fp8 128/128 batch 64, 4 adapters with an A each, one A/B process, two rounds: +0.75% (+0.82% / +0.68%),
    89.7% -> 90.4% kept); =0 turns it off. The same values bit for bit (GPU test); CUDA graphs keep what they
    captured."""
    _MOE_LORA_EARLY_DOWN[0] = bool(enabled)


def moe_lora_early_down() -> bool:
    return _MOE_LORA_EARLY_DOWN[0]


_MOE_LORA_GU_SPLIT = [os.environ.get("MOELORA_MOE_LORA_GU_SPLIT", "0") == "1"]


def set_moe_lora_gu_split(enabled: bool) -> None:
    """gate_up's routed-expert LoRA as one fused launch a slice (gate, then up, in stream order) instead of one launch
    of both (MOELORA_MOE_LORA_GU_SPLIT=1; the fused kernel in store mode, not with set_lora_shared_h). Why: at batch
    64 the one launch has 1,024 programs, which fill every SM's registers beside nothing else (a CTA of 7,168
    registers, 8-9 an SM), so the base gate_up GEMM started 11.6 µs after it in session 27's trace and that phase
    grew 12.9 µs for ~8.6 µs of LoRA bytes; the down projection's launch, 512 programs, left room for the GEMM's
    CTAs, which started with it, and that phase grew 8.2 µs for ~7. The same values bit for bit; CUDA graphs keep
    what they captured. Measured in session 29 (one A/B process): -1.52% / -2.05% with 4 / 8 adapters, so it stays
    off."""
    _MOE_LORA_GU_SPLIT[0] = bool(enabled)


def moe_lora_gu_split() -> bool:
    return _MOE_LORA_GU_SPLIT[0]


def moe_gemm_first(per_pair: bool) -> bool:
    """Whether set_moe_lora_order issues the base GEMM first for the gate_up (per_pair False) or down projection."""
    order = _MOE_LORA_ORDER[0]
    return order == "gemm" or order == ("down" if per_pair else "gate_up")


_DENSE_DEFER_FUSED = [os.environ.get("MOELORA_DENSE_DEFER_FUSED", "0") == "1"]


def set_dense_defer_fused(enabled: bool) -> None:
    """The deferred dense LoRA's chain as one launch (MOELORA_DENSE_DEFER_FUSED=1): lora_fused_decode in store mode
    writes the delta (shrink and expand in one program a row block, h in registers over the whole input dim)
    instead of the split-K shrink, then lora_delta. Session 26's trace: o_proj's chain (shrink 8.9 + delta 4.3 µs)
    ends ~1.8 µs after its GEMM, on the critical path; qkv's (5.9 + 5.0) beside a GEMM at 13.9 µs against 8.4
    alone. Off: session 27 (fp8 128/128 batch 64, one A/B process) measured -2.5% with 4 / 8 adapters (one 17.0 µs
    launch for o_proj against 8.8 + 4.2). Results change by fp32 summation order of h only (both round h to B's
    dtype before the expand). A producer's shrink (attached_lora_h) still takes the delta kernel."""
    _DENSE_DEFER_FUSED[0] = bool(enabled)


def dense_defer_fused() -> bool:
    return _DENSE_DEFER_FUSED[0]


_DENSE_DEFER_ONE_LAUNCH = [os.environ.get("MOELORA_DENSE_DEFER_ONE_LAUNCH", "0") == "1"]


def set_dense_defer_one_launch(enabled: bool) -> None:
    """The deferred dense LoRA's shrink and delta kernel as one launch (MOELORA_DENSE_DEFER_ONE_LAUNCH=1;
    kernels/lora_chain_triton.py): the shrink's programs first, then the delta's, which load B and wait on a counter
    for the shrink instead of a kernel boundary. Session 32: the two-launch chain is the phase's critical path beside
    the base GEMM. Measured in session 32 (fp8 128/128 batch 64, an A each, one A/B process, two rounds): -1.11%
    with 4 adapters (88.5% kept against 89.5%); beside its GEMM qkv / o_proj 12.1 / 13.1 µs against 11.1 / 11.4, and
    run serially ~3.5 µs longer than the two launches (its shrink has n x split_k programs, 12 / 8). Off. Since
    session 34 its shrink takes lora_shrink's programs by default (set_lora_chain_shrink "grouped"; "stacked" is
    session 32's form). The same sums up to fp32 order; CUDA graphs keep what they captured."""
    _DENSE_DEFER_ONE_LAUNCH[0] = bool(enabled)


def dense_defer_one_launch() -> bool:
    return _DENSE_DEFER_ONE_LAUNCH[0]


# MOELORA_LORA_L2_PREFETCH / set_lora_l2_prefetch (session 37): in the deferred dense LoRA chain, LoRA factors
# prefetched into L2 (PTX prefetch.global.L2, GPU only) before the kernel that reads them, so that its loads do not
# wait on HBM behind the base GEMM's weight stream. Why: session 37's call C gave the qkv GEMM 224 KB of shared
# memory a program (14 stages), so that no chain CTA could share its SMs, and the chain still ended ~2 µs after the
# GEMM (11.9 µs against 9.9 alone): beside the GEMM the chain is longer than alone (7.4 µs), not crowded off SMs;
# each of its kernels waits on an HBM round trip for its factors (the shrink's A, the delta kernel's B) while the
# GEMM streams 8-10 MB. "own": each shrink prefetches its own layer's B for the delta kernel after it; "next": the
# qkv delta kernel prefetches o_proj's A and B (read after the attention); "both". The same sums. Measured in
# session 37 (call D, fp8 128/128 batch 64, an A each, 4 adapters, one A/B process, two rounds): own -0.15% (the
# chain beside its GEMM 11.0 -> 10.8 µs for qkv), next -0.49%, both -0.55%. Off.
L2_PREFETCH_CHOICES = ("0", "own", "next", "both")
_LORA_L2_PREFETCH = _env_choice("MOELORA_LORA_L2_PREFETCH", "0", L2_PREFETCH_CHOICES)


def set_lora_l2_prefetch(mode: str = "0") -> None:
    """Which LoRA factors the deferred dense chain prefetches into L2 (MOELORA_LORA_L2_PREFETCH; the comment above):
    "0" none, "own", "next" or "both". The same sums; CUDA graphs keep what they captured."""
    if mode not in L2_PREFETCH_CHOICES:
        raise ValueError(f"set_lora_l2_prefetch: one of {L2_PREFETCH_CHOICES}, got {mode!r}")
    _LORA_L2_PREFETCH[0] = mode


def lora_l2_prefetch() -> str:
    return _LORA_L2_PREFETCH[0]


_DENSE_DEFER_PRIORITY = _env_choice("MOELORA_DENSE_DEFER_PRIORITY", "high", ("high", "normal"))


def set_dense_defer_priority(priority: str) -> None:
    """Where the deferred dense LoRA chain runs (MOELORA_DENSE_DEFER_PRIORITY): "high" (the default) on the side
    stream of the routed-expert LoRA, whose kernels get SMs first; "normal" on a stream of its own at the main
    stream's priority, so that the base GEMM beside it is not pushed off SMs (session 24's trace: the plain GEMM
    took 14 µs beside the chain against 8-9.5 alone). Measured in session 25 (call 1, fp8 128/128 batch 64, one A/B
    process): -0.1% / +0.4% with 4 / 8 adapters, within the noise; the GEMM stayed at 14 µs. CUDA graphs record the
    streams: set it before they are captured; results do not change."""
    if priority not in ("high", "normal"):
        raise ValueError(f"set_dense_defer_priority: expected 'high' or 'normal', got {priority!r}")
    _DENSE_DEFER_PRIORITY[0] = priority


def dense_defer_priority() -> str:
    return _DENSE_DEFER_PRIORITY[0]


_LORA_SHRINK_PDL = [os.environ.get("MOELORA_LORA_SHRINK_PDL", "0") == "1"]


def set_lora_shrink_pdl(enabled: bool) -> None:
    """The dense FP8 LoRA shrink launched with PDL right after the kernel that writes its input (RMSNorm before
    qkv, decode attention before o_proj), which lets it start at once (producer_launch_dependents): the shrink
    reads its first A tiles while that kernel runs and x after it completes. Off by default until measured;
    MOELORA_LORA_SHRINK_PDL=1. Results do not change; CUDA graphs keep the launches they captured."""
    _LORA_SHRINK_PDL[0] = bool(enabled)


def lora_shrink_pdl_enabled() -> bool:
    """The set_lora_shrink_pdl switch itself (lora_shrink_pdl also asks the device)."""
    return _LORA_SHRINK_PDL[0]


def lora_shrink_pdl(device) -> bool:
    """set_lora_shrink_pdl on, and a GPU of compute capability >= 9.0 (griddepcontrol), not the interpreter."""
    if not (_LORA_SHRINK_PDL[0] and getattr(device, "type", None) == "cuda") or interpreting():
        return False
    import torch

    return torch.cuda.get_device_capability(device) >= (9, 0)


def producer_launch_dependents(device) -> dict:
    """Launch arguments of a kernel that writes a dense LoRA layer's input: {"LAUNCH_DEPENDENTS": True} (every
    program first lets the next kernel start; one launched without PDL ignores it) where lora_shrink_pdl(device)."""
    return {"LAUNCH_DEPENDENTS": True} if lora_shrink_pdl(device) else {}


_LORA_NORM_SHRINK = [os.environ.get("MOELORA_LORA_NORM_SHRINK", "0") == "1"]


def set_lora_norm_shrink(enabled: bool) -> None:
    """The RMSNorm before a decoder layer's qkv projection also writes that projection's LoRA shrink (decode sizes,
    an FP8 base with the LoRA expand in its GEMM): no shrink launch, and the GEMM's LoRA program waits for nothing.
    Off by default: measured in session 21 (bench decode --ab, one process, fp8 128/128 batch 64, all targets) it
    lost, 5,120 / 4,966 -> 4,996 / 4,845 tok/s with 4 / 8 adapters (-2.4%); with MOELORA_LORA_ATTN_SHRINK=1 too
    5,006 / 4,883 (-2.2% / -1.7%). MOELORA_LORA_NORM_SHRINK=1 turns it on.
    Results change by fp32 summation order only; CUDA graphs keep the launches they captured."""
    _LORA_NORM_SHRINK[0] = bool(enabled)


def lora_norm_shrink() -> bool:
    return _LORA_NORM_SHRINK[0]


_LORA_ATTN_SHRINK = [os.environ.get("MOELORA_LORA_ATTN_SHRINK", "0") == "1"]


def set_lora_attn_shrink(enabled: bool) -> None:
    """The split-KV decode attention also writes the o_proj LoRA shrink (decode sizes; an FP8 o_proj with the LoRA
    expand in its GEMM, or the deferred dense LoRA (set_dense_lora_defer), whose chain is then the delta kernel
    alone): one partial per head from its reduce kernel (2+ KV splits: up to ~131 rows on an H200 with 4 KV heads),
    one per KV head from the split kernel writing the output itself (larger batches); the FP8 GEMM's LoRA program or
    the delta kernel sums them as split-K partials. No shrink launch before o_proj. Off by default: measured in
    session 21 only with MOELORA_LORA_NORM_SHRINK=1 (see set_lora_norm_shrink) and the LoRA in the GEMM's epilogue,
    the two together lost 2.2% / 1.7% at batch 64 with 4 / 8 adapters; beside the deferred chain (session 26:
    o_proj's chain, shrink 8.9 + delta 4.3 µs, ends ~1.8 µs after its GEMM) session 27 measured -1.35% / -1.30%
    (the reduce kernel 3.0 -> 5.6 µs, the delta kernel adding 32 per-head partials 4.2 -> 11.4).
    MOELORA_LORA_ATTN_SHRINK=1 turns it on.
    Results change by fp32 summation order only; CUDA graphs keep the launches they captured."""
    _LORA_ATTN_SHRINK[0] = bool(enabled)


def lora_attn_shrink() -> bool:
    return _LORA_ATTN_SHRINK[0]


_LORA_EVEN_R = [os.environ.get("MOELORA_LORA_EVEN_R", "1") != "0"]


def set_lora_even_r(enabled: bool) -> None:
    """LoRA expands with tensor-core dots (lora_expand, the FP8 GEMM's LoRA tile, the grouped routed-expert kernel):
    when the buffers' rank is a multiple of the rank tile, h and B are read in whole rank rows (16-byte loads) and
    the entries past each slot's rank zeroed after the load, instead of under a per-element rank mask (2-byte
    loads); the same values. On by default (session 18, fp8 128/128 with the routed kernel pipelined: batch 64 with
    4 / 8 adapters 5,180 / 5,029 tok/s against 5,151 / 4,978 without; batch 256 13,633 / 12,386 against session
    16's 13,390 / 11,994); MOELORA_LORA_EVEN_R=0 turns it off. (The per-pair routed kernel takes that form with
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
    layer at 64 tokens). Session 19, call 1 (batch 64 fp8, 128/128, 0 / 4 / 8 adapters, tok/s): activation 6,115 /
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
