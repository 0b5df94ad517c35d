"""NVFP4 checkpoints (ModelOpt): per quantized weight `X.weight` uint8 [N, K/2], `X.weight_scale` float8_e4m3fn
[N, K/16], `X.weight_scale_2` fp32 scalar, `X.input_scale` (ignored: weight-only). A module whose checkpoint
weights are all packed gets NVFP4 storage (layers/nvfp4.py); a packed weight whose module stays unquantized
(MLA's kv_b_proj, excluded modules, or a dequantized load on the CPU) is dequantized on load."""

from __future__ import annotations

from torch import nn

from moelora.kernels.quant.nvfp4 import dequantize_nvfp4
from moelora.layers.nvfp4 import Nvfp4State, to_nvfp4
from moelora.models.fp8_weights import stored_modules
from moelora.models.weights import WeightLoadError, read_tensor, resolve_name, tensor_files

_SCALES = ("_scale_2", "_scale")  # longest first: "weight_scale_2" must not match "_scale"


class Nvfp4CheckpointLoader:
    """Prepares a model for an NVFP4 checkpoint and maps its tensors (weights.load_weights calls resolve)."""

    def __init__(self, model: nn.Module, path: str, reference: bool, dequantize_all: bool) -> None:
        self.path, self.cfg = path, model.config
        self.files = tensor_files(path)
        packed = [n for n, (_, dt) in self.files.items() if dt == "U8" and n.endswith("weight")]
        for n in packed:
            for s in ("_scale", "_scale_2"):
                if n + s not in self.files:
                    raise WeightLoadError(f"{path}: tensor {n!r} is packed NVFP4 (uint8) but {n + s!r} is missing")
        if not dequantize_all:
            state = Nvfp4State(model.dtype, reference)
            for m in stored_modules(model, self.files, "U8", ("_scale", "_scale_2", "input_scale")):
                to_nvfp4(m, state, quantize=False)
        self.params = dict(model.named_parameters())

    def _is_nvfp4(self, target: str) -> bool:
        return target + "_scale_2" in self.params

    def resolve(self, name: str, tensor):
        """(checkpoint name, tensor) -> ((model parameter, index) or None, the tensor to copy)."""
        params = self.params
        if name.endswith("input_scale"):
            return None, tensor
        for suffix in _SCALES:
            if name.endswith("weight" + suffix):
                r = resolve_name(name[: -len(suffix)], self.cfg, params)
                if r is None or r[0] not in params or not self._is_nvfp4(r[0]):
                    return None, tensor  # its weight is dequantized on load (or ignored)
                target, index = r[0] + suffix, r[1]
                if suffix == "_scale_2":  # one scalar per checkpoint tensor -> one value per row of its region
                    region = params[target][index] if index else params[target]
                    if tensor.numel() != 1:
                        raise WeightLoadError(f"{self.path}: tensor {name!r}: expected a scalar global scale, "
                                              f"found shape {list(tensor.shape)}")
                    tensor = tensor.reshape(()).expand(region.shape)
                return (target, index), tensor
        r = resolve_name(name, self.cfg, params)
        if r is None or r[0] not in params or self._is_nvfp4(r[0]) or self.files.get(name, ("", ""))[1] != "U8":
            return r, tensor
        scale, scale_2 = (read_tensor(self.files, name + s) for s in ("_scale", "_scale_2"))
        try:
            return r, dequantize_nvfp4(tensor, scale, scale_2.reshape(()))
        except ValueError as e:
            raise WeightLoadError(f"{self.path}: tensor {name + '_scale'!r}: {e}") from None
