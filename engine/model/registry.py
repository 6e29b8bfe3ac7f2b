"""The model registry: a checkpoint config's ``model_type`` -> its ``ModelSpec``.

A variant is one folder under ``engine/model/`` with a ``spec.py`` defining
``SPEC`` plus one line in ``_KNOWN`` below. A spec carries its checkpoint's name
rules (``WeightRules``: which tensor is stored in which format, which it skips,
which it may lack) and the loader's hooks into its modules (``LoadHooks``), so
nothing in engine/loader/ or engine/planning/ names a model's tensors or classes.
Entries are imported on first use, so naming a model type costs nothing until a
config asks for it; tests may ``register`` a spec of their own.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.base import CausalLM, DrafterHost
from engine.model.deepseek_v41.config import ConfigError, ModelConfig
from engine.model.parallel import Parallel
from engine.model.weights import WeightRules

# model_type -> the module whose ``SPEC`` describes it.
_KNOWN: dict[str, str] = {
    "deepseek_v41": "engine.model.deepseek_v41.spec",
}
_LOADED: dict[str, ModelSpec] = {}


@dataclass(frozen=True, slots=True)
class ParamRules:
    """How a model's parameter names group in the parameter accounting
    (engine/planning/accounting.py, engine/planning/memory_plan.py)."""

    layer: re.Pattern[str]  # fullmatch: group 1 the layer index, group 2 its local name
    routed_expert: re.Pattern[str]  # match on a local name: one routed expert's tensor
    kv_write: re.Pattern[str]  # fullmatch on a local name: what the CED boundary runs
    embed_prefix: str  # the token embedding's tensors, outside the layers
    embed_head: tuple[str, ...]  # the embedding and output head matrices


@dataclass(frozen=True, slots=True)
class PackedSlice:
    """Where one stored quantised tensor goes byte for byte: views of a module's
    stacked buffers (e.g. one routed expert's projection)."""

    shape: tuple[int, int]  # the logical [out, in] its stored form encodes
    weight: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoadHooks:
    """What the loader (engine/loader/plan.py) asks of a model's modules beyond
    copying into its state dict."""

    # Stored weight name -> its slice, for every packed stacked module of the model.
    packed_slices: Callable[[nn.Module], dict[str, PackedSlice]]
    # Attach the FP8_ROWS table ``name`` to its module, mapped from ``files``
    # (stored name -> shard; with its ``.scale`` when stored quantised) and
    # gathered into ``dtype`` rows; reads headers only.
    map_table: Callable[[nn.Module, str, dict[str, Path], bool, torch.dtype], None]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the engine outside a model's folder needs to load and plan it."""

    model_type: str
    config_class: type[ModelConfig]
    model_class: type[CausalLM]
    params: ParamRules
    weights: WeightRules
    loading: LoadHooks
    # The speculative drafter with what it borrows of the target and none of its layers
    # (``load_drafter``: the engine core's under parallel serving); None: no drafter.
    # Built as ``drafter_class(config)``; holds the checkpoint's names.
    drafter_class: Callable[[ModelConfig, Parallel], DrafterHost] | None = None


def register(spec: ModelSpec) -> None:
    """Make ``spec`` the entry of its model type (a test's toy model, a plug-in)."""
    _LOADED[spec.model_type] = spec


def unregister(model_type: str) -> None:
    """Drop a ``register`` ed entry (a test's, when it ends)."""
    _LOADED.pop(model_type, None)


def known_model_types() -> list[str]:
    return sorted(_KNOWN.keys() | _LOADED.keys())


def model_spec(model_type: str) -> ModelSpec:
    """The entry of ``model_type``; a ``ConfigError`` naming the known ones otherwise."""
    if model_type not in _LOADED:
        if model_type not in _KNOWN:
            raise ConfigError(
                "model_type",
                f"unknown model type {model_type!r}; known: {', '.join(known_model_types())}",
            )
        spec = importlib.import_module(_KNOWN[model_type]).SPEC
        _LOADED[model_type] = spec
    return _LOADED[model_type]


def spec_of(config: ModelConfig) -> ModelSpec:
    """The entry whose config class ``config`` is (the planners hold a parsed config)."""
    for model_type in known_model_types():
        spec = model_spec(model_type)
        if type(config) is spec.config_class:
            return spec
    raise ConfigError("model_type", f"no registered model has config class {type(config)}")


def read_config(path: str | Path) -> tuple[ModelSpec, ModelConfig]:
    """Parse a ``config.json`` (or the one inside a checkpoint directory) with the
    config class its top-level ``model_type`` registers."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(
            "model_type", f"{path} names no model_type; known: {', '.join(known_model_types())}"
        )
    spec = model_spec(model_type)
    return spec, spec.config_class.from_dict(data)
