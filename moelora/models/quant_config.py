"""A checkpoint's `quantization_config` (config.json) or ModelOpt's `hf_quant_config.json`, read into one record."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from moelora.models.weights import WeightLoadError


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "fp8" (block-scaled, weight_scale_inv) | "nvfp4" (ModelOpt: packed e2m1, weight_scale, weight_scale_2)
    block: tuple[int, int] | None = None  # fp8: (block_n, block_k)


def checkpoint_quant(cfg, path: str | None = None) -> CheckpointQuant | None:
    """None for an unquantized checkpoint; a clear error for a scheme moelora does not read."""
    q = getattr(cfg.hf_config, "quantization_config", None) if cfg.hf_config is not None else None
    if q is None and path and os.path.isfile(os.path.join(path, "hf_quant_config.json")):
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            q = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2):
            raise WeightLoadError(f"quantization_config: fp8 without weight_block_size [n, k] (per-tensor FP8) is not "
                                  f"supported; found weight_block_size={block!r}")
        return CheckpointQuant("fp8", (int(block[0]), int(block[1])))
    if method == "modelopt":
        algo = str(q.get("quant_algo", q.get("quantization", {}).get("quant_algo", ""))).upper()
        group = q.get("group_size", q.get("quantization", {}).get("group_size", 16))
        if algo != "NVFP4" or int(group) != 16:
            raise WeightLoadError(f"quantization_config: ModelOpt quant_algo {algo!r} with group_size {group} is not "
                                  "supported (moelora reads NVFP4 with group_size 16)")
        return CheckpointQuant("nvfp4")
    raise WeightLoadError(f"quantization_config quant_method {method!r} is not supported (moelora reads 'fp8' with "
                          "weight_block_size, and ModelOpt NVFP4)")
