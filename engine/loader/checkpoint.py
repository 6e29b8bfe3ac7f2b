"""Load an official-layout DeepSeek-V4.1 checkpoint into ``DeepseekV41``.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``. Tensors carry DeepSeek's own
names (docs/design/architecture.md §1.10); quantised weights have a ``.scale`` sibling. The
storage format of every tensor is fixed by ``weight_format`` (the decision table
in docs/design/checkpoints.md). Tensors are streamed one at a time, a row slice
at a time, dequantised on the CPU and copied into the model on its device
(engine/loader/weight_stream.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.loader.tokenizer import load_tokenizer
from engine.loader.weight_stream import Convert, TensorRead, stream_into
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import Engram, build_compressed_vocab, tables_on_meta
from engine.model.deepseek_v41.engram_table import MappedEngramTable, tensor_span
from engine.model.deepseek_v41.fp8_linear import pack_linears
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.routed_experts import SCALE, RoutedExperts, packed_experts
from engine.model.parallel import SINGLE, Parallel, expert_of, tp_split_dim
from kernels.weight_formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_mxfp4_weight,
)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
SCALE_SUFFIX = ".scale"
# ``engram_mmap=None`` maps the Engram tables when their stored bytes exceed
# this: the release's (~197 GB) stay on disk, tiny and demo tables load as
# parameters (trainable, in ``state_dict``).
ENGRAM_MMAP_MIN_BYTES = 1 << 30
QUANT_BLOCK = 32  # every scale in the checkpoint covers 32 elements along K (and 32 rows for FP8)

# ``quantization``: "auto" keeps every FP8_BLOCK weight stored as F8_E4M3 packed
# (engine/model/deepseek_v41/fp8_linear.py) and the routed experts stored as MXFP4 packed
# (engine/model/deepseek_v41/routed_experts.py); "none" dequantises everything at load to ``dtype``.
QUANTIZATION_MODES = ("auto", "none")


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(
            f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATION_MODES)}"
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

_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}


def scale_name(name: str) -> str:
    """The ``.scale`` sibling of a quantised weight: ``X.weight`` -> ``X.scale``."""
    return name.removesuffix(".weight") + SCALE_SUFFIX


def weight_format(name: str) -> WeightFormat | None:
    """The storage format of the model tensor ``name`` (None: not in the table)."""
    for pattern, fmt in _FORMAT_RULES:
        if pattern.fullmatch(name):
            return fmt
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


def skipped_kind(name: str) -> str | None:
    """``dspark`` / ``vision`` for tensors the text model does not load."""
    for kind, prefixes in SKIPPED_KINDS.items():
        if name.startswith(prefixes):
            return kind
    return None


# ----------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor as the checkpoint stores it (header only, no data read)."""

    name: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8, ...
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 1)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index or the single file's header."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        with open(index, encoding="utf-8") as f:
            entries = json.load(f)["weight_map"]
        return {name: path / file for name, file in entries.items()}
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def iter_checkpoint_tensors(path: str | Path) -> Iterator[StoredTensor]:
    """Every stored tensor (weights and scales) in file order, from headers only."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_map(path).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                header = f.get_slice(name)
                yield StoredTensor(name, header.get_dtype(), tuple(header.get_shape()), file)


class _Shards:
    """Open shard handles, opened on first use and closed together."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._open: dict[Path, object] = {}
        self._stack = ExitStack()

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, name: str):  # safetensors has no public type for its handle
        file = self._files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(
                safe_open(file, framework="pt", device="cpu")
            )
        return self._open[file]

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        header = self._handle(name).get_slice(name)
        return header.get_dtype(), tuple(header.get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


# ----------------------------------------------------------------- planning


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    quantised: WeightFormat | None  # None: stored as a plain float tensor


def _check(name: str, found: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if found != expected:
        raise CheckpointError(name, f"has shape {list(found)}, expected {list(expected)} ({what})")


def _plan(
    targets: dict[str, torch.Tensor],
    files: dict[str, Path],
    shards: _Shards,
    also_skip: Callable[[str], str | None] | None = None,
) -> tuple[list[_Entry], dict[str, int]]:
    """Validate names, dtypes and shapes from headers before any data is read.

    ``also_skip``: the kind of a tensor this load leaves out on purpose, or None."""
    skipped: dict[str, int] = {}
    loadable = set()
    for name in files:
        kind = skipped_kind(name) or (also_skip(name) if also_skip else None)
        if kind is None:
            loadable.add(name)
        else:
            skipped[kind] = skipped.get(kind, 0) + 1
    scales = {scale_name(n) for n in targets if (f := weight_format(n)) and f.quantised}
    unexpected = sorted(loadable - targets.keys() - scales)
    if unexpected:
        raise CheckpointError(
            unexpected[0],
            f"unexpected in the checkpoint, no such model tensor ({len(unexpected)} in all)",
        )
    missing = [name for name in targets if name not in loadable and not optional_tensor(name)]
    if missing:
        raise CheckpointError(
            missing[0],
            f"missing from the checkpoint, expected shape {list(targets[missing[0]].shape)} "
            f"({len(missing)} missing in all)",
        )

    entries = []
    for name, target in targets.items():
        if name not in loadable:  # an optional tensor this export leaves out
            continue
        fmt = weight_format(name)
        shape = tuple(target.shape)
        dtype, found = shards.header(name)
        scale = scale_name(name)
        if dtype in _FLOAT_DTYPES:
            # Plain storage is always accepted (e.g. a BF16 re-export of an FP8 weight).
            if scale in loadable:
                raise CheckpointError(scale, f"unexpected: `{name}` is stored as {dtype}")
            _check(name, found, shape, f"stored as {dtype}")
            entries.append(_Entry(name, None))
            continue
        if fmt is None or not fmt.quantised:
            raise CheckpointError(name, f"stored as {dtype}, expected a float dtype")
        if scale not in loadable:
            raise CheckpointError(scale, f"missing: `{name}` is stored as {dtype}")
        want_weight, want_scale = stored_shapes(fmt, shape)
        _check(name, found, want_weight, f"{fmt.value} of logical shape {list(shape)}")
        _, scale_found = shards.header(scale)
        assert want_scale is not None
        _check(scale, scale_found, want_scale, f"E8M0 scales of {fmt.value}")
        entries.append(_Entry(name, fmt))
    return entries, skipped


# ----------------------------------------------------------------- loading


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


# Random initialisers a module constructor may call; see ``skip_init``.
_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)


@contextmanager
def skip_init() -> Iterator[None]:
    """Construct modules without running ``torch.nn.init`` on their parameters.

    Parameters about to be overwritten by a checkpoint (or never materialised,
    on ``meta``) need no random values; initialising them costs as much as
    loading (nn.Linear's kaiming init dominates building the official model).
    Patches ``torch.nn.init`` process-wide: not for use while other threads
    build modules.
    """
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def empty_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    engram_tables_on_meta: bool = False,
    quantization: str = "none",
    parallel: Parallel = SINGLE,
) -> DeepseekV41:
    """``DeepseekV41`` on ``device`` with uninitialised parameters in ``dtype``.

    Each parameter is allocated once and filled by the loader; buffers (RoPE
    frequencies) are computed by the constructor as usual. Parameters the model
    declares in an explicit dtype (mHC coefficients, sinks) keep it. Sets the
    process-wide default dtype while it builds. ``engram_tables_on_meta``: the
    Engram tables get no memory (the loader maps them from the checkpoint).
    ``quantization``: ``"auto"`` builds the routed experts packed (MXFP4 bytes,
    engine/model/deepseek_v41/routed_experts.py) and packs every linear the format table
    stores as FP8 blocks (``Fp8Linear``), as a release-format checkpoint loads;
    ``"none"``: everything unpacked in ``dtype``.
    ``parallel``: only this rank's TP and EP shares (engine/model/parallel.py);
    a TP-split linear is packed as this rank's shard (``check_tp_packed``).
    """
    check_quantization(quantization)
    model = _build(config, dtype, device, engram_tables_on_meta, quantization == "auto", parallel)
    if quantization == "auto":
        names = [n for n in model.state_dict() if weight_format(n) is WeightFormat.FP8_BLOCK]
        check_tp_packed(model, pack_linears(model, names), parallel)
    return model


def _build(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    engram_tables_on_meta: bool,
    experts_packed: bool,
    parallel: Parallel = SINGLE,
) -> DeepseekV41:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with ExitStack() as stack:
            stack.enter_context(skip_init())
            stack.enter_context(torch.device(device))
            if engram_tables_on_meta:
                stack.enter_context(tables_on_meta())
            if experts_packed:
                stack.enter_context(packed_experts())
            return DeepseekV41(config, parallel)
    finally:
        torch.set_default_dtype(previous)


def _engram_table_names(files: dict[str, Path]) -> list[str]:
    return [n for n in files if weight_format(n) is WeightFormat.FP8_ROWS]


def _wants_engram_mmap(files: dict[str, Path], shards: _Shards) -> bool:
    """The default of ``engram_mmap``: the stored tables exceed ``ENGRAM_MMAP_MIN_BYTES``."""
    stored = 0
    for name in _engram_table_names(files):
        for part in (name, scale_name(name)):
            if part in files:
                dtype, shape = shards.header(part)
                stored += math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)
    return stored > ENGRAM_MMAP_MIN_BYTES


def _map_engram_table(
    model: DeepseekV41, entry: _Entry, files: dict[str, Path], dtype: torch.dtype
) -> None:
    """Attach the memory-mapped table ``entry`` to its Engram module; reads headers only."""
    module = model.get_submodule(entry.name.removesuffix(".embed.weight"))
    assert isinstance(module, Engram), entry.name
    weight = tensor_span(files[entry.name], entry.name)
    scale = None
    if entry.quantised is not None:
        scale = tensor_span(files[scale_name(entry.name)], scale_name(entry.name))
    module.use_mapped_table(MappedEngramTable(weight, scale, dtype=dtype))


def set_engram_vocab(model: DeepseekV41, config: ModelConfig, tokenizer_file: Path) -> None:
    """Give the model the token -> Engram class map of the checkpoint's own tokenizer.

    The hash multipliers derive from ``engram_compressed_vocab_size``, so a
    tokenizer that folds to another class count would silently rehash every
    n-gram: that is an error.
    """
    class_of, n_classes = build_compressed_vocab(load_tokenizer(tokenizer_file))
    if n_classes != config.engram_compressed_vocab_size:
        raise ValueError(
            f"{tokenizer_file}: folds to {n_classes} Engram classes, but config "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}"
        )
    model.set_compressed_vocab(class_of)


def _tensor_read(entry: _Entry, target: torch.Tensor, shards: _Shards) -> TensorRead:
    """How ``stream_into`` fills ``target``: dequantised in fp32, one row slice at a time."""
    fmt = entry.quantised
    scale = scale_name(entry.name) if fmt else None
    nbytes = 0
    for stored in (entry.name, scale):
        if stored is not None:
            dtype, shape = shards.header(stored)
            nbytes += math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)

    def convert(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return dequantize(fmt, weight, scales, torch.float32)

    rows = QUANT_BLOCK if fmt is WeightFormat.FP8_BLOCK else 1
    return TensorRead(entry.name, target, convert, nbytes, scale, rows)


# ----------------------------------------------------------------- routed experts


def experts_stored_packed(files: dict[str, Path], shards: _Shards) -> bool:
    """True when the checkpoint has routed experts and stores every one as MXFP4 bytes."""
    names = [n for n in files if weight_format(n) is WeightFormat.MXFP4 and not skipped_kind(n)]
    return bool(names) and all(shards.header(n)[0] not in _FLOAT_DTYPES for n in names)


@dataclass(frozen=True, slots=True)
class _PackedExpert:
    """Where one packed expert projection's stored bytes go: slices of the stacked buffers."""

    weight: torch.Tensor  # int8 [out, in / 2], a view of the module's stacked buffer
    scale: torch.Tensor  # uint8 [out, in / 32]


def packed_expert_targets(
    model: nn.Module, targets: dict[str, torch.Tensor]
) -> dict[str, _PackedExpert]:
    """Take the packed experts' entries out of ``targets`` (state-dict views).

    Each weight is replaced by a ``meta`` placeholder of its logical shape, so
    ``_plan`` checks the stored shapes exactly as for a dequantised load; its
    scale entry leaves ``targets`` (``_plan`` expects it as the weight's sibling).
    """
    packed: dict[str, _PackedExpert] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, RoutedExperts) or not module.packed:
            continue
        for name, (n_experts, rows, cols) in module.shapes().items():
            for e in range(n_experts):
                key = f"{prefix}.{module.first + e}.{name}.weight"
                if key not in targets:  # a layer this load leaves out
                    continue
                del targets[scale_name(key)]
                targets[key] = torch.empty(rows, cols, device="meta")
                packed[key] = _PackedExpert(
                    getattr(module, name)[e], getattr(module, name + SCALE)[e]
                )
    return packed


def _byte_copy(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return weight.view(torch.uint8)


def _packed_expert_reads(entry: _Entry, target: _PackedExpert, shards: _Shards) -> list[TensorRead]:
    """Two byte-for-byte reads (the E2M1 pairs, the E8M0 scales): nothing dequantised."""
    if entry.quantised is not WeightFormat.MXFP4:
        raise CheckpointError(
            entry.name, "stored unquantised in a checkpoint loaded with packed experts"
        )
    reads = []
    for stored, dest in ((entry.name, target.weight), (scale_name(entry.name), target.scale)):
        dtype, shape = shards.header(stored)
        nbytes = math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)
        reads.append(TensorRead(stored, dest.view(torch.uint8), _byte_copy, nbytes))
    return reads


# ----------------------------------------------------------------- packed weights


def packable_weights(names: list[str], files: dict[str, Path], shards: _Shards) -> list[str]:
    """The FP8_BLOCK weights among ``names`` that the checkpoint stores packed.

    Packed means ``F8_E4M3`` with an ``F8_E8M0`` (or ``U8``) ``.scale``; a BF16
    re-export of the same weight (or V3-style float scales) loads dequantised.
    Routed experts (MXFP4) and Engram tables are not FP8_BLOCK: never here.
    """
    packable = []
    for name in names:
        scale = scale_name(name)
        if weight_format(name) is not WeightFormat.FP8_BLOCK or name not in files:
            continue
        if scale not in files or shards.header(name)[0] != "F8_E4M3":
            continue
        if shards.header(scale)[0] in ("F8_E8M0", "U8"):
            packable.append(name)
    return packable


def _stored_bytes(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return weight  # packed: the stored bytes, as they are


def _packed_reads(name: str, targets: dict[str, torch.Tensor], shards: _Shards) -> list[TensorRead]:
    """A packed weight and its scale, each copied byte for byte into its buffer."""
    reads = []
    for stored in (name, scale_name(name)):
        dtype, shape = shards.header(stored)
        target = targets[stored]
        if dtype == "U8":  # raw E8M0 bytes: the buffer's byte view takes them
            target = target.view(torch.uint8)
        nbytes = math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)
        reads.append(TensorRead(stored, target, _stored_bytes, nbytes))
    return reads


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    encoder_only: bool = False,
    engram_mmap: bool | None = None,
    progress: bool | None = None,
    quantization: str = "auto",
    parallel: Parallel = SINGLE,
) -> tuple[ModelConfig, DeepseekV41]:
    """Read ``config.json``, the weights and the Engram vocabulary of ``path`` into a model.

    ``encoder_only`` (a prefill worker): layers past the CED boundary are neither
    allocated nor read (``DeepseekV41.drop_decoder_layers``). Weights stream in
    slice by slice (engine/loader/weight_stream.py); ``progress``: a bar over the bytes
    on stderr (None: when stderr is a terminal).
    ``engram_mmap``: keep the Engram tables in the checkpoint's files, memory-mapped,
    and gather each step's rows from there (no byte of a table is read at load, none
    is in ``state_dict``); None: when they exceed ``ENGRAM_MMAP_MIN_BYTES``.
    ``quantization``: ``"auto"`` keeps the routed experts packed (their stored
    MXFP4 bytes, copied as they are) when the checkpoint stores them so, and each
    FP8-block weight stored as ``F8_E4M3`` packed (an ``Fp8Linear`` holding the
    stored bytes, activations quantised per block of 32 at run time); ``"none"``
    dequantises every weight at load into ``dtype``.
    ``parallel``: load this rank's shares only (docs/design/parallelism.md): its
    EP experts (the others' tensors are not read) and its TP slices of the split
    tensors (rows read as a slice; column splits read whole rows, then cut). A
    packed FP8 weight's shard keeps its stored bytes and the matching 32 x 32
    blocks of its scale grid (``_tp_packed_reads``); a shard that is not whole
    blocks along the split dimension is refused (``check_tp_packed``)."""
    check_quantization(quantization)
    path = Path(path)
    config = ModelConfig.from_json(path / "config.json")
    files = weight_map(path)
    with _Shards(files) as shards:
        if engram_mmap is None:
            engram_mmap = _wants_engram_mmap(files, shards)
        experts_packed = quantization == "auto" and experts_stored_packed(files, shards)
    model = _build(config, dtype, device, engram_mmap, experts_packed, parallel)
    decoder: tuple[str, ...] = ()
    if encoder_only:
        model.drop_decoder_layers()
        decoder = tuple(f"layers.{l}." for l in range(len(model.layers), config.num_hidden_layers))

    def decoder_layer(name: str) -> str | None:
        return "decoder-layer" if decoder and name.startswith(decoder) else None

    first, stop = parallel.experts(config.n_routed_experts)

    def left_out(name: str) -> str | None:
        expert = expert_of(name)
        if expert is not None and not first <= expert < stop:
            return "other-rank-expert"
        return decoder_layer(name)

    packed_linears: set[str] = set()
    if quantization == "auto":
        with _Shards(files) as shards:
            names = packable_weights(list(model.state_dict(keep_vars=True)), files, shards)
        swapped = pack_linears(model, names)
        check_tp_packed(model, swapped, parallel)
        packed_linears = set(swapped)
    targets = model.state_dict(keep_vars=True)
    packed = packed_expert_targets(model, targets)
    tp_shards = tp_shard_targets(targets, parallel)
    with _Shards(files) as shards, torch.no_grad():
        # A packed weight's `.scale` is a buffer of the model now: the plan sees
        # it as the weight's sibling, as for a dequantised load.
        packed_scales = {scale_name(n) for n in packed_linears}
        planned = {n: t for n, t in targets.items() if n not in packed_scales}
        entries, skipped = _plan(planned, files, shards, left_out)
        absent = [n for n in targets if optional_tensor(n) and n not in files]
        for name in absent:
            targets[name].zero_()
        if absent:
            logger.info("checkpoint %s: %d optional tensors absent, zeros", path, len(absent))
        reads = []
        for entry in entries:
            if engram_mmap and weight_format(entry.name) is WeightFormat.FP8_ROWS:
                _map_engram_table(model, entry, files, dtype)
                continue
            if entry.name in packed:
                reads.extend(_packed_expert_reads(entry, packed[entry.name], shards))
                continue
            if entry.name in tp_shards and entry.name in packed_linears:
                scale = targets[scale_name(entry.name)]
                reads.extend(_tp_packed_reads(entry, tp_shards[entry.name], scale, shards))
                continue
            if entry.name in tp_shards:
                reads.append(_tp_shard_read(entry, tp_shards[entry.name], shards))
                continue
            if entry.name in packed_linears:
                reads.extend(_packed_reads(entry.name, targets, shards))
                continue
            reads.append(_tensor_read(entry, targets[entry.name], shards))
    # After the headers' handles are closed: only the shard being read stays mapped.
    stream_into(reads, files, progress=progress, label=str(path))
    for kind, count in sorted(skipped.items()):
        logger.info("checkpoint %s: skipped %d %s tensors (not served)", path, count, kind)
    if config.engram_layer_ids:
        if (path / TOKENIZER_FILE).exists():
            set_engram_vocab(model, config, path / TOKENIZER_FILE)
        else:
            logger.warning("%s has no %s: Engram token classes left unset", path, TOKENIZER_FILE)
    return config, model


# ----------------------------------------------------------------- tensor-parallel shards


@dataclass(frozen=True, slots=True)
class _TPShard:
    """Where one TP-split tensor's slice goes: stored ``[start, stop)`` along ``dim``."""

    target: torch.Tensor  # this rank's parameter
    dim: int
    start: int
    stop: int


def tp_shard_targets(targets: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, _TPShard]:
    """Take the TP-split entries (``engine.model.parallel.TP_SPLIT``) out of ``targets``.

    Each is replaced by a ``meta`` placeholder of the stored (whole) shape, so
    ``_plan`` checks the checkpoint exactly as for one process.
    """
    out: dict[str, _TPShard] = {}
    if parallel.tp_size == 1:
        return out
    for name, target in list(targets.items()):
        dim = tp_split_dim(name)
        if dim is None:
            continue
        part = target.shape[dim]
        whole = list(target.shape)
        whole[dim] = part * parallel.tp_size
        start = parallel.tp_rank * part
        out[name] = _TPShard(target, dim, start, start + part)
        targets[name] = torch.empty(whole, dtype=target.dtype, device="meta")
    return out


def check_tp_packed(model: nn.Module, packed: list[str], parallel: Parallel) -> None:
    """Refuse a packed TP-split weight whose shard is not whole 32 x 32 blocks.

    A shard keeps the stored bytes and its blocks' scales, so this rank's part
    along the split dimension (the module as built for this rank) must be a
    multiple of the block; with the official config and T <= 8 every part is.
    """
    if parallel.tp_size == 1:
        return
    for name in packed:
        dim = tp_split_dim(name)
        if dim is None:
            continue
        weight = model.get_submodule(name.removesuffix(".weight")).weight
        assert isinstance(weight, torch.Tensor), name
        part = weight.shape[dim]
        if part % QUANT_BLOCK:
            what = "rows" if dim == 0 else "columns"
            raise ValueError(
                f"{name}: TP rank's part is {part} {what}, not a multiple of the "
                f"{QUANT_BLOCK}-wide FP8 block, so its packed shard cannot keep the stored "
                f"bytes and scales (TP size {parallel.tp_size}); load with "
                f'quantization="none" or another TP size'
            )


def _tp_packed_reads(
    entry: _Entry, shard: _TPShard, scale: torch.Tensor, shards: _Shards
) -> list[TensorRead]:
    """A packed shard, byte for byte: the E4M3 weight's ``[start, stop)`` along
    ``dim`` and the same block range ``[start / 32, stop / 32)`` of its E8M0 grid.

    Rows are read as slices; a column split reads whole rows and keeps its
    columns (as the dequantised path does). ``check_tp_packed`` made both ends
    block boundaries, so the blocks a shard holds are exactly its own.
    """
    if entry.quantised is not WeightFormat.FP8_BLOCK:
        raise CheckpointError(entry.name, "packed TP shard of a weight not stored as FP8 blocks")
    reads = []
    for stored, target, block in (
        (entry.name, shard.target, 1),
        (scale_name(entry.name), scale, QUANT_BLOCK),
    ):
        dtype, shape = shards.header(stored)
        if dtype == "U8":  # raw E8M0 bytes: the buffer's byte view takes them
            target = target.view(torch.uint8)
        start, stop = shard.start // block, shard.stop // block
        itemsize = _DTYPE_BYTES.get(dtype, 1)
        if shard.dim == 0:
            nbytes = (stop - start) * math.prod(shape[1:]) * itemsize
            reads.append(TensorRead(stored, target, _stored_bytes, nbytes, row_offset=start))
            continue
        nbytes = math.prod(shape) * itemsize
        reads.append(TensorRead(stored, target, _stored_columns(start, stop), nbytes))
    return reads


def _stored_columns(start: int, stop: int) -> Convert:
    def columns(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return weight[:, start:stop]

    return columns


def _tp_shard_read(entry: _Entry, shard: _TPShard, shards: _Shards) -> TensorRead:
    """Rows ``[start, stop)`` read as a slice (on FP8 block boundaries, with their
    scales), or whole rows dequantised and cut to columns ``[start, stop)``."""
    fmt = entry.quantised
    scale = scale_name(entry.name) if fmt else None
    block = QUANT_BLOCK if fmt is WeightFormat.FP8_BLOCK else 1
    start, stop = shard.start, shard.stop

    def stored_bytes(name: str, rows: int | None) -> int:
        dtype, shape = shards.header(name)
        n = math.prod(shape) if rows is None else rows * math.prod(shape[1:])
        return n * _DTYPE_BYTES.get(dtype, 1)

    if shard.dim == 0:
        if start % block:
            raise CheckpointError(
                entry.name, f"TP shard starts at row {start}, not on a {block}-row FP8 block"
            )
        nbytes = stored_bytes(entry.name, stop - start)
        if scale is not None:
            nbytes += stored_bytes(scale, math.ceil(stop / block) - start // block)

        def convert(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            return dequantize(fmt, weight, scales, torch.float32)

        return TensorRead(entry.name, shard.target, convert, nbytes, scale, block, row_offset=start)

    nbytes = stored_bytes(entry.name, None) + (stored_bytes(scale, None) if scale else 0)

    def columns(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return dequantize(fmt, weight, scales, torch.float32)[:, start:stop]

    return TensorRead(entry.name, shard.target, columns, nbytes, scale, block)
