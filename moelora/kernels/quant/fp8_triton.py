"""The block-scaled FP8 GEMM (reference: fp8.py): one Triton kernel for the dense linear (fp8_linear, with an
optional multi-LoRA expand in its epilogue) and the routed experts' grouped GEMM over (token, k) pairs
(fp8_experts_triton.py). A program owns BLOCK_M rows (dense: consecutive rows; grouped: a block of pairs of one
expert) and BLOCK_N output columns, and walks K in steps of one scale group, reading an e4m3 input quantized
beforehand (fp8_act_triton.py). torch._scaled_mm is not used: torch 2.11 refuses 1x128 / 128x128 block scales on
sm90 (FIELD_NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.kernels._triton import HAS_TRITON, DeviceError, dot_precision, require_triton
from moelora.kernels.lora.groups import SlotGroups
from moelora.kernels.lora.shrink_expand import lora_expand_ref
from moelora.kernels.lora.tiles_triton import PREFETCH_MAX_GROUPS
from moelora.kernels.quant.fp8 import FP8_DTYPE, dequantize_act_group, fp8_block_matmul_ref
from moelora.kernels.quant.fp8_act_triton import fp8_prequantize
from moelora.kernels.quant.split_k_triton import counters_ready, split_k_buffers

MIN_CAPABILITY = (8, 9)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.lora.tiles_triton import lora_expand_tile, lora_prefetch_tile, lora_prefetched_expand
    from moelora.kernels.quant.split_k_triton import split_k_reduce

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, ids_ptr, bexp_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        sam, sak, sasm, sasg, sbe, sbn, sbk, sbse, sbsn, sbsk, scm, scn,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
        GROUP_K: tl.constexpr, SCALE_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_ROW_DIV: tl.constexpr = 1,
        SPLIT_K: tl.constexpr = 1,
        lh_ptr=None, lb_ptr=None, loff_ptr=None, lrank_ptr=None, lscale_ptr=None, lslot_ptr=None, lact_ptr=None,
        S=0, L=0, slh_s=0, slh_i=0, slh_m=0, slh_r=0, slb_s=0, slb_o=0, slb_r=0, slb_e=0,
        LORA_N: tl.constexpr = 0, LORA_SK: tl.constexpr = 1, LORA_BR: tl.constexpr = 16,
        LORA_PRECISION: tl.constexpr = "ieee", LORA_SPLIT: tl.constexpr = 0, PARTS: tl.constexpr = 1,
        LORA_GROUPS: tl.constexpr = 8, LORA_WAIT: tl.constexpr = False, LORA_EVEN_R: tl.constexpr = False,
        LORA_FLAGS: tl.constexpr = 2048,
    ):
        # a: the e4m3 input [M / A_ROW_DIV, K], its group scales as_ptr (fp8_act_triton.fp8_prequantize); output row
        # r (a pair, or a dense row) reads input row r // A_ROW_DIV (top_k: the routed experts' token rows in place)
        # SPLIT_K > 1 (dense decode: few output tiles, long K): split sk takes the K steps sk, sk + SPLIT_K, ... and
        # the PARTS partials are added by split_k_reduce, in order.
        # LORA_N > 0: the multi-LoRA expand added to the fp32 tile before its one rounding. On the grouped expert
        # GEMM (routed-expert LoRA at prefill) rows are pairs and B is the block's expert's (lb + e * slb_e). Forms:
        # LORA_SPLIT == 0: after the K steps (and the split-K sum), lora_expand_tile (large inputs);
        # LORA_SPLIT == 2: one more program per tile (sk == SPLIT_K, no K steps) computes the LoRA tile as the last
        #   split-K partial, so its chain of dependent loads runs beside the K steps; over the batch's slot groups,
        #   the first LORA_GROUPS unrolled (0: all S slots in a loop: no groups given);
        # LORA_SPLIT == 3 (grouped prefill): the expand's metadata loaded before the K steps (lora_prefetch_tile),
        #   one stacked dot over the slot groups after them (lora_prefetched_expand);
        # LORA_SPLIT == 4 (the dense default, where mode4_ok): mode 2's LoRA program first in the grid (sk == 0),
        #   storing its tile and raising the tile's flag; the last K split waits for the flag, lowers it and adds
        #   the tile (the K splits are sk = 1 .. SPLIT_K): mode 2's sums in the same order.
        # LORA_WAIT (launched with PDL right after the shrink): the K steps run beside the shrink and whatever adds
        # the LoRA tile first waits for it (gdc_wait) before reading h; every other input was written before.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        sk = tl.program_id(2)
        offs_m = tl.arange(0, BLOCK_M)
        if GROUPED:
            e = tl.load(bexp_ptr + pid_m)
            if e < 0:
                return
            rows = tl.load(ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = e.to(tl.int64)
        else:
            rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
            e = 0
        mask_m = rows < M
        a_rows = rows // A_ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        b_base = b_ptr + e * sbe + offs_n[:, None].to(tl.int64) * sbn
        bs_base = bs_ptr + e * sbse + (offs_n // SCALE_N) * sbsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA_SPLIT == 3:  # the expand's chain of metadata loads, before the K steps
            l_i0, l_slot, l_rank, l_scale, l_slot_g, l_rank_g = lora_prefetch_tile(
                rows, mask_m, pid_n * BLOCK_N, loff_ptr, lrank_ptr, lscale_ptr, lslot_ptr, lact_ptr, S, L, LORA_N,
                LORA_BR, LORA_GROUPS)
        ksk = sk  # this program's K split
        k_hi = K
        if LORA_SPLIT == 2:  # program sk == SPLIT_K computes the LoRA expand tile, no K steps
            k_hi = tl.where(sk < SPLIT_K, K, 0)
        if LORA_SPLIT == 4:  # program sk == 0 computes the LoRA expand tile, no K steps; K split ksk = sk - 1
            ksk = tl.maximum(sk - 1, 0)
            k_hi = tl.where(sk > 0, K, 0)
        for k0 in range(ksk * BLOCK_K, k_hi, BLOCK_K * SPLIT_K):
            kk = k0 + offs_k
            mask_k = kk < K
            a = tl.load(a_ptr + a_rows[:, None] * sam + kk[None, :] * sak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a_s = tl.load(as_ptr + a_rows * sasm + (k0 // GROUP_K) * sasg, mask=mask_m, other=0.0)
            b = tl.load(b_base + kk[None, :] * sbk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK]
            b_s = tl.load(bs_base + (k0 // GROUP_K) * sbsk, mask=mask_n, other=0.0)  # [BN]
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        tile = pid_m * tl.num_programs(1) + pid_n
        if LORA_SPLIT == 2 or LORA_SPLIT == 4:
            if sk == (SPLIT_K if LORA_SPLIT == 2 else 0):  # the LoRA program
                if LORA_WAIT:  # launched with PDL beside the shrink: h is complete (and visible) after this
                    tl.extra.cuda.gdc_wait()
                acc = lora_expand_tile(acc, rows, mask_m, offs_n, mask_n, lh_ptr, lb_ptr, loff_ptr, lrank_ptr,
                                       lscale_ptr, lslot_ptr, lact_ptr, S, L, slh_s, slh_i, slh_m, slh_r, slb_s,
                                       slb_o, slb_r, LORA_N, LORA_SK, LORA_BR, LORA_PRECISION, LORA_GROUPS,
                                       LORA_EVEN_R)
                if LORA_SPLIT == 4:  # its tile to ws[SPLIT_K], then the tile's flag raised (release)
                    tl.store(ws_ptr + SPLIT_K * M * N + rows[:, None] * N + offs_n[None, :], acc,
                             mask=mask_m[:, None] & mask_n[None, :])
                    tl.debug_barrier()  # every thread's part stored before the flag
                    tl.atomic_xchg(cnt_ptr + LORA_FLAGS + tile, 1, sem="release")
                    return
        if LORA_SPLIT == 4:
            if SPLIT_K > 1:  # the K splits' own sum first (their counter), then the LoRA tile
                acc, last = split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, ksk, tile,
                                           SPLIT_K)
                if not last:
                    return
            # wait for the tile's LoRA program (an earlier program of the grid: dispatched first), and lower its flag
            # for the next launch; then add its tile as split_k_reduce would as the last partial
            flag = tl.atomic_cas(cnt_ptr + LORA_FLAGS + tile, 1, 0, sem="acquire")
            while flag != 1:
                flag = tl.atomic_cas(cnt_ptr + LORA_FLAGS + tile, 1, 0, sem="acquire")
            acc += tl.load(ws_ptr + SPLIT_K * M * N + rows[:, None] * N + offs_n[None, :],
                           mask=mask_m[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
        elif PARTS > 1:
            acc, last = split_k_reduce(acc, ws_ptr, cnt_ptr, rows, offs_n, mask_m, mask_n, M, N, sk, tile, PARTS)
            if not last:
                return
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if LORA_N > 0:
            if LORA_SPLIT == 3:
                acc = lora_prefetched_expand(acc, rows, offs_n, mask_n, l_i0, l_slot, l_rank, l_scale, l_slot_g,
                                             l_rank_g, lh_ptr, lb_ptr + e * slb_e, slh_s, slh_i, slh_m, slh_r, slb_s, slb_o,
                                             slb_r, BLOCK_M, BLOCK_N, LORA_SK, LORA_BR, LORA_GROUPS, LORA_PRECISION,
                                             LORA_EVEN_R, LORA_WAIT)
            if LORA_SPLIT == 0:
                if LORA_WAIT:  # launched with PDL: the K steps ran beside the shrink; h is complete after this
                    tl.extra.cuda.gdc_wait()
                # dense: all S slots in the loop (the measured form); grouped (prefill): the batch's slot
                # groups unrolled when given, their B loads in flight together
                acc = lora_expand_tile(acc, rows, mask_m, offs_n, mask_n, lh_ptr, lb_ptr + e * slb_e, loff_ptr, lrank_ptr,
                                       lscale_ptr, lslot_ptr, lact_ptr, S, L, slh_s, slh_i, slh_m, slh_r, slb_s,
                                       slb_o, slb_r, LORA_N, LORA_SK, LORA_BR, LORA_PRECISION,
                                       LORA_GROUPS if GROUPED else 0, LORA_EVEN_R)
        c = c_ptr + rows[:, None] * scm + offs_n[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def check_fp8_device(device: torch.device | str) -> None:
    """Clear error instead of a silent fallback: FP8 kernels need CUDA with compute capability >= 8.9."""
    device = torch.device(device)
    if device.type != "cuda":
        raise DeviceError(f"FP8 needs a CUDA GPU of compute capability >= 8.9; found {device.type}: run on such a "
                          "GPU, or keep the base in bf16 (leave out --quantization fp8; bench: --dtype bfloat16)")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise DeviceError(f"FP8 needs a CUDA GPU of compute capability >= 8.9; found {torch.cuda.get_device_name(device)} "
                          f"with compute capability {cap[0]}.{cap[1]}: keep the base in bf16, or use --quantization "
                          "nvfp4 (weight-only, any CUDA GPU)")


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (Hopper and later)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters of _fp8_gemm_kernel (the K step is the scale group), for a launcher's `config=` (sweeps,
    tests; None: fp8_gemm_config's). block_m: rows per program of the dense GEMM (0: dense_block_m's; the
    grouped GEMM takes the alignment's). split_k: K splits of the dense GEMM (0: fp8_split_k's; 1: none; the
    grouped GEMM never splits). Only split_k changes the fp32 summation order (partials added in split order)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    split_k: int = 0


SPLIT_K_TARGET_PROGRAMS = 264  # dense split-K, 16-row blocks: this many programs (2 per SM of an H200's 132)
SPLIT_K_TARGET_PROGRAMS_WIDE = 132  # 32/64-row blocks (4x the MMA work per K step): one per SM
# the grouped expert GEMMs from this many pairs take PREFILL_EXPERT_CONFIG, 128 x 128 tiles at 8 warps and 4 stages
# (gate_up / down at 16,384 tokens 1.675 / 1.373 -> 1.423 / 1.118 ms); decode never reaches it
PREFILL_MIN_PAIRS = 2049
PREFILL_EXPERT_CONFIG = (128, 8, 4)
# the grouped expert GEMM's launch below PREFILL_MIN_PAIRS, (BLOCK_N, warps, stages): the H200 sweep's best at
# Qwen3-30B-A3B shapes (a second sweep found none faster at 64 or 256 tokens: docs/experiments.md)
EXPERT_DECODE_CONFIG = (64, 4, 4)
DENSE_DECODE_STAGES = 4  # the dense decode GEMM's pipeline stages (the same sweep; 8 and 12 lost end to end)


def fp8_gemm_config(grid_m: int, N: int, grouped: bool, rows: int = 0) -> Fp8GemmConfig:
    """Default launch parameters (scripts/sweep_fp8_gemm.py on the H200, Qwen3-30B-A3B shapes): grouped experts
    EXPERT_DECODE_CONFIG (N narrowed to the weight's width), PREFILL_EXPERT_CONFIG from PREFILL_MIN_PAIRS `rows`
    (pairs); dense 64-wide column tiles at DENSE_DECODE_STAGES stages while fewer than 256 programs of 128-wide
    tiles (decode: qkv at 64 tokens 11.7 -> 8.5 us), else 128-wide at 3 stages."""
    if grouped and N >= 128 and rows >= PREFILL_MIN_PAIRS:
        return Fp8GemmConfig(*PREFILL_EXPERT_CONFIG)
    if grouped:
        bn, nw, st = EXPERT_DECODE_CONFIG
        return Fp8GemmConfig(bn if N >= bn else max(16, triton.next_power_of_2(N)), nw, st)
    block_n = 128 if N >= 128 else max(16, triton.next_power_of_2(N))
    if block_n == 128 and grid_m * triton.cdiv(N, 128) < 256:  # decode: narrower tiles, more programs
        return Fp8GemmConfig(64, 4, DENSE_DECODE_STAGES)
    return Fp8GemmConfig(block_n)


def fp8_split_k(tiles: int, k_steps: int, block_m: int = 16) -> int:
    """K splits of a dense GEMM with `tiles` output tiles of block_m rows and `k_steps` steps of one scale group:
    a power of two <= 8 with >= 4 K steps per split: for 16-row blocks the smallest reaching 264 programs (2 per
    SM of an H200), for wider blocks (4x the MMA work per K step) the largest staying within 132 (the H200 sweep,
    qkv and o_proj at 1-256 tokens)."""
    splits = 1
    while splits < 8 and k_steps >= splits * 8:
        if block_m <= 16 and tiles * splits >= SPLIT_K_TARGET_PROGRAMS:
            break
        if block_m > 16 and tiles * splits * 2 > SPLIT_K_TARGET_PROGRAMS_WIDE:
            break
        splits *= 2
    return splits


def dense_block_m(rows: int) -> int:
    """Rows per program of the dense GEMM: the whole batch up to 64 rows (each weight tile read once; the sweep:
    qkv at 64 / 256 tokens 11.7 -> 8.5 / 27.4 -> 13.8 us against 16-row blocks), 64 beyond."""
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


# The dense GEMM's LoRA expand (kernel comment, LORA_SPLIT): the LoRA program (mode 4, else 2 where mode4_ok fails)
# up to LORA_SPLIT_MAX_ROWS rows, and above while the GEMM's programs plus one LoRA program per tile stay within
# LORA_SPLIT_MAX_PROGRAMS (o_proj at 256 rows, not qkv); else after the K steps (mode 0). Mode 4 over mode 2: +0.4% /
# +1.3% decode with 4 / 8 adapters; modes 0 and 3 lost at small inputs.
LORA_SPLIT_MAX_ROWS = 64
LORA_SPLIT_MAX_PROGRAMS = 264  # 2 per SM of an H200
LORA_GROUPS_UNROLLED = 8  # slot groups of the LoRA program unrolled in the kernel (the rest in a loop)
LORA_FLAGS = 2048  # mode 4: the LoRA programs' flags sit at this offset in the split-K counters (tiles <= it)


def mode4_ok(tiles: int, split_k: int) -> bool:
    """Whether a launch of `tiles` output tiles and split_k K splits may take mode 4: its programs (one LoRA program
    and split_k K programs a tile) within LORA_SPLIT_MAX_PROGRAMS, so that every program can be resident at once
    whatever order they start in (a K program waits for its tile's LoRA program), and its flags within the
    counters (tiles <= LORA_FLAGS)."""
    return tiles * (split_k + 1) <= LORA_SPLIT_MAX_PROGRAMS and tiles <= LORA_FLAGS


def dense_lora_split(rows: int, tiles: int, split_k: int) -> int:
    """The dense GEMM's LoRA form (LORA_SPLIT) for `rows` input rows, `tiles` output tiles and split_k K splits."""
    if rows <= LORA_SPLIT_MAX_ROWS or tiles * (split_k + 1) <= LORA_SPLIT_MAX_PROGRAMS:
        return 4 if mode4_ok(tiles, split_k) else 2
    return 0


@dataclass
class Fp8LoRAEpilogue:
    """A multi-LoRA expand for the FP8 GEMM to add in its epilogue (lora_expand's semantics, fp32, before the
    output's one rounding). h: the shrink's [split_k, n, T, R] fp32 (or [n, T, R]) · b_cat: [S, O, R] (or, for
    fp8_expert_gemm and fused_moe_triton.expert_gemm, the routed experts' [S, E|1, O, R], rows T being the pairs and
    token_slots the slot of each pair's token) · slice_offsets: [n+1] int32 · ranks: [n, S] int32 · scaling: [n, S]
    fp32 · token_slots: [T] int32 (-1: no adapter, row untouched) · active_slots: [L] int32, the slot of each of the
    batch's slot groups (SlotGroups.active_slots, -1 unused), or None (the LoRA program then walks all S slots)."""

    h: torch.Tensor
    b_cat: torch.Tensor
    slice_offsets: torch.Tensor
    ranks: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    active_slots: torch.Tensor | None = None
    pdl: bool = False  # the shrink that wrote h was launched right before with launch_dependents (pdl_supported)
    slice_bounds: tuple[int, ...] | None = None  # slice_offsets on the host (the prefetched form needs them)
    prefetch: bool = False  # fp8_expert_gemm: the prefetched form (metadata before the K steps) where prefetch_ok

    def prefetch_ok(self, block_n: int) -> bool:
        """Whether the prefetched form (LORA_SPLIT 3) can serve a launch of block_n-wide column tiles: slot groups
        given, at most PREFETCH_MAX_GROUPS of them, and every slice boundary on a tile boundary."""
        return (self.active_slots is not None and 0 < self.active_slots.shape[0] <= PREFETCH_MAX_GROUPS
                and self.slice_bounds is not None and all(o % block_n == 0 for o in self.slice_bounds[1:-1]))

    def kernel_args(self, prefetch: bool = False) -> dict:
        h = self.h if self.h.dim() == 4 else self.h.unsqueeze(0)
        sk, n, _, R = h.shape
        b = self.b_cat
        per_expert = {}
        if b.dim() == 4:  # routed experts [S, E|1, O, R]: the expert dim's stride (0 when shared by all experts)
            per_expert = {"slb_e": b.stride(1) if b.shape[1] > 1 else 0}
            b = b[:, 0]
        br = max(16, triton.next_power_of_2(R))
        groups = {"LORA_GROUPS": 0} if self.active_slots is None else {
            "lact_ptr": self.active_slots, "L": self.active_slots.shape[0],
            "LORA_GROUPS": (triton.next_power_of_2(self.active_slots.shape[0]) if prefetch else
                            min(LORA_GROUPS_UNROLLED, self.active_slots.shape[0]))}
        return dict(lh_ptr=h, lb_ptr=self.b_cat, loff_ptr=self.slice_offsets, lrank_ptr=self.ranks,
                    lscale_ptr=self.scaling, lslot_ptr=self.token_slots, S=b.shape[0], slh_s=h.stride(0),
                    slh_i=h.stride(1), slh_m=h.stride(2), slh_r=h.stride(3), slb_s=b.stride(0), slb_o=b.stride(1),
                    slb_r=b.stride(2), **per_expert, LORA_N=n, LORA_SK=sk, LORA_BR=br,
                    LORA_EVEN_R=R == br and b.shape[2] == R, LORA_PRECISION=dot_precision(b.dtype), **groups)


def launch_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    out: torch.Tensor, bias: torch.Tensor | None, block: tuple[int, int], ids: torch.Tensor | None,
                    bexp: torch.Tensor | None, block_m: int, grid_m: int, a_row_div: int = 1,
                    lora: Fp8LoRAEpilogue | None = None, pdl_ok: bool = False,
                    config: Fp8GemmConfig | None = None) -> None:
    """One _fp8_gemm_kernel launch writing out [M, N]: a [M / a_row_div, K] e4m3 with a_scale [., K / block_k];
    w [N, K] or [E, N, K] e4m3 with w_scale; ids / bexp: the grouped GEMM's alignment (None: dense); lora: the
    expand in the epilogue; pdl_ok: nothing was launched since the shrink that wrote lora.h (PDL allowed)."""
    M, K = out.shape[0], a.shape[1]
    N = w.shape[-2]
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"FP8 Triton GEMM: block_k must be a power of two >= 16, got weight_block_size {list(block)}")
    if a.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 Triton GEMM: the input must be float8_e4m3fn (fp8_prequantize), got {a.dtype}")
    cfg = config or fp8_gemm_config(grid_m, N, ids is not None, M)
    grid_n = triton.cdiv(N, cfg.block_n)
    tiles = grid_m * grid_n
    split_k = 1  # grouped: never split
    if ids is None:  # dense: split K when few output tiles (decode)
        split_k = cfg.split_k or fp8_split_k(tiles, triton.cdiv(K, bk), block_m)
    lora_split = 0
    if lora is not None and ids is not None:  # grouped experts: after the K steps, or the prefetched form
        lora_split = 3 if lora.prefetch and lora.prefetch_ok(cfg.block_n) else 0
    if lora is not None and ids is None:
        lora_split = dense_lora_split(M, tiles, split_k)
    lora_part = 1 if lora_split in (2, 4) else 0
    need = tiles + (LORA_FLAGS if lora_split == 4 else 0)  # counters (mode 4: its flags after LORA_FLAGS)
    counters_before = counters_ready(out.device, need)
    parts, ws, cnt = split_k_buffers(out, need, split_k + lora_part)
    if lora_part and parts == 1:  # no counters (first use inside a capture): the epilogue form, unsplit
        lora_split, split_k = 0, 1
    else:
        split_k = parts - lora_part
    # PDL only when nothing was launched between the shrink and this GEMM: no quantization launch for x (pdl_ok),
    # the split-K counters (if any) already there (counters_before: not zero-filled by this call)
    pdl = lora is not None and lora.pdl and pdl_ok and (parts == 1 or counters_before)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    s3 = w_scale if w_scale.dim() == 3 else w_scale.unsqueeze(0)
    _fp8_gemm_kernel[(grid_m, grid_n, parts)](
        a, a_scale, w3, s3, out, bias if bias is not None else out,
        ids if ids is not None else out, bexp if bexp is not None else out, ws, cnt,
        M, N, K, a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1), w3.stride(0), w3.stride(1),
        w3.stride(2), s3.stride(0), s3.stride(1), s3.stride(2), out.stride(0), out.stride(1),
        GROUPED=ids is not None, HAS_BIAS=bias is not None, GROUP_K=bk, SCALE_N=bn, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=bk, A_ROW_DIV=a_row_div, SPLIT_K=split_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **(lora.kernel_args(prefetch=lora_split == 3) if lora is not None else {}),
        **({"LORA_SPLIT": lora_split} if lora is not None else {}), **({"PARTS": parts} if parts > 1 else {}),
        **({"LORA_WAIT": True, "launch_pdl": True} if pdl else {}),
    )


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
               bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, lora: Fp8LoRAEpilogue | None = None,
               out: torch.Tensor | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Semantics (fp8_block_matmul_ref):
        xq, xs = quantize_act_group(x, block_k)    (or x, x_scale when x is already float8)
        y = deq(xq, xs) @ deq(w_fp8, w_scale_inv).T (+ bias)     # fp32 accumulation
        (+ lora: the expand of Fp8LoRAEpilogue added in fp32, rounded once with y: fp8_linear_lora_ref)
    x: [T, K] bf16/fp16/fp32 (quantized first: its producer's mark, else one quantize_act_group launch), or float8
    with x_scale [T, ceil(K/bk)] · w_fp8: [N, K] float8_e4m3fn · w_scale_inv: [ceil(N/bn), ceil(K/bk)] fp32
    bias: [N] or None · config: the launch forced (sweeps, tests; None: fp8_gemm_config's)
    returns [T, N] in out_dtype, default x.dtype (bf16 for a float8 x); out: written instead of a new tensor (made
    by the caller, e.g. on another stream than the one this runs on), [T, N] of that dtype
    """
    require_triton()
    T = x.shape[0]
    if out_dtype is None:
        out_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    if out is None:
        out = torch.empty(T, w_fp8.shape[0], dtype=out_dtype, device=x.device)
    elif tuple(out.shape) != (T, w_fp8.shape[0]) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"fp8_linear: out must be a contiguous [{T}, {w_fp8.shape[0]}] {out_dtype} tensor, found "
                         f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if T == 0:
        return out
    bm = config.block_m if config is not None and config.block_m else dense_block_m(T)
    mark = getattr(x, "fp8_act", None)
    xq, x_scale = fp8_prequantize(x, block[1], x_scale)
    no_launch = x.dtype == FP8_DTYPE or (mark is not None and xq is mark[0])
    launch_fp8_gemm(xq, x_scale, w_fp8, w_scale_inv, out, bias, block, None, None, bm, triton.cdiv(T, bm),
                    lora=lora, pdl_ok=no_launch, config=config)
    return out


def fp8_linear_ref(x, w_fp8, w_scale_inv, block=(128, 128), bias=None, x_scale=None, out_dtype=None) -> torch.Tensor:
    """fp8_linear's semantics in torch (the test oracle; with lora: fp8_linear_lora_ref)."""
    if x.dtype == FP8_DTYPE:
        x = dequantize_act_group(x, x_scale, block[1])
        out_dtype = out_dtype or torch.bfloat16
    y = fp8_block_matmul_ref(x, w_fp8, w_scale_inv, block, bias)
    return y.to(out_dtype or y.dtype)


def fp8_linear_lora_ref(x, w_fp8, w_scale_inv, block, bias, lora: Fp8LoRAEpilogue, groups: SlotGroups,
                        x_scale=None, out_dtype=None) -> torch.Tensor:
    """fp8_linear(..., lora=lora) in torch: the fp32 base output plus lora_expand_ref's delta, rounded once.
    groups: the SlotGroups of lora.token_slots (the reference walks slots on the host)."""
    y = fp8_linear_ref(x, w_fp8, w_scale_inv, block, bias, x_scale, out_dtype=torch.float32)
    h = lora.h if lora.h.dim() == 4 else lora.h.unsqueeze(0)
    h = h.sum(0).to(lora.b_cat.dtype).float()  # the kernel rounds h to the factors' dtype, as lora_expand does
    lora_expand_ref(h, lora.b_cat, lora.slice_offsets, lora.ranks, lora.scaling, groups, y)
    return y.to(out_dtype or (torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype))
