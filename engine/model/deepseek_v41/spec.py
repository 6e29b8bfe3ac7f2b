"""DeepSeek-V4.1's entry in the model registry (engine/model/registry.py): its
config and model classes, how its parameter names group for accounting, its
checkpoint's name rules (engine/model/deepseek_v41/weight_names.py) and the
loader's hooks into its stacked routed experts and mapped Engram tables."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.dspark.host import DSparkHost
from engine.model.deepseek_v41.engram import Engram
from engine.model.deepseek_v41.engram_table import MappedEngramTable, tensor_span
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.routed_experts import SCALE, RoutedExperts
from engine.model.deepseek_v41.weight_names import WEIGHTS
from engine.model.registry import LoadHooks, ModelSpec, PackedSlice, ParamRules
from engine.model.weights import scale_name


def packed_expert_slices(model: nn.Module) -> dict[str, PackedSlice]:
    """Each packed routed expert's stored projection -> its rows of the stacked buffers
    (engine/model/deepseek_v41/routed_experts.py), under the checkpoint's per-expert name."""
    slices: dict[str, PackedSlice] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, RoutedExperts) or not module.packed:
            continue
        for name, (n_experts, rows, cols) in module.shapes().items():
            weight, scale = getattr(module, name), getattr(module, name + SCALE)
            for e in range(n_experts):
                key = f"{prefix}.{module.first + e}.{name}.weight"
                slices[key] = PackedSlice((rows, cols), weight[e], scale[e])
    return slices


def map_engram_table(
    model: nn.Module, name: str, files: dict[str, Path], quantised: bool, dtype: torch.dtype
) -> None:
    """Attach the memory-mapped table ``name`` to its Engram module; reads headers only."""
    module = model.get_submodule(name.removesuffix(".embed.weight"))
    assert isinstance(module, Engram), name
    weight = tensor_span(files[name], name)
    scale = None
    if quantised:
        scale = tensor_span(files[scale_name(name)], scale_name(name))
    module.use_mapped_table(MappedEngramTable(weight, scale, dtype=dtype))


SPEC = ModelSpec(
    model_type="deepseek_v41",
    config_class=ModelConfig,
    model_class=DeepseekV41,
    params=ParamRules(
        layer=re.compile(r"layers\.(\d+)\.(.+)"),
        routed_expert=re.compile(r"ffn\.experts\.\d+\."),
        # What layer B must run on every prompt token so its global KV and index keys
        # exist (docs/design/architecture.md §3.1): Engram (it updates R before the
        # attention input), attn_norm, the SWA KV projection, the compressor and the
        # index-key projection. The attention input collapses R with the previous
        # sublayer's `pre` (1.3), so B's own hc_attn coefficients are not needed
        # until its output is mixed.
        kv_write=re.compile(
            r"attn_norm\.weight|attn\.(wkv|kv_norm)\.weight|attn\.compressor\..+"
            r"|attn\.indexer\.(wk|k_norm)\..+|engram\..+"
        ),
        embed_prefix="embed.",
        embed_head=("embed.weight", "head.weight"),
    ),
    weights=WEIGHTS,
    loading=LoadHooks(packed_slices=packed_expert_slices, map_table=map_engram_table),
    drafter_class=DSparkHost,
)
