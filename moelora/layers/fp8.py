"""FP8 base weights for LoRALinear and RoutedExperts: storage, online quantization, and the forward paths.

An FP8 module keeps `weight` (or `gate_up_proj` / `down_proj`) as float8_e4m3fn and a sibling fp32
parameter `weight_scale_inv` (`gate_up_proj_scale_inv` / `down_proj_scale_inv`) with one scale per block
(kernels/quant/fp8.py), and `module.quant` = Fp8State (the module's forward calls its linear / experts). The LoRA
deltas always read the unquantized activations: the base GEMM reads an e4m3 copy of its input (fp8_act_triton, or
the reference's), and the LoRA kernels get `x`.

Backends: None = the Triton kernels (CUDA, compute capability >= 8.9; anything else raises at conversion);
"w8a8" = the torch reference of the kernels' semantics (activations quantized per token group; any device);
"dequant" = weight-only, weights dequantized to the activation dtype (tests: equals a model loaded with the
dequantized weights). The references are for tests; nothing picks them silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moelora.kernels.moe.experts import expert_matmul_loop
from moelora.kernels.quant.fp8 import (DEFAULT_BLOCK, FP8_DTYPE, dequantize_weight_block, fp8_block_matmul_ref,
                                       fp8_grouped_matmul_ref, quantize_weight_block)
from moelora.kernels.quant.fp8_experts_triton import fp8_expert_gemm, fp8_grouped_align, fp8_grouped_gemm
from moelora.kernels.quant.fp8_triton import check_fp8_device, fp8_linear
from moelora.layers.linear import LoRALinear

REFERENCES = (None, "w8a8", "dequant")


@dataclass(frozen=True)
class Fp8State:
    block: tuple[int, int] = DEFAULT_BLOCK  # (block_n, block_k) of weight_scale_inv
    act_dtype: torch.dtype = torch.bfloat16  # the activations' (and LoRA factors') dtype
    reference: str | None = None  # None | "w8a8" | "dequant" (see the module doc)
    kind = "fp8"  # (not a field) what LoRALinear's backends ask of a quantized base

    def linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_forward(module, x)

    def experts(self, module: nn.Module, x, topk_weights, topk_ids, args) -> torch.Tensor:
        """RoutedExperts.forward on FP8 weights: the module's kernels on FP8 expert stacks (the LoRA kernels read the
        unquantized x and activations)."""
        w_gu = Fp8ExpertWeight(module.gate_up_proj, module.gate_up_proj_scale_inv, self)
        w_d = Fp8ExpertWeight(module.down_proj, module.down_proj_scale_inv, self)
        return module.run(x, w_gu, w_d, topk_weights, topk_ids, args)


def check_backend(reference: str | None, device: torch.device | str) -> None:
    if reference not in REFERENCES:
        raise ValueError(f"fp8 reference {reference!r}: use one of {REFERENCES}")
    if reference is None:
        check_fp8_device(device)


# ---- storage -----------------------------------------------------------------------------------------------

def frozen_param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def weight_names(module: nn.Module) -> list[str]:
    return ["gate_up_proj", "down_proj"] if hasattr(module, "down_lora") else ["weight"]


def scale_name(weight_name: str) -> str:
    """weight -> weight_scale_inv; gate_up_proj -> gate_up_proj_scale_inv (checkpoint names use the same rule)."""
    return "weight_scale_inv" if weight_name == "weight" else f"{weight_name}_scale_inv"


@torch.no_grad()
def to_fp8(module: nn.Module, state: Fp8State, quantize: bool) -> None:
    """Turn a LoRALinear or RoutedExperts into FP8 storage. quantize=True: quantize the weights it holds
    (online quantization of a bf16 checkpoint or dummy weights); False: empty storage for an FP8 checkpoint."""
    if getattr(module, "quant", None) is not None:
        return
    for name in weight_names(module):
        w = getattr(module, name)
        if quantize:
            q, s = quantize_weight_block(w.data, state.block)
        else:
            *lead, n, k = w.shape
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            s = torch.ones(*lead, -(-n // state.block[0]), -(-k // state.block[1]), dtype=torch.float32,
                           device=w.device)
        delattr(module, name)
        module.register_parameter(name, frozen_param(q))
        module.register_parameter(scale_name(name), frozen_param(s))
    module.quant = state


def dequantized(module: nn.Module, name: str) -> torch.Tensor:
    """The weight an FP8 module stands for, in its activation dtype (tests, and the 'dequant' backend)."""
    st: Fp8State = module.quant
    return dequantize_weight_block(getattr(module, name), getattr(module, scale_name(name)), st.block, st.act_dtype)


# ---- forward paths -----------------------------------------------------------------------------------------

def fp8_linear_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The base output of an FP8 LoRALinear: x [T, in] -> [T, sum(out)] in x.dtype (bias added)."""
    st: Fp8State = module.quant
    if st.reference == "dequant":
        return F.linear(x, dequantized(module, "weight"), module.bias)
    if st.reference == "w8a8":
        return fp8_block_matmul_ref(x, module.weight, module.weight_scale_inv, st.block, module.bias)
    return fp8_linear(x, module.weight, module.weight_scale_inv, st.block, module.bias)


class Fp8ExpertWeight:
    """An FP8 expert stack [E, O, D] for fused_moe_pairs: its _ExpertGemm calls grouped_mm(inp, pair_exp, E,
    scratch), which quantizes an e4m3 copy of inp for the GEMM; the LoRA kernels of fused_moe_pairs keep inp."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, state: Fp8State) -> None:
        self.weight, self.scale_inv, self.state = weight, scale_inv, state

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def act_quant_group(self) -> int | None:
        """The group of the per-token activation quantization its Triton GEMMs read (None for the references):
        a producer kernel may quantize their input itself (fp8_act_triton.attach_act_quant)."""
        return self.state.block[1] if self.state.reference is None else None

    @property
    def fast_path(self) -> bool:
        """The Triton kernels (not a reference mode): usable on fused_moe_triton's fast path."""
        return self.state.reference is None

    lora_epilogue = True  # expert_gemm takes lora= (the routed-expert LoRA expand in its epilogue)

    def expert_gemm(self, inp: torch.Tensor, topk_ids: torch.Tensor, align, gather_rows: bool,
                    block_m: int, lora=None) -> torch.Tensor:
        """fused_moe_triton.TritonExperts' GEMM: inp [T, D] (gather_rows) or [P, D] -> [P, O] in inp.dtype.
        lora: an fp8_triton.Fp8LoRAEpilogue over the pairs (fp8_expert_gemm's), added before the one rounding."""
        return fp8_expert_gemm(inp, self.weight, self.scale_inv, self.state.block, topk_ids, align, gather_rows,
                               block_m, lora=lora)

    def grouped_mm(self, inp: torch.Tensor, pair_exp: torch.Tensor, num_experts: int, scratch: dict) -> torch.Tensor:
        """inp: [P, D] · pair_exp: [P] · returns [P, O] in inp.dtype; scratch keeps the alignment for the next GEMM."""
        st = self.state
        if st.reference == "dequant":
            w = dequantize_weight_block(self.weight, self.scale_inv, st.block, inp.dtype)
            return expert_matmul_loop(inp, w, pair_exp)
        if st.reference == "w8a8":
            return fp8_grouped_matmul_ref(inp, self.weight, self.scale_inv, pair_exp, st.block)
        if inp.shape[0] == 0:
            return inp.new_empty(0, self.weight.shape[1])
        if "align" not in scratch:  # rows grouped by expert: computed once for gate_up and down
            scratch["align"] = fp8_grouped_align(pair_exp, num_experts)
        return fp8_grouped_gemm(inp, self.weight, self.scale_inv, pair_exp, st.block, scratch["align"])


# ---- whole model -------------------------------------------------------------------------------------------

def fp8_modules(model: nn.Module, skip=lambda name: False) -> dict[str, nn.Module]:
    """The modules FP8 applies to: every LoRALinear and RoutedExperts, except those `skip(name)` names and MLA's
    kv_b_proj (its weight is read directly by the absorbed attention, so it stays in the activation dtype)."""
    return {name: m for name, m in model.named_modules() if (isinstance(m, LoRALinear) or hasattr(m, "down_lora"))
            and not (name.endswith("kv_b_proj") or skip(name))}


def quantize_model_fp8(model: nn.Module, block: tuple[int, int] = DEFAULT_BLOCK, reference: str | None = None,
                       skip=lambda name: False) -> None:
    """Online quantization: every FP8-capable module's weights -> e4m3 + weight_scale_inv, module by module
    (the bf16 copy of one module is freed before the next is quantized)."""
    check_backend(reference, model.device)
    state = Fp8State(tuple(block), model.dtype, reference)
    for m in fp8_modules(model, skip).values():
        to_fp8(m, state, quantize=True)


def fp8_act_group(module: nn.Module | None) -> int | None:
    """The activation scale group of an FP8 module on the Triton backend (its block_k), else None."""
    st = getattr(module, "quant", None)
    return st.block[1] if isinstance(st, Fp8State) and st.reference is None else None


def tag_act_quant_norms(model: nn.Module) -> int:
    """Let each decoder layer's RMSNorm quantize its output for the FP8 GEMMs that read it (kernels/norm/rmsnorm_triton.py,
    one launch fewer per GEMM): input_layernorm when the attention's fused qkv_proj is FP8 (Triton backend),
    post_attention_layernorm when the routed experts (or a dense MLP's gate_up_proj) are. Returns the number of
    norms tagged. Results do not change: the GEMMs would quantize the same tensor the same way."""
    tagged = 0
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        pairs = [(getattr(layer, "input_layernorm", None), fp8_act_group(getattr(attn, "qkv_proj", None))),
                 (getattr(layer, "post_attention_layernorm", None),
                  fp8_act_group(getattr(mlp, "experts", None)) or fp8_act_group(getattr(mlp, "gate_up_proj", None)))]
        for norm, group in pairs:
            if norm is not None and group is not None and hasattr(norm, "act_quant_group"):
                norm.act_quant_group = group
                tagged += 1
    return tagged
