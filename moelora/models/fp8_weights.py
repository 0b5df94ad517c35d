"""FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 style): `quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`, float8_e4m3fn weights, and one `<weight>_scale_inv` fp32 tensor per
quantized weight with one scale per block.

Which modules load as FP8 is read from the checkpoint itself: a module whose checkpoint tensors are all
float8 gets FP8 storage (layers/fp8.py); anything the checkpoint leaves in bf16 (`modules_to_not_convert`,
the router, embeddings, norms, lm_head) stays as it is; a float8 tensor for a module that cannot be FP8
(MLA's kv_b_proj, or a device without FP8 when the caller asks for a dequantized model) is dequantized with
its scale on load.
"""

from __future__ import annotations

from torch import nn

from moelora.kernels.quant.fp8 import FP8_DTYPE, dequantize_weight_block
from moelora.layers.fp8 import Fp8State, fp8_modules, scale_name, to_fp8
from moelora.models.weights import WeightLoadError, read_tensor, resolve_name, tensor_files

SCALE_SUFFIX = "_scale_inv"


def stored_modules(model: nn.Module, files: dict[str, tuple[str, str]], dtype: str, skip: tuple[str, ...]) -> list:
    """The quantizable modules (fp8_modules) every weight of which the checkpoint holds in `dtype` (a safetensors
    dtype string: "F8_E4M3", "U8" for packed NVFP4) alone. files: tensor_files; names ending in `skip` (scales)
    are not weights."""
    params = dict(model.named_parameters())
    stored: dict[str, bool] = {}  # model parameter -> every checkpoint tensor filling it has `dtype`
    for n, (_, dt) in files.items():
        r = None if n.endswith(skip) else resolve_name(n, model.config, params)
        if r is not None and r[0] in params:
            stored[r[0]] = stored.get(r[0], True) and dt == dtype
    out = []
    for mname, m in fp8_modules(model).items():
        weights = [f"{mname}.{w}" for w in ("weight", "gate_up_proj", "down_proj") if f"{mname}.{w}" in params]
        if weights and all(stored.get(w, False) for w in weights):
            out.append(m)
    return out


def _owner(param_name: str) -> str:
    """model parameter name -> the name of the module that owns it."""
    return param_name.rsplit(".", 1)[0]


class Fp8CheckpointLoader:
    """Prepares a model for an FP8 checkpoint and maps its tensors (weights.load_weights calls resolve)."""

    def __init__(self, model: nn.Module, path: str, block: tuple[int, int], reference: str | None,
                 dequantize_all: bool) -> None:
        self.path, self.block = path, block
        self.cfg = model.config
        self.files = tensor_files(path)
        for n, (_, dt) in self.files.items():
            if dt == "F8_E4M3" and n + SCALE_SUFFIX not in self.files:
                raise WeightLoadError(f"{path}: tensor {n!r} is float8_e4m3fn but {n + SCALE_SUFFIX!r} is missing "
                                      "from the checkpoint")
        if not dequantize_all:
            state = Fp8State(block, model.dtype, reference)
            for m in stored_modules(model, self.files, "F8_E4M3", (SCALE_SUFFIX,)):
                to_fp8(m, state, quantize=False)
        self.params = dict(model.named_parameters())

    def resolve(self, name: str, tensor):
        """(checkpoint name, tensor) -> ((model parameter, index) or None, the tensor to copy)."""
        params = self.params
        if name.endswith(SCALE_SUFFIX):
            r = resolve_name(name[: -len(SCALE_SUFFIX)], self.cfg, params)
            if r is None or r[0] not in params or params[r[0]].dtype != FP8_DTYPE:
                return None, tensor  # its weight is dequantized on load (or ignored)
            target, index = r
            owner, wname = target.rsplit(".", 1)
            return (f"{owner}.{scale_name(wname)}", self._scale_index(name, index, params[target].shape)), tensor
        r = resolve_name(name, self.cfg, params)
        if tensor.dtype != FP8_DTYPE or r is None or r[0] not in params or params[r[0]].dtype == FP8_DTYPE:
            return r, tensor
        scale = read_tensor(self.files, name + SCALE_SUFFIX)
        try:
            return r, dequantize_weight_block(tensor, scale, self.block)
        except ValueError as e:
            raise WeightLoadError(f"{self.path}: tensor {name + SCALE_SUFFIX!r}: {e}") from None

    def _scale_index(self, name: str, index: tuple, wshape) -> tuple:
        """A weight region's index (rows sliced per fused slice) -> the same region of the scale grid."""
        bn = self.block[0]
        rows = wshape[-2]
        out = []
        for i in index:
            if isinstance(i, slice):
                if i.start % bn or (i.stop % bn and i.stop != rows):
                    raise WeightLoadError(
                        f"{self.path}: tensor {name!r} fills rows {i.start}:{i.stop} of a fused weight, not aligned "
                        f"to the FP8 block of {bn} rows; this fused layout cannot keep per-slice block scales")
                out.append(slice(i.start // bn, -(-i.stop // bn)))
            else:
                out.append(i)
        return tuple(out)
