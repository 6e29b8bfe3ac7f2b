"""How a checkpoint stores a tensor: the shapes and bytes of each storage format
on disk, and dequantisation. Nothing here is a model's.

The formats themselves (``WeightFormat``) and the name rules that say which
tensor is in which (``WeightRules``) are in engine/model/weights.py, below the
registry that carries each model's rules (engine/model/registry.py; DeepSeek-V4.1's
are engine/model/deepseek_v41/weight_names.py). Nothing here reads a file.
"""

from __future__ import annotations

import math

import torch

from engine.model.weights import WeightFormat
from kernels.weight_formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_mxfp4_weight,
)

QUANT_BLOCK = 32  # every scale in the checkpoint covers 32 elements along K (and 32 rows for FP8)

# ``quantization``: "auto" keeps every FP8_BLOCK weight stored as F8_E4M3 packed
# (engine/model/deepseek_v41/fp8_linear.py) and the routed experts stored as MXFP4 packed
# (engine/model/deepseek_v41/routed_experts.py); "none" dequantises everything at load to ``dtype``.
QUANTIZATION_MODES = ("auto", "none")

# safetensors dtype strings stored as plain floats, and the bytes of an element
# (every dtype not named takes one byte: F8_E4M3, F8_E8M0, I8, U8).
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(
            f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATION_MODES)}"
        )


def stored_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a stored tensor of safetensors ``dtype`` and ``shape``."""
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 1)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor."""

    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(f"tensor `{tensor}`: {message}")
        self.tensor = tensor


def stored_shapes(
    fmt: WeightFormat, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(weight shape, scale shape or None) on disk for a logical tensor of ``shape``."""
    if not fmt.quantised:
        return shape, None
    rows, cols = shape
    if fmt is WeightFormat.FP8_BLOCK:
        return shape, (math.ceil(rows / QUANT_BLOCK), math.ceil(cols / QUANT_BLOCK))
    if fmt is WeightFormat.MXFP4:
        return (rows, cols // 2), (rows, cols // QUANT_BLOCK)
    return shape, (rows, cols // QUANT_BLOCK)  # FP8_ROWS


def dequantize(
    fmt: WeightFormat | None, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The logical tensor from its stored form (``fmt`` None: plain float), in ``dtype``."""
    if fmt not in (WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.FP8_ROWS):
        return weight.to(dtype)
    if scale is None:
        raise ValueError(f"a {fmt} weight needs its .scale")
    if fmt is WeightFormat.FP8_BLOCK:
        return dequantize_fp8_block(weight, scale, dtype)
    if fmt is WeightFormat.MXFP4:
        return dequantize_mxfp4_weight(weight, scale, dtype)
    return dequantize_fp8_rows(weight, scale, dtype)
