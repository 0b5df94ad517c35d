"""Linear layers whose output may carry per-slot LoRA deltas (fused slices: qkv, gate_up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelora.layers.lora_batch import LoRABatch
from moelora.kernels.config import KernelConfig
from moelora.layers.dense_lora import DenseLoRAArgs, pick_dense_lora
from moelora.layers.lora import LoRAWeights, lora_active, lora_runs


def attach_lora_delta(y: torch.Tensor, delta: torch.Tensor) -> None:
    """Marks y (a layer's base output) with its deferred LoRA delta (LoRALinear.forward_deferred) for the kernel
    that reads y next to add (take_lora_delta)."""
    y.lora_delta = delta


def take_lora_delta(y: torch.Tensor) -> torch.Tensor | None:
    """The delta attach_lora_delta put on y (removed from it), or None."""
    delta = getattr(y, "lora_delta", None)
    if delta is not None:
        del y.lora_delta
    return delta


class LoRALinear(nn.Module):
    """y = x W^T (+ bias) + for each slice i: scaling[i, s] * B_i[s] A_i[s] x, s = the token's slot.

    weight: [sum(out_features), in_features]; the slices sit in order along the output dim. The LoRA backends
    (layers/dense_lora.py) are picked from the kernel config when the LoRA buffers are made (enable_lora), when the
    model is configured (configure) and when the layer moves to another device; the class default config until then."""

    kernel_config = KernelConfig()

    def __init__(self, in_features: int, out_features: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = list(out_features)
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(sum(out_features), dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.lora: LoRAWeights | None = None
        self.quant = None  # a quantized base weight: layers/fp8.py Fp8State or layers/nvfp4.py Nvfp4State
        self.lora_backend = self.deferred_backend = None

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoRAWeights:
        dtype = self.quant.act_dtype if self.quant else self.weight.dtype
        self.lora = LoRAWeights(self.in_features, self.out_features, max_loras, max_lora_rank, dtype=dtype,
                                device=self.weight.device)
        self._pick_backends()
        return self.lora

    def configure(self, cfg: KernelConfig) -> None:
        """Pick the LoRA backends from cfg (layers/configure.configure_kernels)."""
        self.kernel_config = cfg
        self._pick_backends()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._pick_backends()  # the backends depend on the device (module.to(device) ends here)
        return self

    def _pick_backends(self) -> None:
        if self.lora is not None:
            self.lora_backend, self.deferred_backend = pick_dense_lora(
                self.kernel_config, self.quant, self.weight.device, self.lora.slice_offsets_host)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x W^T (+ bias) [T, sum(O)], from the bf16 or the quantized weight."""
        return F.linear(x, self.weight, self.bias) if self.quant is None else self.quant.linear(self, x)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if not lora_active(self.lora, lora):
            return self.base(x)
        return self.lora_backend.forward(self, DenseLoRAArgs(x, self.lora, lora))

    def forward_deferred(self, x: torch.Tensor, lora: LoRABatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): where a deferred backend (DenseLoRAConfig.defer) serves this call (decode sizes), y = base(x)
        [T, sum(O)] and delta [T, sum(O)] in x's dtype for the caller's next kernel to add, y + delta being
        forward(x, lora) up to that one rounding (dense_lora.DeferredLoRA). Else (forward(x, lora), None)."""
        if self.deferred_backend is None or not lora_runs(self.lora, lora):
            return self.forward(x, lora), None
        args = DenseLoRAArgs(x, self.lora, lora)
        if not self.deferred_backend.serves(args):
            return self.forward(x, lora), None
        lora_active(self.lora, lora)  # counted as forward counts it
        return self.deferred_backend.forward(self, args)
