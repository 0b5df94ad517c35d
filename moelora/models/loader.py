"""Build a model from a folder (config.json + safetensors) or from a config with dummy weights."""

from __future__ import annotations

import logging

import torch

from moelora.config import ModelConfig
from moelora.kernels.fp8 import DEFAULT_BLOCK
from moelora.layers.fp8 import check_backend, quantize_model_fp8
from moelora.models.fp8_weights import Fp8CheckpointLoader, fp8_block_size
from moelora.models.registry import model_class
from moelora.models.weights import init_dummy_weights, load_weights

log = logging.getLogger(__name__)
QUANTIZATIONS = (None, "fp8")
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
    quantization: str | None = None,
    fp8_reference: str | None = None,
):
    """load_format: 'auto' (safetensors from `path`), 'dummy' (random weights) or 'none' (uninitialized,
    e.g. on the meta device to read shapes only).
    quantization: None (the checkpoint's own: an FP8 checkpoint stays FP8 on a GPU, and is dequantized to
    `dtype` on the CPU) or 'fp8' (FP8 storage; a bf16 checkpoint or dummy weights are quantized at load time).
    fp8_reference: tests only, see layers/fp8.py ('w8a8' | 'dequant'; None = the Triton kernels).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: use one of {QUANTIZATIONS}")
    cls = model_class(cfg)
    model = cls(cfg, dtype=resolve_dtype(dtype, cfg), device=device)
    block = fp8_block_size(cfg) if load_format != "none" else None
    want_fp8 = quantization == "fp8" or (block is not None and model.device.type == "cuda")
    if want_fp8:
        check_backend(fp8_reference, model.device)
    fp8_loaded = False
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "none":
        pass
    elif load_format == "auto":
        if path is None:
            raise ValueError("a checkpoint path is needed unless load_format='dummy'")
        fp8 = None
        if block is not None:
            if not want_fp8:
                log.warning("%s is an FP8 checkpoint; on %s its weights are dequantized to %s", path, model.device, model.dtype)
            fp8 = Fp8CheckpointLoader(model, path, block, fp8_reference, dequantize_all=not want_fp8)
            fp8_loaded = want_fp8
        load_weights(model, path, show_progress=show_progress, fp8=fp8)
    else:
        raise ValueError(f"load_format {load_format!r}: use 'auto', 'dummy' or 'none'")
    if want_fp8 and not fp8_loaded and load_format != "none":
        quantize_model_fp8(model, block or DEFAULT_BLOCK, fp8_reference)
    if max_loras:
        model.enable_lora(max_loras, max_lora_rank)
    return model.eval()
