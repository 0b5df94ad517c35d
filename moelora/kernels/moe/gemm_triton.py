"""The base expert GEMM of the routed experts: one launch over the expert-aligned pairs (align_triton.moe_align),
reading its input rows by index (token rows, no gather copy) and writing pair rows directly; with the gate_up GEMM's
SiLU-and-mul fused. Reference: expert_gemm_ref."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelora.kernels._triton import HAS_TRITON, dot_precision, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of the grouped GEMM. block_m also fixes the padding of the alignment."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(num_pairs: int, fuse_act: bool = False) -> GemmConfig:
    """Autotune-free configs by the number of (token, k) pairs P (Hopper; about P/E rows per expert).
    Decode (P <= 1024, a few rows per expert): weight streaming dominates, so BLOCK_M 16, long K tiles,
    enough N tiles for ~200+ programs. Prefill: 32/64/128-row blocks, wider N tiles, 8 warps for 128 rows.
    fuse_act: the gate_up GEMM with SiLU-and-mul fused keeps two accumulators (gate, up), so its N tile is
    halved (the same programs count as a [P, 2I] GEMM with the full tile)."""
    if num_pairs <= 256:  # T <= 32 at top-8
        cfg = GemmConfig(16, 64, 128, 4, 3)
    elif num_pairs <= 1024:  # T <= 128
        cfg = GemmConfig(16, 128, 128, 4, 3)
    elif num_pairs <= 2048:  # T <= 256
        cfg = GemmConfig(32, 128, 128, 4, 3)
    elif num_pairs <= 4096:  # T <= 512
        cfg = GemmConfig(64, 128, 64, 4, 3)
    else:
        cfg = GemmConfig(128, 128, 64, 8, 3)
    return halved_n(cfg) if fuse_act else cfg


def halved_n(cfg: GemmConfig) -> GemmConfig:
    """The config of the gate_up GEMM with SiLU-and-mul fused: two accumulators, half the N tile."""
    return GemmConfig(cfg.block_m, max(32, cfg.block_n // 2), cfg.block_k, cfg.num_warps, cfg.num_stages)


def expert_gemm_ref(inp: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, gather_rows: bool,
                    pair_weights: torch.Tensor | None = None, fuse_act: bool = False) -> torch.Tensor:
    """Semantics: for p in range(T*K): e = topk_ids.flatten()[p]; row = inp[p // K] if gather_rows else inp[p]
        y = w[e] @ row                                  # [O], fp32 accumulation
        fuse_act: y = silu(y[:O/2]) * y[O/2:]           # gate rows first
        out[p] = y * pair_weights[p] (if given)
    inp: [T, D] (gather_rows) or [T*K, D] · w: [E, O, D] · pair_weights: [T*K] · returns [T*K, O or O/2]
    """
    T, K = topk_ids.shape
    rows = inp.float()[torch.arange(T * K, device=inp.device) // K] if gather_rows else inp.float()
    y = torch.einsum("pd,pod->po", rows, w.float()[topk_ids.reshape(-1).long()])
    if fuse_act:
        half = y.shape[1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    if pair_weights is not None:
        y = y * pair_weights.float()[:, None]
    return y.to(inp.dtype)


if HAS_TRITON:

    @triton.jit
    def _expert_gemm_kernel(
        inp_ptr, w_ptr, out_ptr, sorted_ptr, bexp_ptr, pw_ptr,
        N, D, P, HALF,
        s_im, s_id, s_we, s_wn, s_wd, s_om, s_on,
        ROW_DIV: tl.constexpr, FUSE_ACT: tl.constexpr, HAS_PW: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)  # n tiles of one block are neighbours: they share the block's input rows
        b = tl.program_id(1)
        e = tl.load(bexp_ptr + b)
        if e < 0:
            return
        pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < P
        pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
        rows = pairs // ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_nc = tl.where(mask_n, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = inp_ptr + rows[:, None] * s_im + offs_k[None, :] * s_id  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + e.to(tl.int64) * s_we + offs_nc[None, :] * s_wn + offs_k[:, None] * s_wd  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FUSE_ACT:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                wt = tl.load(w_ptrs)
            else:
                mask_k = k0 + offs_k < D
                a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
            acc += tl.dot(a, wt, input_precision=PRECISION)
            if FUSE_ACT:
                if EVEN_K:
                    wu = tl.load(w_ptrs + HALF * s_wn)
                else:
                    wu = tl.load(w_ptrs + HALF * s_wn, mask=mask_k[:, None], other=0.0)
                acc_up += tl.dot(a, wu, input_precision=PRECISION)
            a_ptrs += BLOCK_K * s_id
            w_ptrs += BLOCK_K * s_wd
        if FUSE_ACT:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if HAS_PW:
            acc = acc * tl.load(pw_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * s_om + offs_n[None, :] * s_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def expert_gemm(inp: torch.Tensor, w: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor], num_pairs: int,
                top_k: int, out: torch.Tensor, gather_rows: bool, pair_weights: torch.Tensor | None = None,
                fuse_act: bool = False, config: GemmConfig | None = None) -> torch.Tensor:
    """Grouped GEMM over expert-aligned pairs (semantics: expert_gemm_ref, written into `out`):
        for each block b of config.block_m entries of sorted_pair_ids with e = block_expert[b] >= 0:
            for each valid pair p in the block: row = inp[p // K] if gather_rows else inp[p]
                out[p] = (w[e] @ row) [silu(gate) * up if fuse_act] [* pair_weights[p]]
    inp: [T, D] (gather_rows: the token rows, no x[pair_tok] copy) or [P, D] (per pair)
    w: [E, O, D] (any strides) · align: moe_align(topk_ids, E, config.block_m) · num_pairs: P = T*K · top_k: K
    out: [P, O] (or [P, O/2] with fuse_act) · pair_weights: [P] or None · returns out
    """
    require_triton()
    cfg = config or pick_config(num_pairs, fuse_act)
    sorted_ids, block_expert = align
    D = inp.shape[1]
    O = w.shape[1]
    N = O // 2 if fuse_act else O
    assert w.shape[2] == D and out.shape == (num_pairs, N), (inp.shape, w.shape, out.shape)
    assert sorted_ids.shape[0] == block_expert.shape[0] * cfg.block_m, "align was made with another block_m"
    grid = (triton.cdiv(N, cfg.block_n), block_expert.shape[0])
    _expert_gemm_kernel[grid](
        inp, w, out, sorted_ids, block_expert, pair_weights if pair_weights is not None else out,
        N, D, num_pairs, N,
        inp.stride(0), inp.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ROW_DIV=top_k if gather_rows else 1, FUSE_ACT=fuse_act, HAS_PW=pair_weights is not None,
        EVEN_K=D % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=dot_precision(inp.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out

