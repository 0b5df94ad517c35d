"""Hands the frozen KernelConfig to a built model: every module with a `configure(cfg)` method picks its backends
from it (once, here; again only when a benchmark compares two configs, before graphs are recaptured)."""

from __future__ import annotations

from torch import nn

from moelora.kernels.config import KernelConfig


def configure_kernels(model: nn.Module, cfg: KernelConfig | None = None) -> KernelConfig:
    """Call `module.configure(cfg)` on every module of `model` that has one; returns the config (the defaults when
    None). The model keeps it as `model.kernel_config`."""
    cfg = cfg or KernelConfig()
    for module in model.modules():
        configure = getattr(module, "configure", None)
        if callable(configure):
            configure(cfg)
    model.kernel_config = cfg
    return cfg
