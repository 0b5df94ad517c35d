"""NVFP4 base weights (ModelOpt layout, kernels/quant/nvfp4.py) for LoRALinear and RoutedExperts, weight-only.

An NVFP4 module keeps `weight` (or `gate_up_proj` / `down_proj`) as packed uint8 [..., N, K/2], `<name>_scale`
float8_e4m3fn [..., N, K/16], `<name>_scale_2` fp32 [..., N] (the global scale per row), and `module.quant` =
Nvfp4State. On a GPU the Triton kernels (kernels/quant/nvfp4_triton.py) decode the packed weights tile by tile inside
the dense and the grouped expert GEMMs (Hopper has no FP4 tensor cores); `reference=True` (tests) dequantizes whole
weights and runs the bf16 path instead, on any device. The LoRA deltas read the activations as they are
(nothing is quantized on the input side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moelora.kernels._triton import DeviceError
from moelora.kernels.quant.fp8_experts_triton import fp8_grouped_align
from moelora.kernels.quant.nvfp4 import GROUP, dequantize_nvfp4, quantize_nvfp4
from moelora.kernels.quant.nvfp4_triton import nvfp4_expert_gemm, nvfp4_grouped_gemm, nvfp4_linear
from moelora.layers.fp8 import frozen_param, weight_names, fp8_modules


@dataclass(frozen=True)
class Nvfp4State:
    act_dtype: torch.dtype = torch.bfloat16
    reference: bool = False  # tests: allow the CPU (the computation is the same torch code)
    kind = "nvfp4"  # (not a field) what LoRALinear's backends ask of a quantized base

    def linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.reference:
            return nvfp4_linear(x, module.weight, module.weight_scale, module.weight_scale_2, module.bias)
        return F.linear(x, dequantized(module, "weight", x.dtype), module.bias)

    def experts(self, module: nn.Module, x, topk_weights, topk_ids, args) -> torch.Tensor:
        """RoutedExperts.forward on NVFP4 weights: the module's kernels on NVFP4 expert stacks (reference: the
        dequantized stacks)."""
        if self.reference:
            w_gu, w_d = dequantized(module, "gate_up_proj", x.dtype), dequantized(module, "down_proj", x.dtype)
        else:
            w_gu, w_d = Nvfp4ExpertWeight(module, "gate_up_proj"), Nvfp4ExpertWeight(module, "down_proj")
        return module.run(x, w_gu, w_d, topk_weights, topk_ids, args)


class Nvfp4ExpertWeight:
    """An NVFP4 expert stack [E, O, D] for fused_moe_pairs: on the Triton fast path (fused_moe_triton.TritonExperts:
    one alignment, token rows read in place, the SiLU-and-mul and combine kernels) TritonExperts calls expert_gemm;
    otherwise moe._ExpertGemm calls grouped_mm."""

    fast_path = True  # the Triton kernels (reference mode dequantizes whole stacks instead: no such object)
    act_quant_group = None  # weight-only: the activations stay as they are

    def __init__(self, module: nn.Module, name: str) -> None:
        self.packed, self.scale = getattr(module, name), getattr(module, name + "_scale")
        self.scale_2 = getattr(module, name + "_scale_2")

    @property
    def shape(self) -> torch.Size:
        E, O, half = self.packed.shape
        return torch.Size((E, O, 2 * half))

    def expert_gemm(self, inp: torch.Tensor, topk_ids: torch.Tensor, align, gather_rows: bool,
                    block_m: int) -> torch.Tensor:
        """TritonExperts' GEMM: inp [T, D] (gather_rows) or [P, D] -> [P, O] in inp.dtype."""
        return nvfp4_expert_gemm(inp, self.packed, self.scale, self.scale_2, topk_ids, align, gather_rows, block_m)

    def grouped_mm(self, inp: torch.Tensor, pair_exp: torch.Tensor, num_experts: int, scratch: dict) -> torch.Tensor:
        if inp.shape[0] == 0:
            return inp.new_empty(0, self.packed.shape[1])
        if "align" not in scratch:  # rows grouped by expert: computed once for gate_up and down
            scratch["align"] = fp8_grouped_align(pair_exp, num_experts)
        return nvfp4_grouped_gemm(inp, self.packed, self.scale, self.scale_2, pair_exp, scratch["align"])


def check_nvfp4_backend(reference: bool, device: torch.device | str) -> None:
    if not reference and torch.device(device).type != "cuda":
        raise DeviceError(f"NVFP4 needs a CUDA GPU (weight-only, dequantized for the GEMM); found "
                          f"{torch.device(device).type}: run on a GPU, or keep the base in bf16 (leave out "
                          "--quantization nvfp4; bench: --dtype bfloat16)")


def dequantized(module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_nvfp4(getattr(module, name), getattr(module, name + "_scale"), getattr(module, name + "_scale_2"), dtype)


@torch.no_grad()
def to_nvfp4(module: nn.Module, state: Nvfp4State, quantize: bool) -> None:
    """A LoRALinear or RoutedExperts -> NVFP4 storage; quantize=True quantizes the weights it holds (one global
    scale per weight, as ModelOpt writes per checkpoint tensor), False leaves empty storage for a checkpoint."""
    if getattr(module, "quant", None) is not None:
        return
    for name in weight_names(module):
        w = getattr(module, name)
        *lead, n, k = w.shape
        if k % GROUP:
            raise ValueError(f"NVFP4: {name} of shape {list(w.shape)}: the input dim must be a multiple of {GROUP}")
        if quantize:
            packed, scale, scale_2 = quantize_nvfp4(w.data)
            scale_2 = scale_2.expand(*lead, n).contiguous()
        else:
            dev = w.device
            packed = torch.zeros(*lead, n, k // 2, dtype=torch.uint8, device=dev)
            scale = torch.zeros(*lead, n, k // GROUP, dtype=torch.float8_e4m3fn, device=dev)
            scale_2 = torch.zeros(*lead, n, dtype=torch.float32, device=dev)
        delattr(module, name)
        module.register_parameter(name, frozen_param(packed))
        module.register_parameter(name + "_scale", frozen_param(scale))
        module.register_parameter(name + "_scale_2", frozen_param(scale_2))
    module.quant = state


def quantize_model_nvfp4(model: nn.Module, reference: bool = False, skip=lambda name: False) -> None:
    """Online NVFP4 quantization of every LoRALinear / RoutedExperts (MLA's kv_b_proj excepted, see layers/fp8.py)."""
    check_nvfp4_backend(reference, model.device)
    state = Nvfp4State(model.dtype, reference)
    for m in fp8_modules(model, skip).values():
        to_nvfp4(m, state, quantize=True)
