"""RMSNorm module over the kernels' reference op."""

import torch
from torch import nn

from moelora.kernels.norm import rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)
