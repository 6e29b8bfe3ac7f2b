"""Linears that keep the checkpoint's block-FP8 bytes (``--quantization auto``).

``Fp8Linear`` holds ``weight`` (E4M3 ``[out, in]``) and ``scale`` (E8M0, one per
32 x 32 block) as buffers, so its ``state_dict`` names are the checkpoint's
(``X.weight``, ``X.scale``) and the loader copies the stored bytes in as they
are. Its forward is ``kernels.fp8_gemm.fp8_linear``: activations quantised to
E4M3 per block of 32, fp32 accumulation (docs/design/formats.md).
``Fp8GroupedLinear`` is the same for ``attn.wo_a`` (a block-diagonal projection).

The model's constructors build ``nn.Linear``s; ``pack_linears`` swaps the named
ones for these after construction (the loader calls it for every weight the
checkpoint stores as ``F8_E4M3``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.grouped_linear import GroupedLinear
from engine.model.precision import compute_dtype, upcast
from kernels.act_quant import quantize_act_e4m3
from kernels.dispatch import use_triton
from kernels.fp8_gemm import (
    BLOCK,
    PreparedScales,
    compute_dtype_of,
    fp8_linear,
    fp8_linear_cpu,
    prepare_scales,
)


class _Packed(nn.Module):
    """E4M3 ``weight [rows, cols]`` and E8M0 ``scale`` buffers that keep their dtypes.

    ``model.to(dtype)`` / ``model.double()`` convert every floating tensor, and
    float8 counts as floating: these bytes must move between devices only.
    """

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, rows: int, cols: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        )
        blocks = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        self.register_buffer(
            "scale", torch.empty(blocks, dtype=torch.float8_e8m0fnu, device=device)
        )
        self._nan_free: tuple[int, int, bool] | None = None
        self._raw: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, its int8 view)
        self._prepared: dict[tuple[int, int, torch.dtype], PreparedScales] = {}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        def same_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        self._raw = None  # a view of the bytes before the move
        return super()._apply(same_dtype, recurse)

    def raw_weight(self) -> torch.Tensor:
        """``weight``'s bytes as int8 (what the CPU path decodes), the view kept."""
        weight = self.weight
        if self._raw is None or self._raw[0] is not weight:
            self._raw = (weight, weight.view(torch.int8))
        return self._raw[1]

    @property
    def resident_bytes(self) -> int:
        """Bytes this module holds: its stored weight and scales."""
        return self.weight.nbytes + self.scale.nbytes

    def prepared(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> PreparedScales:
        """The CPU path's decoded scales of ``scale`` (default: all of them), kept until the
        bytes change."""
        scale = self.scale if scale is None else scale
        compute = compute_dtype_of(x)
        key = (scale.data_ptr(), self.scale._version, compute)
        if key not in self._prepared:
            if len(self._prepared) > 16:  # stale versions
                self._prepared.clear()
            self._prepared[key] = prepare_scales(scale, compute)
        return self._prepared[key]

    def nan_free(self) -> bool:
        """No weight byte is an E4M3 NaN; looked at once per change of the bytes."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._nan_free is None or self._nan_free[:2] != key:
            nan = (self.weight.view(torch.uint8) & 0x7F) == 0x7F
            self._nan_free = (*key, not bool(nan.any()))
        return self._nan_free[2]


class Fp8Linear(_Packed):
    """``y = x W^T`` over the packed ``weight``; output in ``x``'s dtype (no bias)."""

    def __init__(
        self, in_features: int, out_features: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__(out_features, in_features, device)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x W^T`` in ``out_dtype`` (default ``x.dtype``); fp32 accumulation either way."""
        return fp8_linear(
            x,
            self.raw_weight(),
            self.scale,
            nan_free=self.nan_free(),
            prepared=self.prepared(x),
            out_dtype=out_dtype,
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 32x32"


class Fp8GroupedLinear(_Packed):
    """``attn.wo_a`` packed: group g maps its input slice through rows ``g*O .. (g+1)*O``.

    Needs ``out_per_group`` to be a multiple of 32, so each group owns whole
    rows of the scale grid (``pack_linears`` leaves other shapes unpacked).
    """

    def __init__(
        self,
        in_per_group: int,
        out_per_group: int,
        n_groups: int,
        device: torch.device | str | None = None,
    ) -> None:
        if out_per_group % BLOCK:
            raise ValueError(f"out_per_group {out_per_group} is not a multiple of {BLOCK}")
        super().__init__(n_groups * out_per_group, in_per_group, device)
        self.n_groups = n_groups
        self.out_per_group = out_per_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n_groups, in_per_group] -> [..., n_groups, out_per_group], fp32."""
        o, blocks = self.out_per_group, self.out_per_group // BLOCK
        nan_free = self.nan_free()
        x32 = upcast(x)
        cpu = (
            not use_triton(x32, self.weight, self.scale, op="fp8_linear")
            or x32.dtype == torch.float64
        )
        if cpu:
            # Quantised once for every group (its blocks of 32 lie inside one group),
            # each group's rows made contiguous for its GEMM.
            groups = x32.reshape(-1, self.n_groups, x32.shape[-1])
            values, scales = quantize_act_e4m3(groups.transpose(0, 1).contiguous())
            values = values.view(self.n_groups, -1, values.shape[-1])
            scales = scales.view(self.n_groups, -1, scales.shape[-1])
        raw = self.raw_weight()
        outs = []
        for g in range(self.n_groups):
            scale = self.scale[g * blocks : (g + 1) * blocks]
            weight = raw[g * o : (g + 1) * o]
            prepared = self.prepared(x32, scale)
            if cpu:
                act = (values[g], scales[g])
                out = fp8_linear_cpu(
                    x32[..., g, :], weight, scale, nan_free=nan_free, prepared=prepared, act=act
                )
            else:
                out = fp8_linear(
                    x32[..., g, :], weight, scale, nan_free=nan_free, prepared=prepared
                )
            outs.append(out)
        return torch.stack(outs, dim=-2)


def linear32(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``x W^T`` in the compute dtype (fp32, float64 for float64 x), packed or not."""
    if isinstance(layer, Fp8Linear):
        # x as it is, so GEMMs that read the same tensor share its quantisation
        # (kernels.act_memo); the result is in the compute dtype all the same.
        return layer(x, compute_dtype(x))
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return F.linear(upcast(x), upcast(weight))


def packed_module(module: nn.Module) -> _Packed | None:
    """The packed twin of ``module`` (empty, on its device), or None when it has none."""
    if isinstance(module, _Packed):
        return None
    if isinstance(module, nn.Linear) and module.bias is None:
        return Fp8Linear(module.in_features, module.out_features, module.weight.device)
    if isinstance(module, GroupedLinear) and module.out_per_group % BLOCK == 0:
        in_per_group = module.weight.shape[1]
        return Fp8GroupedLinear(
            in_per_group, module.out_per_group, module.n_groups, module.weight.device
        )
    return None


def pack_linears(model: nn.Module, weight_names: Iterable[str]) -> list[str]:
    """Swap the module of each ``X.weight`` in ``weight_names`` for its packed twin.

    The old module's parameters are freed; the new buffers are uninitialised.
    Returns the weight names swapped (a name whose module has no packed twin,
    e.g. a Linear with a bias, is left as it is and not returned).
    """
    swapped = []
    for name in weight_names:
        path = name.removesuffix(".weight")
        module = model.get_submodule(path)
        packed = packed_module(module)
        if packed is None:
            continue
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, packed)
        swapped.append(name)
    return swapped


def packed_modules(model: nn.Module) -> dict[str, _Packed]:
    """Every packed linear of ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _Packed)}
