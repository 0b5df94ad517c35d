"""Build a model from a folder (config.json + safetensors) or from a config with dummy weights."""

from __future__ import annotations

import torch

from moelora.config import ModelConfig
from moelora.models.registry import model_class
from moelora.models.weights import init_dummy_weights, load_weights

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    """'auto'/None: the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = cfg.torch_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of float32, bfloat16, float16, auto")
    return _DTYPES[dtype]


def build_model(
    cfg: ModelConfig,
    path: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_loras: int = 0,
    max_lora_rank: int = 0,
    load_format: str = "auto",
    seed: int = 0,
    show_progress: bool = False,
):
    """load_format: 'auto' (safetensors from `path`), 'dummy' (random weights) or 'none' (uninitialized,
    e.g. on the meta device to read shapes only)."""
    cls = model_class(cfg)
    model = cls(cfg, dtype=resolve_dtype(dtype, cfg), device=device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "none":
        pass
    elif load_format == "auto":
        if path is None:
            raise ValueError("a checkpoint path is needed unless load_format='dummy'")
        load_weights(model, path, show_progress=show_progress)
    else:
        raise ValueError(f"load_format {load_format!r}: use 'auto', 'dummy' or 'none'")
    if max_loras:
        model.enable_lora(max_loras, max_lora_rank)
    return model.eval()
