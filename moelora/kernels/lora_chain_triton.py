"""The deferred dense LoRA chain (shrink, then the delta kernel) as one launch (set_dense_defer_one_launch;
reference: lora_chain_ref below).

Why: beside the base GEMM the two-launch chain is the phase's critical path (session 29's trace, fp8 batch 64, 4
adapters: o_proj's shrink 5.8 µs + delta 5.3 against the GEMM's 10.1; qkv 6.0 + 4.7 against 9.9), and session 32
timed its parts beside the GEMM (scripts/bench_defer_chain.py --parts, qkv / o_proj, µs a call): GEMM alone 8.7 /
9.4, beside an empty fork / join 8.9 / 9.6, beside the shrink alone 9.7 / 9.9, beside the whole chain 11.2 / 11.3.
The stream edges cost little; the chain's length does. Here the programs of one launch do both steps:

- programs 0 .. n * split_k - 1 are the shrink, one (slice i, K split sk) each, every row and every slot group in
  one dot a K step: x [rows, BLOCK_K] @ the groups' A stacked [BLOCK_K, G x BR]; each row keeps its own group's
  BR columns and stores them as split sk's partial h [sk, i, t, :] (fp32); then the program counts itself in
  counters[0] (release);
- the programs after them are the delta, one (row block, column tile) each, as lora_delta's: the tile's slot
  metadata and the groups' B stacked are loaded first, then the program waits for counters[0] to reach
  n * split_k (acquire; the shrink's programs have lower ids, so they are dispatched first and never wait), then
  adds the partials in order and writes every entry of its tile; the last delta program to finish resets both
  counters to 0 for the next launch (stream order).

No kernel boundary between the steps and no second launch; B is read while the shrink runs. The sums are the
two-launch chain's up to fp32 order (the shrink's dot spans the stacked groups).

The shrink's programs come in two forms (set_lora_chain_shrink): "stacked", above (session 32), and "grouped"
(session 34, the default of this launch): lora_shrink's own programs, one (slot group, slice x K split, row block)
each over the group's rows (tokens sorted by slot), programs of an unused group or past the group's rows only
counting. Its partials are lora_shrink's bit for bit, so the chain is the two-launch chain without the kernel
boundary; the delta programs wait for all n_shrink programs.

Measured (session 32, H200, 64 tokens, 4 adapters): slower than the two launches, beside the GEMM (qkv / o_proj
12.1 / 13.1 µs against 11.1 / 11.4) and alone (~3.5 µs longer run serially), -1.11% end to end; off by default.
The stacked shrink has n x split_k programs (12 / 8) where lora_shrink has 96 / 64, and every delta program waits
for the slowest of them; the grouped form answers that (unmeasured when written).
"""

from __future__ import annotations

import os

import torch

from moelora.kernels._triton import HAS_TRITON, _env_choice, dot_precision, lora_even_r, require_triton
from moelora.kernels.groups import SlotGroups
from moelora.kernels.lora_delta_triton import DELTA_BLOCK_N, delta_ok, lora_delta_ref
from moelora.kernels.lora_triton import _block_m as _shrink_block_m

CHAIN_MAX_BLOCK_M = 64  # rows a delta program (and a shrink program's K step) takes at once

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moelora.kernels.fp8_triton import lora_prefetch_tile, lora_stacked_b, lora_stacked_expand

    @triton.jit
    def _lora_chain_kernel(x_ptr, a_ptr, h_ptr, b_ptr, d_ptr, cnt_ptr, off_ptr, ranks_ptr, scale_ptr, slots_ptr,
                           act_ptr, sorted_ptr, count_ptr, start_ptr, T, H, O, S, L, R, n_shrink,
                           sxm, sxk, sa_i, sa_s, sa_r, sa_k, sh_s, sh_i, sh_m, sh_r, sb_s, sb_o, sb_r, sdm, sdo,
                           N_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BR: tl.constexpr, G: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           X_PRECISION: tl.constexpr, B_PRECISION: tl.constexpr, EVEN_R: tl.constexpr,
                           GROUPED: tl.constexpr, BLOCK_MS: tl.constexpr, BLOCK_RS: tl.constexpr,
                           SPIN_SLEEP: tl.constexpr = False):
        pid = tl.program_id(0)
        offs_g = tl.arange(0, G)
        slot_g = tl.load(act_ptr + offs_g, mask=offs_g < L, other=-1)  # [G]
        offs_r = tl.arange(0, BR)
        if pid < n_shrink:
            if GROUPED:
                # lora_shrink's programs: one (slot group, slice x K split, row block x rank block) each, over the
                # group's rows (sorted_ptr); programs past the group's rows or rank, or of an unused group, only count
                n_rb = tl.cdiv(R, BLOCK_RS)
                n_mr = tl.cdiv(T, BLOCK_MS) * n_rb
                mr = pid % n_mr
                isk = (pid // n_mr) % (N_SLICES * SPLIT_K)
                group = pid // (n_mr * N_SLICES * SPLIT_K)
                slot = tl.load(act_ptr + group)
                count = tl.load(count_ptr + group)
                pid_m = mr // n_rb
                pid_r = mr % n_rb
                i = isk // SPLIT_K
                sk = isk % SPLIT_K
                rank = tl.load(ranks_ptr + i * S + tl.maximum(slot, 0))
                if (slot >= 0) & (pid_m * BLOCK_MS < count) & (pid_r * BLOCK_RS < rank):
                    offs_m = pid_m * BLOCK_MS + tl.arange(0, BLOCK_MS)
                    mask_m = offs_m < count
                    rows = tl.load(sorted_ptr + tl.load(start_ptr + group) + offs_m, mask=mask_m, other=0).to(tl.int64)
                    offs_rs = pid_r * BLOCK_RS + tl.arange(0, BLOCK_RS)
                    mask_r = offs_rs < rank
                    offs_k = tl.arange(0, BLOCK_K)
                    a_base = a_ptr + i * sa_i + slot.to(tl.int64) * sa_s
                    acc = tl.zeros((BLOCK_MS, BLOCK_RS), dtype=tl.float32)
                    for k0 in range(sk * BLOCK_K, H, BLOCK_K * SPLIT_K):
                        kk = k0 + offs_k
                        mask_k = kk < H
                        xt = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk,
                                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_MS, BLOCK_K]
                        at = tl.load(a_base + offs_rs[None, :] * sa_r + kk[:, None] * sa_k,
                                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_RS]
                        acc += tl.dot(xt, at, input_precision=X_PRECISION)
                    tl.store(h_ptr + sk * sh_s + i * sh_i + rows[:, None] * sh_m + offs_rs[None, :] * sh_r, acc,
                             mask=mask_m[:, None] & mask_r[None, :])
            else:  # the stacked form (session 32): one (slice, K split) each, every row and slot group
                i = pid // SPLIT_K
                sk = pid % SPLIT_K
                rank_g = tl.load(ranks_ptr + i * S + tl.maximum(slot_g, 0), mask=slot_g >= 0, other=0)
                live = offs_r[None, :] < rank_g[:, None]  # [G, BR]
                a_gr = (a_ptr + i * sa_i + tl.maximum(slot_g, 0)[:, None].to(tl.int64) * sa_s
                        + offs_r[None, :] * sa_r)  # [G, BR]
                offs_k = tl.arange(0, BLOCK_K)
                for m0 in range(0, T, BLOCK_M):
                    rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
                    mask_m = rows < T
                    acc = tl.zeros((BLOCK_M, G * BR), dtype=tl.float32)
                    for k0 in range(sk * BLOCK_K, H, BLOCK_K * SPLIT_K):
                        kk = k0 + offs_k
                        mask_k = kk < H
                        xt = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk,
                                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                        at = tl.load(a_gr[None, :, :] + kk[:, None, None] * sa_k,
                                     mask=live[None, :, :] & mask_k[:, None, None], other=0.0)  # [BLOCK_K, G, BR]
                        acc += tl.dot(xt, tl.reshape(at, (BLOCK_K, G * BR)), input_precision=X_PRECISION)
                    row_slot = tl.load(slots_ptr + rows, mask=mask_m, other=-1)
                    in_g = (row_slot[:, None] == slot_g[None, :]) & (row_slot >= 0)[:, None]  # [BLOCK_M, G]
                    acc3 = tl.reshape(acc, (BLOCK_M, G, BR))
                    h = tl.sum(tl.where(in_g[:, :, None], acc3, tl.zeros_like(acc3)), axis=1)  # [BLOCK_M, BR]
                    tl.store(h_ptr + sk * sh_s + i * sh_i + rows[:, None] * sh_m + offs_r[None, :] * sh_r, h,
                             mask=mask_m[:, None] & (offs_r < R)[None, :])
            tl.debug_barrier()  # every thread's part of h stored before the count
            tl.atomic_add(cnt_ptr, 1, sem="release")
        else:
            q = pid - n_shrink
            n_tn = tl.cdiv(O, BLOCK_N)
            pid_m = q // n_tn
            pid_n = q % n_tn
            rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask_m = rows < T
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < O
            i0, row_slot, rank_rows, scale_rows, slot_g, rank_g = lora_prefetch_tile(
                rows, mask_m, pid_n * BLOCK_N, off_ptr, ranks_ptr, scale_ptr, slots_ptr, act_ptr, S, L, N_SLICES,
                BR, G)
            b = lora_stacked_b(offs_n, mask_n, slot_g, rank_g, b_ptr, sb_s, sb_o, sb_r, BLOCK_N, BR, G, EVEN_R)
            # the shrink's programs (lower ids: dispatched before this one) all counted: h is complete
            done = tl.atomic_add(cnt_ptr, 0, sem="acquire")
            while done < n_shrink:
                if SPIN_SLEEP:  # back off ~100 ns a poll: fewer issue slots and L2 polls taken from the GEMM beside
                    done = tl.inline_asm_elementwise("nanosleep.u32 100; mov.b32 $0, $1;", "=r,r", [done],
                                                     dtype=tl.int32, is_pure=False, pack=1)
                done = tl.atomic_add(cnt_ptr, 0, sem="acquire")
            acc = lora_stacked_expand(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), b, rows, i0, row_slot,
                                      rank_rows, scale_rows, slot_g, h_ptr, sh_s, sh_i, sh_m, sh_r, BLOCK_M, SPLIT_K,
                                      BR, G, B_PRECISION, True)
            tl.store(d_ptr + rows[:, None] * sdm + offs_n[None, :] * sdo, acc.to(d_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])
            n_delta = tl.cdiv(T, BLOCK_M) * n_tn
            if tl.atomic_add(cnt_ptr + 1, 1) == n_delta - 1:  # the last delta program: every one is past its wait
                tl.store(cnt_ptr, 0)
                tl.store(cnt_ptr + 1, 0)


def _env_block_n() -> list[int]:
    raw = os.environ.get("MOELORA_LORA_CHAIN_BLOCK_N", "") or "0"
    if raw not in ("0", "64", "128", "256"):
        raise ValueError(f"MOELORA_LORA_CHAIN_BLOCK_N must be 0 (the default), 64, 128 or 256, got {raw!r}")
    return [int(raw)]


CHAIN_BLOCK_N = 128  # the delta programs' column tile where every slice boundary is a multiple of it
_BLOCK_N = _env_block_n()


def set_lora_chain_block_n(block_n: int = 0) -> None:
    """lora_chain's delta column tile (MOELORA_LORA_CHAIN_BLOCK_N; 0: CHAIN_BLOCK_N), taken where every slice
    boundary is a multiple of it, else DELTA_BLOCK_N. The same sums; CUDA graphs keep what they captured."""
    if block_n not in (0, 64, 128, 256):
        raise ValueError(f"set_lora_chain_block_n: 0, 64, 128 or 256, got {block_n}")
    _BLOCK_N[0] = int(block_n)


def lora_chain_block_n() -> int:
    """set_lora_chain_block_n's tile; 0 = the default."""
    return _BLOCK_N[0]


def chain_block_n(slice_bounds: tuple[int, ...]) -> int:
    want = _BLOCK_N[0] or CHAIN_BLOCK_N
    return want if all(o % want == 0 for o in slice_bounds[1:-1]) else DELTA_BLOCK_N


_SHRINK = _env_choice("MOELORA_LORA_CHAIN_SHRINK", "grouped", ("grouped", "stacked"))


def set_lora_chain_shrink(form: str = "grouped") -> None:
    """Which shrink the one-launch chain's first programs run (MOELORA_LORA_CHAIN_SHRINK): "grouped" (the default,
    session 34) lora_shrink's programs, one (slot group, slice x K split, row block) each over the group's rows
    (qkv at 64 tokens and 4 groups: 96, half of them counting only), so the shrink is as short as the two-launch
    chain's and only the kernel boundary goes; "stacked" session 32's n x split_k programs over every row and group
    (lost: ~3.5 µs longer run serially). The same sums up to fp32 order; CUDA graphs keep what they captured."""
    if form not in ("grouped", "stacked"):
        raise ValueError(f"set_lora_chain_shrink: 'grouped' or 'stacked', got {form!r}")
    _SHRINK[0] = form


_SPIN_SLEEP = [_env_choice("MOELORA_LORA_CHAIN_SPIN_SLEEP", "0", ("0", "1"))[0] == "1"]


def set_lora_chain_spin_sleep(enabled: bool) -> None:
    """The one-launch chain's delta programs back off ~100 ns (PTX nanosleep) between polls of the shrink's counter
    (MOELORA_LORA_CHAIN_SPIN_SLEEP=1; off by default, session 34, unmeasured when written): while the shrink runs,
    the waiting programs then take fewer issue slots and L2 polls from the base GEMM sharing their SMs. The same
    sums; GPU only (the interpreter polls without it); CUDA graphs keep what they captured."""
    _SPIN_SLEEP[0] = bool(enabled)


def lora_chain_spin_sleep() -> bool:
    return _SPIN_SLEEP[0]


def lora_chain_shrink() -> str:
    """set_lora_chain_shrink's form."""
    return _SHRINK[0]


def chain_counters(device: torch.device | str) -> torch.Tensor:
    """A fresh counter pair for lora_chain: int32 [2] zeros (one per layer, made before any graph capture)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def lora_chain(x: torch.Tensor, a: torch.Tensor, b_cat: torch.Tensor, slice_offsets: torch.Tensor,
               slice_bounds: tuple[int, ...], ranks: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor,
               active_slots: torch.Tensor, h: torch.Tensor, delta: torch.Tensor, counters: torch.Tensor,
               block_k: int = 128, num_warps: int = 8, groups: SlotGroups | None = None) -> None:
    """Semantics: lora_chain_ref — the LoRA delta of x, every entry of delta written, rounded once:
        delta[t, o_i] = scaling[i, s] * (round_B(x[t] @ a[i, s, :r].T) @ b_cat[s, o_i, :r].T)   s = token_slots[t] >= 0,
                                                                                             r = ranks[i, s] > 0
        delta[t, o_i] = 0 otherwise (rows of slot -1, slices of rank 0)
    as lora_shrink into h followed by lora_delta, in one launch (module docstring).
    x: [T, H] · a: [n, S, R, H] · b_cat: [S, O, R] · slice_offsets: [n+1] int32 (slice_bounds: the same on the host,
    each inner bound a multiple of DELTA_BLOCK_N) · ranks, scaling: [n, S] · token_slots: [T] int32 · active_slots:
    [L] int32 (every slot of token_slots among them, L <= DELTA_MAX_GROUPS) · h: [split_k, n, T, R] fp32, any
    contents (the workspace: split k sums the K tiles k, k + split_k, ... of width block_k) · delta: [T, O] (x's
    dtype), any contents · counters: int32 [2], zero (chain_counters), left zero · num_warps: per program.
    groups: the batch's slot groups (token_slots and active_slots must be theirs): the shrink takes lora_shrink's
    programs, one (slot group, slice x K split, row block) each over the group's rows (set_lora_chain_shrink
    "grouped"); None: one program per (slice, K split) over every row and group ("stacked", session 32's form).
    """
    require_triton()
    n, S, R, H = a.shape
    T = x.shape[0]
    sk = h.shape[0]
    Sb, O, Rb = b_cat.shape
    L = active_slots.shape[0]
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"lora_chain: x must be [T, {H}] (a is {tuple(a.shape)}), found {tuple(x.shape)}")
    if (Sb, Rb) != (S, R) or tuple(h.shape[1:]) != (n, T, R) or tuple(delta.shape) != (T, O):
        raise ValueError(f"lora_chain: expected b_cat [{S}, O, {R}], h [split_k, {n}, {T}, {R}] and delta [{T}, O]; "
                         f"found b_cat {tuple(b_cat.shape)}, h {tuple(h.shape)}, delta {tuple(delta.shape)}")
    if len(slice_bounds) != n + 1 or slice_bounds[-1] != O or not delta_ok(slice_bounds, L):
        raise ValueError(f"lora_chain: needs {n + 1} slice bounds ending at {O} on multiples of {DELTA_BLOCK_N} and "
                         f"at most 8 slot groups; found bounds {list(slice_bounds)} and {L} groups")
    if counters.dtype != torch.int32 or counters.numel() < 2:
        raise ValueError(f"lora_chain: counters must be int32 [2] zeros (chain_counters), found {counters.dtype} "
                         f"{tuple(counters.shape)}")
    if not T:
        return
    br = max(16, triton.next_power_of_2(R))
    bm = min(CHAIN_MAX_BLOCK_M, max(16, triton.next_power_of_2(T)))
    bn = chain_block_n(slice_bounds)
    bk = min(block_k, max(16, triton.next_power_of_2(H)))
    bms, brs = _shrink_block_m(T), max(16, min(64, triton.next_power_of_2(R)))
    if groups is None:
        n_shrink = n * sk
        sorted_ids, counts, starts = token_slots, token_slots, token_slots  # unread
    else:
        if groups.active_slots.shape[0] != L:
            raise ValueError(f"lora_chain: groups must be the batch's ({L} active slots), found "
                             f"{groups.active_slots.shape[0]}")
        n_shrink = L * n * sk * triton.cdiv(T, bms) * triton.cdiv(R, brs)
        sorted_ids, counts, starts = groups.sorted_token_ids, groups.slot_counts, groups.slot_starts
    grid = (n_shrink + triton.cdiv(T, bm) * triton.cdiv(O, bn),)
    _lora_chain_kernel[grid](
        x, a, h, b_cat, delta, counters, slice_offsets, ranks, scaling, token_slots, active_slots, sorted_ids, counts,
        starts, T, H, O, S, L, R, n_shrink,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        h.stride(0), h.stride(1), h.stride(2), h.stride(3), b_cat.stride(0), b_cat.stride(1), b_cat.stride(2),
        delta.stride(0), delta.stride(1),
        N_SLICES=n, SPLIT_K=sk, BR=br, G=triton.next_power_of_2(L), BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn,
        X_PRECISION=dot_precision(x.dtype), B_PRECISION=dot_precision(b_cat.dtype),
        EVEN_R=lora_even_r() and R == br, GROUPED=groups is not None, BLOCK_MS=bms, BLOCK_RS=brs,
        SPIN_SLEEP=_SPIN_SLEEP[0] and x.is_cuda, num_warps=num_warps,
    )


def lora_chain_ref(x: torch.Tensor, a: torch.Tensor, b_cat: torch.Tensor, slice_offsets: torch.Tensor,
                   ranks: torch.Tensor, scaling: torch.Tensor, groups, dtype: torch.dtype) -> torch.Tensor:
    """lora_chain's semantics in torch: lora_shrink_ref into one fp32 partial, then lora_delta_ref ([T, O] of
    dtype)."""
    from moelora.kernels.lora import lora_shrink_ref

    n, _, R, _ = a.shape
    h = torch.zeros(1, n, x.shape[0], R, dtype=torch.float32, device=x.device)
    lora_shrink_ref(x, a, ranks, groups, h[0])
    return lora_delta_ref(h, b_cat, slice_offsets, ranks, scaling, groups, dtype)
