"""The FP8 grouped GEMM of the routed experts over (token, k) pairs (fp8_triton's kernel with GROUPED): on rows
grouped by expert (fp8_grouped_gemm, its own alignment) or on the fused-MoE fast path's alignment, token rows read
in place (fp8_expert_gemm, with an optional routed-expert LoRA expand in its epilogue). References beside each."""

from __future__ import annotations

import torch

from moelora.kernels._triton import require_triton
from moelora.kernels.moe_lora.chain import moe_lora_align
from moelora.kernels.moe_lora.chain_triton import moe_lora_align_fast
from moelora.kernels.quant.fp8 import (
    FP8_DTYPE, dequantize_act_group, fp8_grouped_matmul_ref, grouped_matmul_dequantized,
)
from moelora.kernels.quant.fp8_act_triton import fp8_prequantize
from moelora.kernels.quant.fp8_triton import Fp8GemmConfig, Fp8LoRAEpilogue, launch_fp8_gemm


def expert_block_m(rows: int) -> int:
    return 16 if rows <= 512 else 64


def fp8_grouped_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, pair_exp: torch.Tensor,
                     block: tuple[int, int] = (128, 128), align: tuple[torch.Tensor, torch.Tensor] | None = None,
                     x_scale: torch.Tensor | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Semantics (fp8_grouped_matmul_ref):
        for p in range(P): y[p] = fp8_linear(x[p], w_fp8[pair_exp[p]], w_scale_inv[pair_exp[p]])
    x: [P, K] bf16/fp16/fp32 (quantized first: fp8_prequantize), or float8 with x_scale [P, ceil(K/bk)]
    w_fp8: [E, N, K] float8_e4m3fn
    w_scale_inv: [E, ceil(N/bn), ceil(K/bk)] fp32 · pair_exp: [P] int (expert of each row)
    align: fp8_grouped_align(pair_exp, E) when the caller reuses it (gate_up and down share one)
    config: the launch forced (sweeps, tests; None: fp8_gemm_config's)
    returns [P, N] in x.dtype (bf16 for a float8 x), rows in x's order. No host synchronisation (CUDA-graph safe).
    """
    require_triton()
    P = x.shape[0]
    out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    out = torch.empty(P, w_fp8.shape[1], dtype=out_dtype, device=x.device)
    if P == 0:
        return out
    bm = expert_block_m(P)
    sorted_ids, bexp = align if align is not None else fp8_grouped_align(pair_exp, w_fp8.shape[0], bm)
    x, x_scale = fp8_prequantize(x, block[1], x_scale)
    launch_fp8_gemm(x, x_scale, w_fp8, w_scale_inv, out, None, block, sorted_ids, bexp, bm, bexp.shape[0],
                    config=config)
    return out


def fp8_grouped_gemm_ref(x, w_fp8, w_scale_inv, pair_exp, block=(128, 128), align=None, x_scale=None,
                         config=None) -> torch.Tensor:
    """fp8_grouped_gemm's semantics in torch (the test oracle)."""
    if x.dtype == FP8_DTYPE:
        xd = dequantize_act_group(x, x_scale, block[1])
        return grouped_matmul_dequantized(xd, w_fp8, w_scale_inv, pair_exp, block, torch.bfloat16)
    return fp8_grouped_matmul_ref(x, w_fp8, w_scale_inv, pair_exp, block)


def fp8_expert_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int],
                    topk_ids: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor], gather_rows: bool, block_m: int,
                    x_scale: torch.Tensor | None = None, lora: Fp8LoRAEpilogue | None = None,
                    config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """The FP8 grouped GEMM on the routed-expert fast path's alignment (fused_moe_triton.moe_align), reading
    token rows in place. Semantics (fp8_expert_gemm_ref), pairs p = t * K + k, e = topk_ids.flatten()[p]:
        row = x[p // K] if gather_rows else x[p]
        y[p] = fp8_linear(row, w_fp8[e], w_scale_inv[e])       (x quantized first, once: fp8_prequantize)
    x: [T, D] (gather_rows) or [P, D], bf16/fp16/fp32, or float8 with x_scale · w_fp8: [E, N, D] float8_e4m3fn
    w_scale_inv: [E, ceil(N/bn), ceil(D/bk)] fp32 · topk_ids: [T, K] · align: moe_align(topk_ids, E, block_m)
    block_m: the alignment's block (>= 16) · returns [P, N] in x.dtype (bf16 for a float8 x). CUDA-graph safe.
    lora: the routed experts' LoRA expand added in the epilogue before the one rounding (fp8_expert_gemm_lora_ref):
        y[p, o_i] += scaling[i, s] * (h[i, p, :r] rounded to B's dtype) @ B[s, e, o_i, :r].T,  s = token_slots[p]
    with h: [n, P, R] fp32 (the pairs' shrink, moe_lora_grouped_shrink) · b_cat: [S, E|1, N, R] · token_slots: [P]
    (pairs of slot -1 get no delta). config: the launch forced (sweeps, tests; None: fp8_gemm_config's).
    """
    require_triton()
    T, K = topk_ids.shape
    P = T * K
    sorted_ids, bexp = expert_align_blocks("fp8_expert_gemm", align, block_m)
    out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    out = torch.empty(P, w_fp8.shape[1], dtype=out_dtype, device=x.device)
    if P:
        x, x_scale = fp8_prequantize(x, block[1], x_scale)  # gather_rows: the T token rows, once
        launch_fp8_gemm(x, x_scale, w_fp8, w_scale_inv, out, None, block, sorted_ids, bexp, block_m, bexp.shape[0],
                        a_row_div=K if gather_rows else 1, lora=lora, config=config)
    return out


def fp8_expert_gemm_lora_ref(x, w_fp8, w_scale_inv, block, topk_ids, gather_rows, lora: Fp8LoRAEpilogue,
                             x_scale=None) -> torch.Tensor:
    """fp8_expert_gemm(..., lora=lora) in torch: the fp32 base output plus each pair's expand, rounded once."""
    T, K = topk_ids.shape
    rows = torch.arange(T * K, device=x.device) // K if gather_rows else torch.arange(T * K, device=x.device)
    xr = x[rows]
    if xr.dtype == FP8_DTYPE:
        xr = dequantize_act_group(xr, x_scale[rows], block[1])
    y = grouped_matmul_dequantized(xr, w_fp8, w_scale_inv, topk_ids.reshape(-1), block, torch.float32) \
        if x.dtype == FP8_DTYPE else fp8_grouped_matmul_ref(xr, w_fp8, w_scale_inv, topk_ids.reshape(-1), block).float()
    return expert_lora_expand_ref(y, topk_ids, lora).to(torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)


def expert_lora_expand_ref(y: torch.Tensor, topk_ids: torch.Tensor, lora: Fp8LoRAEpilogue) -> torch.Tensor:
    """The routed experts' LoRA expand of a grouped GEMM's epilogue (fp8_expert_gemm / expert_gemm with lora=),
    added in place to y [P, O] fp32: y[p, o_i] += scaling[i, s] * (h[i, p, :r] rounded to B's dtype) @
    B[s, e, o_i, :r].T for pairs p of slot s = token_slots[p] >= 0 on expert e = topk_ids.flatten()[p]. Returns y."""
    h = lora.h if lora.h.dim() == 3 else lora.h.sum(0)
    b = lora.b_cat
    off = lora.slice_offsets.tolist()
    for p, (e, s) in enumerate(zip(topk_ids.reshape(-1).tolist(), lora.token_slots.tolist())):
        if s < 0:
            continue
        be = b[s, e if b.shape[1] > 1 else 0]
        for i in range(len(off) - 1):
            r = int(lora.ranks[i, s])
            if r > 0:
                hr = h[i, p, :r].to(b.dtype).float()
                y[p, off[i]:off[i + 1]] += lora.scaling[i, s].float() * (be[off[i]:off[i + 1], :r].float() @ hr)
    return y


def expert_align_blocks(caller: str, align: tuple[torch.Tensor, torch.Tensor], block_m: int):
    """(sorted_ids, block_expert) of a moe_align result, checked to hold blocks of block_m (>= 16) rows."""
    sorted_ids, bexp = align
    if sorted_ids.shape[0] != bexp.shape[0] * block_m or block_m < 16:
        raise ValueError(f"{caller}: align holds {sorted_ids.shape[0]} ids in {bexp.shape[0]} blocks; "
                         f"expected blocks of block_m={block_m} (>= 16)")
    return sorted_ids, bexp


def fp8_expert_gemm_ref(x, w_fp8, w_scale_inv, block, topk_ids, align, gather_rows, block_m, x_scale=None,
                        lora=None, config=None):
    """fp8_expert_gemm's semantics in torch (align and block_m are ignored: rows are matched by topk_ids; with
    lora: fp8_expert_gemm_lora_ref)."""
    if lora is not None:
        return fp8_expert_gemm_lora_ref(x, w_fp8, w_scale_inv, block, topk_ids, gather_rows, lora, x_scale)
    T, K = topk_ids.shape
    rows = torch.arange(T * K, device=x.device) // K if gather_rows else torch.arange(T * K, device=x.device)
    xs = None if x_scale is None else x_scale[rows]
    return fp8_grouped_gemm_ref(x[rows], w_fp8, w_scale_inv, topk_ids.reshape(-1), block, x_scale=xs)


def fp8_grouped_align(pair_exp: torch.Tensor, num_experts: int, block_m: int | None = None):
    """Rows grouped by expert, each group padded to block_m (moe_lora_align with one slot): (sorted_ids [P_max]
    int32, padding = P; block_expert [P_max / block_m] int32, -1 past the end)."""
    P = pair_exp.numel()
    bm = block_m or expert_block_m(P)
    slots = torch.zeros(P, dtype=torch.int32, device=pair_exp.device)
    align = moe_lora_align_fast if pair_exp.is_cuda else moe_lora_align
    return align(pair_exp.view(P, 1), slots, num_experts, 1, bm)
