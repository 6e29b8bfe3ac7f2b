"""DeepSeek-V4.1's entry in the model registry (engine/model/registry.py): its
config and model classes and how its parameter names group for accounting."""

from __future__ import annotations

import re

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.registry import ModelSpec, ParamRules

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
)
