"""Base weights prefetched into L2 ahead of the GEMM that reads them, beside latency-bound kernels.

Why: at batch 64 on the H200 the FP8 decode step runs at ~1.40x its byte floor. Its expert GEMMs stream their
weights near the copy bandwidth (gate_up 403 MB in 98 µs a layer), but ~60 µs of each 212 µs layer are small
latency-bound kernels (the router, the alignment, norms, attention, the dense GEMMs) during which HBM mostly idles.
A prefetch kernel on a stream of its own, forked before such a stretch, moves the first bytes the next big GEMM
reads into L2 then (the H200 has 50 MB of it), so that the GEMM reads fewer bytes from HBM.

What is prefetched (set_weight_l2_prefetch / MOELORA_WEIGHT_L2_PREFETCH):
  "experts": forked before the post-attention norm (beside it, the router and the alignment), the first
      `expert_l2_prefetch_rows()` output rows of every expert's gate_up_proj. The grouped expert GEMM's grid runs
      the expert blocks fastest (pid_m), so its first wave reads the first column tiles of every expert: those rows.
  "dense": forked at the layer's start (beside the input norm), qkv_proj's and o_proj's weights.
  "both"; "0" (the default): none.
The form (set_l2_prefetch_form / MOELORA_L2_PREFETCH_FORM): "line" (PTX prefetch.global.L2, one 128-byte line a
lane) or "bulk" (sm_90's cp.async.bulk.prefetch.L2, one 16 KB range a lane, issued by the TMA unit).
Nothing is read into registers or written: every result is the same with or without it (prefetch_ref is a no-op).
GPU only (inline PTX); on the CPU and under the interpreter nothing is launched.

Measured in session 39 (H200, fp8 Qwen3-30B-A3B, `bench/results/*-s39-callA-*`), and lost, so off:
- scripts/bench_l2_prefetch.py, gate_up at 64 tokens after a 12.7 µs spin on one SM (HBM idle): 112.2 µs without,
  110.9 with 128 rows (33.6 MB) prefetched beside the spin, 110.3 at best (256 rows): -1.3 to -1.9 µs where the
  bytes alone would save ~7.5 µs; prefetched beside the GEMM itself, +2.5 to +8.2 µs. qkv / o_proj after a 6.6 µs
  spin: -0.3 / -0.4 µs.
- End to end (one A/B process, two rounds, 128/128 batch 64, 0 / 4 adapters): "experts" -2.5% / -2.3% (bulk form
  -2.7% / -2.3%, 256 rows -3.4% / -3.1%), "dense" -2.0% / -1.1%, "both" -3.7% / -3.4%: the prefetch traffic slows
  the latency-bound kernels beside it (the router, the norms) more than the GEMM gains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels._triton import HAS_TRITON, _env_choice, _env_int_default

PREFETCH_MODES = ("0", "experts", "dense", "both")
PREFETCH_FORMS = ("line", "bulk")
PREFETCH_MAX_ROWS = 256  # token rows: decode batches (the CUDA graphs' sizes); prefill GEMMs are compute-bound
PIECE_BYTES = 1 << 18  # a program's share of a range: 256 KB (one expert's first 128 rows of gate_up at H 2048)
LINE_BYTES = 128
BULK_BYTES = 1 << 14  # one cp.async.bulk.prefetch per lane: 16 KB

_MODE = _env_choice("MOELORA_WEIGHT_L2_PREFETCH", "0", PREFETCH_MODES)
_FORM = _env_choice("MOELORA_L2_PREFETCH_FORM", "line", PREFETCH_FORMS)
_ROWS = [_env_int_default("MOELORA_EXPERT_L2_PREFETCH_ROWS", 128, minimum=1)]
_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def set_weight_l2_prefetch(mode: str) -> None:
    """Which base weights are prefetched into L2 (module doc): "0", "experts", "dense" or "both". Read when CUDA
    graphs are captured; the same results either way."""
    if mode not in PREFETCH_MODES:
        raise ValueError(f"set_weight_l2_prefetch: one of {PREFETCH_MODES}, got {mode!r}")
    _MODE[0] = mode


def weight_l2_prefetch() -> str:
    return _MODE[0]


def set_expert_l2_prefetch_rows(rows: int) -> None:
    """How many output rows of each expert's gate_up_proj the "experts" prefetch takes (default 128: 32 MB a layer
    at Qwen3-30B-A3B's 128 experts x 2,048 FP8 columns)."""
    if rows < 1:
        raise ValueError(f"set_expert_l2_prefetch_rows: rows must be >= 1, got {rows}")
    _ROWS[0] = int(rows)


def expert_l2_prefetch_rows() -> int:
    return _ROWS[0]


def set_l2_prefetch_form(form: str) -> None:
    """"line" (prefetch.global.L2 a 128-byte line a lane) or "bulk" (cp.async.bulk.prefetch.L2, sm_90)."""
    if form not in PREFETCH_FORMS:
        raise ValueError(f"set_l2_prefetch_form: one of {PREFETCH_FORMS}, got {form!r}")
    _FORM[0] = form


def l2_prefetch_form() -> str:
    return _FORM[0]


@dataclass(frozen=True)
class PrefetchRange:
    """`count` byte ranges of `nbytes` each at `tensor`'s storage + i * stride bytes (i < count), cut at `limit`
    bytes from the start (the tensor's end)."""

    tensor: torch.Tensor
    count: int
    stride: int
    nbytes: int
    limit: int


def expert_rows_range(w: torch.Tensor, rows: int) -> PrefetchRange:
    """The first `rows` output rows of every expert of w: [E, N, K] (row-major per expert): E ranges of
    min(rows, N) * K elements, one expert apart."""
    if w.dim() != 3 or w.stride(2) != 1 or w.stride(1) != w.shape[2]:
        raise ValueError(f"L2 prefetch: expected an expert stack [E, N, K] with contiguous rows, found "
                         f"{tuple(w.shape)} with strides {tuple(w.stride())}")
    es = w.element_size()
    return PrefetchRange(w, w.shape[0], w.stride(0) * es, min(rows, w.shape[1]) * w.shape[2] * es,
                         w.stride(0) * es * w.shape[0])


def whole_range(w: torch.Tensor) -> PrefetchRange:
    """All of a contiguous tensor, in PIECE_BYTES pieces (one program each)."""
    if not w.is_contiguous():
        raise ValueError(f"L2 prefetch: expected a contiguous weight, found {tuple(w.shape)} with strides "
                         f"{tuple(w.stride())}")
    total = w.numel() * w.element_size()
    return PrefetchRange(w, -(-total // PIECE_BYTES), PIECE_BYTES, PIECE_BYTES, total)


def prefetch_ref(ranges: list[PrefetchRange]) -> None:
    """The reference of l2_prefetch: nothing (a prefetch changes no value)."""
    return None


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_prefetch_kernel(ptr, stride, nbytes, limit, CHUNK: tl.constexpr, LANES: tl.constexpr,
                            BULK: tl.constexpr):
        # program g: bytes [g * stride, g * stride + nbytes) of ptr, cut at limit, CHUNK bytes a lane
        g = tl.program_id(0).to(tl.int64)
        base = ptr.to(tl.pointer_type(tl.int8))
        start = g * stride
        end = tl.minimum(start + nbytes, limit)
        lanes = tl.arange(0, LANES).to(tl.int64) * CHUNK
        for o0 in range(0, nbytes, LANES * CHUNK):
            a = start + o0 + lanes
            live = a < end
            p = base + tl.where(live, a, start)  # a dead lane repeats the range's first line (harmless)
            if BULK:
                size = tl.where(live, tl.minimum(end - a, CHUNK), 16).to(tl.int32)
                tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                          [p, size], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(ranges: list[PrefetchRange], form: str | None = None) -> None:
    """Semantics: none (prefetch_ref): each range's bytes are asked into L2 and nothing is read or written.
    One launch per range: program i takes range i (`count` programs), "line" form 128 bytes a lane (4 warps,
    1,024 lanes), "bulk" form BULK_BYTES a lane (1 warp, 32 lanes; nbytes and stride multiples of 16). CUDA tensors
    only (CPU tensors: nothing happens). CUDA-graph safe."""
    form = form or _FORM[0]
    if form not in PREFETCH_FORMS:
        raise ValueError(f"l2_prefetch: form must be one of {PREFETCH_FORMS}, got {form!r}")
    for r in ranges:
        if not (HAS_TRITON and r.tensor.is_cuda) or r.count == 0 or r.nbytes == 0:
            continue
        bulk = form == "bulk"
        if bulk and (r.nbytes % 16 or r.stride % 16 or r.tensor.data_ptr() % 16):
            raise ValueError(f"l2_prefetch: the bulk form needs 16-byte multiples, found nbytes {r.nbytes}, stride "
                             f"{r.stride}, address {r.tensor.data_ptr()} of a {tuple(r.tensor.shape)} tensor")
        _l2_prefetch_kernel[(r.count,)](r.tensor, r.stride, r.nbytes, r.limit,
                                        CHUNK=BULK_BYTES if bulk else LINE_BYTES, LANES=32 if bulk else 1024,
                                        BULK=bulk, num_warps=1 if bulk else 4)


def prefetch_stream(device: torch.device) -> "torch.cuda.Stream":
    """The prefetch kernels' stream, one per GPU, at high priority (its kernels take SMs before the pending CTAs of
    whatever runs beside them); created on first use, outside graph capture (the warm-up runs first)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _STREAMS:
        _STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)
    return _STREAMS[idx]


class LayerPrefetch:
    """One decoder layer's prefetches: `dense_weights()` at its start, `expert_weights()` before the post-attention
    norm, `join()` at its end (the main stream waits for the prefetch stream, as a graph capture requires)."""

    def __init__(self, x: torch.Tensor, mode: str) -> None:
        self.mode = mode
        self.stream = prefetch_stream(x.device)
        self.main: torch.cuda.Stream | None = None

    @staticmethod
    def start(x: torch.Tensor) -> "LayerPrefetch | None":
        """A LayerPrefetch when the switch is on and x is a CUDA decode batch (<= PREFETCH_MAX_ROWS rows)."""
        mode = _MODE[0]
        if mode == "0" or not (HAS_TRITON and x.is_cuda) or x.shape[0] > PREFETCH_MAX_ROWS:
            return None
        idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if idx not in _STREAMS and torch.cuda.is_current_stream_capturing():
            return None  # its stream is made outside a capture (the warm-up before every capture runs eagerly)
        return LayerPrefetch(x, mode)

    def _launch(self, ranges: list[PrefetchRange]) -> None:
        if not ranges:
            return
        from moelora.kernels.streams import fork

        main = fork(self.stream)
        self.main = self.main or main
        with torch.cuda.stream(self.stream):
            l2_prefetch(ranges)

    def dense_weights(self, *linears) -> None:
        if self.mode in ("dense", "both"):
            self._launch([whole_range(w) for w in (_fp8_or_plain_weight(m) for m in linears) if w is not None])

    def expert_weights(self, mlp) -> None:
        w = getattr(getattr(mlp, "experts", None), "gate_up_proj", None)
        if self.mode in ("experts", "both") and isinstance(w, torch.Tensor) and w.dim() == 3:
            self._launch([expert_rows_range(w, _ROWS[0])])

    def join(self) -> None:
        if self.main is not None:
            from moelora.kernels.streams import join

            join(self.main, self.stream)


def _fp8_or_plain_weight(module) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous() else None
