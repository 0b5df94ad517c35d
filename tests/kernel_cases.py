"""Shared cases for kernel tests: adapter popularity patterns, token counts, per-slot ranks.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set before Triton is
imported) at small shapes in fp32/fp16; with CUDA they run compiled at real shapes in bf16."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"
POPULARITY = ["distinct", "uniform", "skewed", "identical", "with_base_rows"]
NUM_TOKENS = [1, 3, 7, 133]
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


def token_slots(pattern: str, T: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slots in [0, S) (or -1 for base rows) following an adapter popularity pattern."""
    if pattern == "distinct":
        s = torch.arange(T) % S
    elif pattern == "uniform":
        s = torch.randint(0, S, (T,), generator=gen)
    elif pattern == "skewed":  # zipf-like: slot k with weight 1/(k+1)^2
        w = 1.0 / (torch.arange(S, dtype=torch.float) + 1) ** 2
        s = torch.multinomial(w, T, replacement=True, generator=gen)
    elif pattern == "identical":
        s = torch.full((T,), S - 1)  # one adapter, and not slot 0
    elif pattern == "with_base_rows":
        s = torch.randint(-1, S, (T,), generator=gen)
    else:
        raise ValueError(pattern)
    return s.to(torch.int32)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (3e-2, 3e-2)}[dtype]


def expert_lora_args(T: int, E: int, dtype: torch.dtype, gen: torch.Generator, S: int = 3, R: int = 8,
                     hidden: int = 48, inter: int = 24, device: str = DEVICE):
    """Routed-expert LoRA of S slots over E experts (moe.ExpertLoRAArgs): gate_up with two slices of ranks
    (8, 4, 0) / (2, 8, 4) per slot, down with ranks (8, 4, 0); factors ~0.2 * N(0, 1), A zero past each rank;
    scalings in [0.5, 1.5); token slots of T tokens with base rows (-1)."""
    from moelora.kernels.moe.experts import ExpertLoRAArgs

    def fac(n, D, O):
        ranks = torch.tensor([[8, 4, 0], [2, 8, 4]][:n], dtype=torch.int32)
        a = torch.randn(n, S, E, R, D, generator=gen) * 0.2
        b = torch.randn(S, E, O, R, generator=gen) * 0.2
        for i in range(n):
            for s in range(S):
                a[i, s, :, ranks[i, s]:] = 0
        return a.to(device, dtype), b.to(device, dtype), ranks.to(device), (torch.rand(n, S, generator=gen) + 0.5).to(device)

    a_gu, b_gu, r_gu, s_gu = fac(2, hidden, 2 * inter)
    a_d, b_d, r_d, s_d = fac(1, inter, hidden)
    slots = token_slots("with_base_rows", T, S, gen).to(device)
    return ExpertLoRAArgs(slots, a_gu, b_gu, s_gu, r_gu, a_d, b_d, s_d, r_d)


def qwen3_fp8_experts_with_lora(T: int, S: int = 4, R: int = 16):
    """GPU tests: one Qwen3-30B-A3B MoE layer on an FP8 base (E 128, top-8, H 2048, I 768, 128x128 blocks) with S
    adapter slots of rank R, drawn from a CUDA generator seeded with T: (w_gate_up, w_down, x [T, H] bf16,
    topk_weights, topk_ids, ExpertLoRAArgs with tokens of slot -1 too)."""
    from moelora.kernels.quant.fp8 import quantize_weight_block
    from moelora.kernels.moe.experts import ExpertLoRAArgs, route_topk_ref
    from moelora.layers.fp8 import Fp8ExpertWeight, Fp8State

    g = torch.Generator(device="cuda").manual_seed(T)
    E, K, H, inter = 128, 8, 2048, 768
    st = Fp8State((128, 128), torch.bfloat16, None)
    w_gu = Fp8ExpertWeight(*quantize_weight_block(torch.randn(E, 2 * inter, H, device="cuda", generator=g) * H**-0.5,
                                                  (128, 128)), st)
    w_d = Fp8ExpertWeight(*quantize_weight_block(torch.randn(E, H, inter, device="cuda", generator=g) * inter**-0.5,
                                                 (128, 128)), st)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weights, ids = route_topk_ref(torch.randn(T, E, device="cuda", generator=g), K, True)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    lora = ExpertLoRAArgs(
        torch.randint(-1, S, (T,), device="cuda", generator=g, dtype=torch.int32),
        torch.randn(2, S, E, R, H, generator=g, device="cuda").to(**bf) * 0.02,
        torch.randn(S, E, 2 * inter, R, generator=g, device="cuda").to(**bf) * 0.02,
        torch.ones(2, S, device="cuda"), torch.full((2, S), R, dtype=torch.int32, device="cuda"),
        torch.randn(1, S, E, R, inter, generator=g, device="cuda").to(**bf) * 0.02,
        torch.randn(S, E, H, R, generator=g, device="cuda").to(**bf) * 0.02,
        torch.ones(1, S, device="cuda"), torch.full((1, S), R, dtype=torch.int32, device="cuda"),
        torch.tensor([0, inter, 2 * inter], dtype=torch.int32, device="cuda"),
        torch.tensor([0, H], dtype=torch.int32, device="cuda"))
    return w_gu, w_d, x, weights, ids, lora


def in_group_order(sorted_ids: torch.Tensor, block_expert: torch.Tensor, block_m: int) -> torch.Tensor:
    """moe_align's sorted_pair_ids with each expert's group sorted (the padding P last): moe_align places a group's
    pairs in any order (atomics on the GPU), moe_align_ref in increasing pair id."""
    ids, be = sorted_ids.cpu().clone(), block_expert.cpu().tolist()
    b = 0
    while b < len(be):
        end = b + 1
        while end < len(be) and be[end] == be[b]:
            end += 1
        if be[b] >= 0:
            ids[b * block_m: end * block_m] = ids[b * block_m: end * block_m].sort().values
        b = end
    return ids.to(sorted_ids.device)
