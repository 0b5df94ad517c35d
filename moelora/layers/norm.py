"""RMSNorm module: the Triton kernel on a GPU, the reference op elsewhere."""

import torch
from torch import nn

from moelora.kernels._triton import HAS_TRITON
from moelora.kernels.moe.act_triton import moe_combine_ref, take_moe_combine
from moelora.kernels.norm.rmsnorm import rms_norm_ref
from moelora.kernels.norm.rmsnorm_triton import rms_norm


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        # set by tag_act_quant_norms when this norm feeds FP8 GEMMs: the kernel also quantizes its output per
        # token and group of this size and attaches it (the GEMMs skip their quantization launch)
        self.act_quant_group: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return rms_norm(x, self.weight, self.eps, quant_group=self.act_quant_group)[0]
        return rms_norm_ref(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm on a GPU. delta: the deferred LoRA
        delta of the layer that produced x (dense_lora.defer), added to x first (x + delta rounded to x's dtype, then
        the residual). x may be the placeholder of a deferred routed-expert combine (moe.combine_to_norm): the norm
        computes x as it loads it."""
        combine = take_moe_combine(x)
        if use_triton(x):
            return rms_norm(x, self.weight, self.eps, residual, quant_group=self.act_quant_group, delta=delta,
                            combine=combine)
        if combine is not None:  # deferred by the Triton experts on the CPU (tests): the reference
            o, w, d = combine
            x = moe_combine_ref(o if d is None else (o.float() + d.float()).to(o.dtype), w)
        if delta is not None:
            x = x + delta
        r = x + residual
        return rms_norm_ref(r, self.weight, self.eps), r
