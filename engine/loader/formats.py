"""How a checkpoint stores each tensor: the storage formats, their shapes on disk,
the name rules that say which tensor is in which format, and dequantisation.

The storage format of every model tensor is fixed by its name (the decision
table in docs/design/checkpoints.md); a quantised weight has a ``.scale``
sibling of E8M0 exponents. Nothing here reads a file.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum

import torch

from kernels.weight_formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_mxfp4_weight,
)

SCALE_SUFFIX = ".scale"
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


class WeightFormat(StrEnum):
    """How one logical tensor is stored (docs/design/architecture.md §1.10)."""

    BF16 = "bf16"
    FP32 = "fp32"
    FP8_BLOCK = "fp8_block"  # F8_E4M3 + E8M0 `.scale` per [32, 32] block
    MXFP4 = "mxfp4"  # two E2M1 per I8 (even element low) + E8M0 `.scale` per 32 along K
    FP8_ROWS = "fp8_rows"  # F8_E4M3 + E8M0 `.scale` per 32 along each row (Engram tables)

    @property
    def quantised(self) -> bool:
        return self not in (WeightFormat.BF16, WeightFormat.FP32)


_L = r"layers\.\d+\."
# First full match wins. Sources: vLLM deepseek_v41 (quant_config=None marks BF16
# projections; FP32 parameters are declared float32) and DeepSeek's checkpoints.
_FORMAT_RULES: tuple[tuple[re.Pattern[str], WeightFormat], ...] = tuple(
    (re.compile(pattern), fmt)
    for pattern, fmt in (
        (_L + r"ffn\.experts\.\d+\.w[123]\.weight", WeightFormat.MXFP4),
        (_L + r"engram\.embed\.weight", WeightFormat.FP8_ROWS),
        (_L + r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight", WeightFormat.FP8_BLOCK),
        (_L + r"attn\.indexer\.wq_b\.weight", WeightFormat.FP8_BLOCK),
        (_L + r"ffn\.shared_experts\.w[123]\.weight", WeightFormat.FP8_BLOCK),
        (_L + r"engram\.wkv\.weight", WeightFormat.FP8_BLOCK),
        (r"(.+\.)?\w*norm\.weight", WeightFormat.FP32),
        (_L + r"hc_(attn|ffn)_(fn|base|scale)", WeightFormat.FP32),
        (_L + r"attn\.attn_sink", WeightFormat.FP32),
        (_L + r"ffn\.gate\.bias(_vl)?", WeightFormat.FP32),
        (_L + r"attn\.compressor\.(wkv|wgate)\.weight", WeightFormat.BF16),
        (_L + r"attn\.indexer\.(wk|weights_proj)\.weight", WeightFormat.BF16),
        (_L + r"ffn\.gate\.weight", WeightFormat.BF16),
        (_L + r"engram\.[\w.]+", WeightFormat.BF16),
        (r"(embed|head)\.weight", WeightFormat.BF16),
    )
)

# Tensors the text server does not serve: skipped with one notice per kind.
SKIPPED_KINDS: dict[str, tuple[str, ...]] = {
    "dspark": ("mtp.",),
    "vision": ("vision.", "visual.", "aligner.", "image_"),
}

# Model tensors an export may leave out, with the value they then take. The
# release stores ``ffn.gate.bias_vl`` (the router's selection bias for image
# tokens) for every MoE layer; a text server never routes an image token, so an
# export without it (older text-only checkpoints, the demo model) loads as zeros.
OPTIONAL_TENSORS: tuple[re.Pattern[str], ...] = (re.compile(r"layers\.\d+\.ffn\.gate\.bias_vl"),)


def optional_tensor(name: str) -> bool:
    return any(p.fullmatch(name) for p in OPTIONAL_TENSORS)


def scale_name(name: str) -> str:
    """The ``.scale`` sibling of a quantised weight: ``X.weight`` -> ``X.scale``."""
    return name.removesuffix(".weight") + SCALE_SUFFIX


def weight_format(name: str) -> WeightFormat | None:
    """The storage format of the model tensor ``name`` (None: not in the table)."""
    for pattern, fmt in _FORMAT_RULES:
        if pattern.fullmatch(name):
            return fmt
    return None


def skipped_kind(name: str) -> str | None:
    """``dspark`` / ``vision`` for tensors the text model does not load."""
    for kind, prefixes in SKIPPED_KINDS.items():
        if name.startswith(prefixes):
            return kind
    return None


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
