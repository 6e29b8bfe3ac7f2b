"""Parameter and KV byte accounting of a V4.1 config (``flashserve inspect``).

Parameter counts come from the shapes of the config's model (engine/model/registry.py)
built on the ``meta`` device (nothing is allocated), classified by tensor name with
the model's ``ParamRules`` (and its lookup tables by its ``WeightRules``). KV bytes
follow the record sizes of docs/design/architecture.md §1.10. What each "active" number
includes is defined in docs/design/checkpoints.md.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

import torch

from engine.loader.checkpoint import skip_init
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.registry import spec_of
from engine.model.weights import WeightFormat, WeightRules
from kernels import kv_formats


@dataclass(slots=True)
class LayerAccount:
    layer: int
    role: str
    compress_ratio: int
    kv_source: int | None
    index_source: int | None
    engram: bool
    stage: str  # "encoder" (< B), "boundary" (B) or "decoder" (> B)
    params: int  # every parameter of the layer, Engram tables included
    params_active: int  # what one decode token touches in this layer


@dataclass(slots=True)
class Accounting:
    params_total: int
    params_backbone: int
    params_engram: int
    params_active_prefill: int
    params_active_decode: int
    global_kv_bytes_per_token: int | float
    swa_kv_bytes_per_request: int
    persistent_kv_bytes_per_token: int | float
    ced_boundary: int
    layers: list[LayerAccount] = field(default_factory=list)
    # The vision tower, aligner and span vectors (0 without a vision_config); not in
    # params_total, which counts the text model, nor in the active counts: a text
    # token never runs them, an image runs them once at admission.
    params_vision: int = 0
    # The DSpark drafter (``mtp.*``; 0 without one), outside params_total like the
    # tower: it runs once per speculative step, beside the text model.
    params_dspark: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the text model, built on ``meta``.

    Building the official model takes seconds even on ``meta`` (46k modules),
    so shapes are cached per config.
    """
    return dict(_cached_shapes(json.dumps(config.to_dict(), sort_keys=True)))


@functools.lru_cache(maxsize=4)
def _cached_shapes(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with skip_init(), torch.device("meta"):
        config = ModelConfig.from_dict(json.loads(config_json))
        model = spec_of(config).model_class(config)
    # state_dict, not named_parameters: the checkpoint's names (routed experts
    # per expert, though the module stores them stacked).
    return tuple((name, tuple(p.shape)) for name, p in model.state_dict(keep_vars=True).items())


def is_engram_table(name: str, rules: WeightRules) -> bool:
    """Engram hash tables: the FP8-row tensors (lookups, ~196B rows x dims officially)."""
    return rules.format_of(name) is WeightFormat.FP8_ROWS


def _as_number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def global_kv_bytes_per_token(config: ModelConfig) -> int | float:
    """Main record plus index key of every kv source, one entry per ``ratio`` tokens."""
    ratios = [config.compress_ratio(s) for s in config.kv_source_layer_ids]
    return _as_number(kv_formats.global_kv_bytes_per_token(ratios))


def swa_kv_bytes_per_request(config: ModelConfig) -> int:
    """A full sliding window of MXFP8 records in every layer (bounded per request)."""
    return kv_formats.swa_bytes_per_request(config.sliding_window, config.num_hidden_layers)


def account(config: ModelConfig, shapes: dict[str, tuple[int, ...]] | None = None) -> Accounting:
    """Every number ``flashserve inspect`` prints for ``config``."""
    shapes = param_shapes(config) if shapes is None else shapes
    spec = spec_of(config)
    rules = spec.params
    n_layers, boundary = config.num_hidden_layers, config.ced_boundary
    total = [0] * n_layers
    routed = [0] * n_layers
    tables = [0] * n_layers
    kv_write = 0
    outside: dict[str, int] = {}  # embed, norm, head
    vision = dspark = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if spec.weights.is_vision(name):
            vision += numel
            continue
        if spec.weights.is_drafter(name):
            dspark += numel
            continue
        match = rules.layer.fullmatch(name)
        if match is None:
            outside[name] = numel
            continue
        layer, local = int(match.group(1)), match.group(2)
        total[layer] += numel
        if rules.routed_expert.match(local):
            routed[layer] += numel
        if is_engram_table(name, spec.weights):
            tables[layer] += numel
        elif layer == boundary and rules.kv_write.fullmatch(local):
            kv_write += numel

    layers = []
    for l in range(n_layers):
        # Experts of a layer are identical in shape: one token touches k of them.
        per_expert, rest = divmod(routed[l], config.n_routed_experts)
        assert rest == 0, f"layer {l}: routed experts differ in size"
        active = total[l] - routed[l] - tables[l] + config.num_experts_per_tok * per_expert
        layers.append(
            LayerAccount(
                layer=l,
                role=config.role(l).value,
                compress_ratio=config.compress_ratio(l),
                kv_source=config.kv_source(l),
                index_source=config.index_source(l),
                engram=l in config.engram_layer_ids,
                stage="encoder" if l < boundary else "boundary" if l == boundary else "decoder",
                params=total[l],
                params_active=active,
            )
        )
    embed = sum(n for name, n in outside.items() if name.startswith(rules.embed_prefix))
    params_total = sum(outside.values()) + sum(total)
    params_engram = sum(tables)
    global_kv = global_kv_bytes_per_token(config)
    return Accounting(
        params_total=params_total,
        params_backbone=params_total - params_engram,
        params_engram=params_engram,
        params_active_prefill=embed + sum(a.params_active for a in layers[:boundary]) + kv_write,
        params_active_decode=sum(outside.values()) + sum(a.params_active for a in layers),
        global_kv_bytes_per_token=global_kv,
        swa_kv_bytes_per_request=swa_kv_bytes_per_request(config),
        persistent_kv_bytes_per_token=global_kv,  # only global KV is persisted (2.3)
        ced_boundary=boundary,
        layers=layers,
        params_vision=vision,
        params_dspark=dspark,
    )
