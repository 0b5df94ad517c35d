"""RMSNorm."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics (as transformers' RMSNorm: statistics in fp32, weight applied in the input dtype):
        y = weight * (x / sqrt(mean(x**2, -1) + eps))
    x: [..., D] · weight: [D] · returns [..., D] in x.dtype
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
