"""Build a model from a folder (config.json + safetensors) or from a config with dummy weights."""

from __future__ import annotations

import logging

import torch

from moelora.config import ModelConfig
from moelora.kernels.config import KernelConfig
from moelora.kernels.quant.fp8 import DEFAULT_BLOCK
from moelora.layers.configure import configure_kernels
from moelora.layers.fp8 import check_backend, quantize_model_fp8, tag_act_quant_norms
from moelora.layers.nvfp4 import check_nvfp4_backend, quantize_model_nvfp4
from moelora.models.fp8_weights import Fp8CheckpointLoader
from moelora.models.nvfp4_weights import Nvfp4CheckpointLoader
from moelora.models.quant_config import checkpoint_quant
from moelora.models.registry import model_class
from moelora.models.weights import init_dummy_weights, load_weights

log = logging.getLogger(__name__)
QUANTIZATIONS = (None, "fp8", "nvfp4")
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


def build_model(cfg: ModelConfig, path: str | None = None, dtype: str | torch.dtype | None = "auto",
                device: str | torch.device = "cpu", max_loras: int = 0, max_lora_rank: int = 0,
                load_format: str = "auto", seed: int = 0, show_progress: bool = False, quantization: str | None = None,
                quant_reference: str | None = None, kernel_config: KernelConfig | None = None):
    """load_format: 'auto' (safetensors from `path`), 'dummy' (random weights) or 'none' (uninitialized,
    e.g. on the meta device to read shapes only).
    quantization: None (the checkpoint's own: an FP8 / NVFP4 checkpoint stays quantized on a GPU, and is
    dequantized to `dtype` on the CPU), 'fp8' or 'nvfp4' (that storage; a bf16 checkpoint or dummy weights
    are quantized at load time; the checkpoint's own scheme must match).
    quant_reference: tests only: FP8 'w8a8' | 'dequant' (layers/fp8.py; None = the Triton kernels); NVFP4: any
    value allows the CPU.
    kernel_config: the frozen kernel choices (kernels/config.py; None: the defaults), handed to every layer."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: use one of {QUANTIZATIONS}")
    cls = model_class(cfg)
    model = cls(cfg, dtype=resolve_dtype(dtype, cfg), device=device)
    ckpt = checkpoint_quant(cfg, path) if load_format == "auto" else None
    if ckpt is not None and quantization not in (None, ckpt.method):
        raise ValueError(f"{path} is an {ckpt.method} checkpoint; quantization={quantization!r} cannot re-quantize it")
    method = quantization or (ckpt.method if ckpt is not None and model.device.type == "cuda" else None)
    if method == "fp8":
        check_backend(quant_reference, model.device)
    elif method == "nvfp4":
        check_nvfp4_backend(quant_reference is not None, model.device)
    loaded = False
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "none":
        pass
    elif load_format == "auto":
        if path is None:
            raise ValueError("a checkpoint path is needed unless load_format='dummy'")
        mapper = None
        if ckpt is not None:
            if method is None:
                log.warning("%s is an %s checkpoint; on %s its weights are dequantized to %s", path, ckpt.method,
                            model.device, model.dtype)
            if ckpt.method == "fp8":
                mapper = Fp8CheckpointLoader(model, path, ckpt.block, quant_reference, dequantize_all=method is None)
            else:
                mapper = Nvfp4CheckpointLoader(model, path, quant_reference is not None, dequantize_all=method is None)
            loaded = method is not None
        load_weights(model, path, show_progress=show_progress, mapper=mapper)
    else:
        raise ValueError(f"load_format {load_format!r}: use 'auto', 'dummy' or 'none'")
    if method is not None and not loaded and load_format != "none":
        if method == "fp8":
            quantize_model_fp8(model, DEFAULT_BLOCK, quant_reference)
        else:
            quantize_model_nvfp4(model, quant_reference is not None)
    if method == "fp8":
        tag_act_quant_norms(model)  # norms quantize their outputs for the FP8 GEMMs reading them
    if max_loras:
        model.enable_lora(max_loras, max_lora_rank)
    configure_kernels(model, kernel_config)
    return model.eval()
