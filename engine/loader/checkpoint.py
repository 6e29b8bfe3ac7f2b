"""Load an official-layout checkpoint into its model (engine/model/registry.py): the one entry
``load_checkpoint``, and the empty model it fills.

It reads ``config.json``, builds the model with uninitialised parameters (packed
where the checkpoint stores packed bytes), has the plan say what to read into
which parameter (engine/loader/plan.py, formats in engine/loader/formats.py,
tensor-parallel shards in engine/loader/tp_shards.py), streams the reads
(engine/loader/weight_stream.py) and sets the Engram vocabulary from the
checkpoint's tokenizer. The decision table of formats is in docs/design/checkpoints.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from engine.loader.files import Shards, weight_map
from engine.loader.formats import check_quantization
from engine.loader.plan import (
    LeftOut,
    LoadOptions,
    experts_stored_packed,
    packable_weights,
    plan_reads,
)
from engine.loader.tokenizer import TOKENIZER_FILE, load_tokenizer
from engine.loader.tp_shards import check_tp_packed
from engine.loader.weight_stream import stream_into
from engine.model.base import CausalLM, DrafterHost
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import build_compressed_vocab, tables_on_meta
from engine.model.deepseek_v41.fp8_linear import pack_linears
from engine.model.deepseek_v41.routed_experts import packed_experts
from engine.model.parallel import SINGLE, Parallel, expert_of
from engine.model.registry import read_config, spec_of
from engine.model.weights import WeightFormat, WeightRules, scale_name

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)

# ``engram_mmap=None`` maps the Engram tables when their stored bytes exceed
# this: the release's (~197 GB) stay on disk, tiny and demo tables load as
# parameters (trainable, in ``state_dict``).
ENGRAM_MMAP_MIN_BYTES = 1 << 30


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
) -> tuple[ModelConfig, CausalLM]:
    """Read ``config.json``, the weights and the Engram vocabulary of ``path`` into a model.

    ``encoder_only`` (a prefill worker): layers past the CED boundary are neither
    allocated nor read (``CausalLM.drop_decoder_layers``). Weights stream in
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
    blocks of its scale grid (engine/loader/tp_shards.py); a shard that is not whole
    blocks along the split dimension is refused (``check_tp_packed``)."""
    check_quantization(quantization)
    path = Path(path)
    spec, config = read_config(path)
    files = weight_map(path)
    with Shards(files) as shards:
        if engram_mmap is None:
            engram_mmap = _wants_engram_mmap(files, shards, spec.weights)
        experts_packed = quantization == "auto" and experts_stored_packed(
            files, shards, spec.weights
        )
    model = _build(spec.model_class, config, dtype, device, engram_mmap, experts_packed, parallel)
    if encoder_only:
        model.drop_decoder_layers()
    drafter = spec.weights.drafter_prefixes
    if drafter and not any(spec.weights.is_drafter(n) for n in files):
        # An export without the drafter loads the text model alone (a partial one is
        # refused by the plan: its missing tensors are named).
        model.drop_drafter()
    packed_linears: list[str] = []
    if quantization == "auto":
        with Shards(files) as shards:
            names = list(model.state_dict(keep_vars=True))
            names = packable_weights(names, files, shards, spec.weights)
        packed_linears = pack_linears(model, names)
        check_tp_packed(model, packed_linears, parallel)
    # A model built without its drafter (TP / EP ranks, for now) leaves the stored one out.
    held = model.state_dict(keep_vars=True)
    no_drafter = drafter if drafter and not any(spec.weights.is_drafter(n) for n in held) else ()
    left_out = _left_out(config, len(model.layers), parallel, no_drafter)
    options = LoadOptions(spec, dtype, engram_mmap, frozenset(packed_linears), parallel, left_out)
    with Shards(files) as shards, torch.no_grad():
        plan = plan_reads(model, files, shards, options)
    if plan.absent:
        logger.info("checkpoint %s: %d optional tensors absent, zeros", path, len(plan.absent))
    # After the headers' handles are closed: only the shard being read stays mapped.
    stream_into(plan.reads, files, progress=progress, label=str(path))
    for kind, count in sorted(plan.skipped.items()):
        logger.info("checkpoint %s: skipped %d %s tensors (not served)", path, count, kind)
    if config.engram_layer_ids:
        if (path / TOKENIZER_FILE).exists():
            set_engram_vocab(model, config, path / TOKENIZER_FILE)
        else:
            logger.warning("%s has no %s: Engram token classes left unset", path, TOKENIZER_FILE)
    return config, model


def load_drafter(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "auto",
) -> DrafterHost | None:
    """The checkpoint's speculative drafter and what it borrows of the target, none of
    the target's layers (``ModelSpec.drafter_class``): the engine core's drafter under
    parallel serving, where the workers hold the target (docs/design/parallelism.md).
    None when the checkpoint stores no drafter tensor; formats and packing as
    ``load_checkpoint``'s."""
    check_quantization(quantization)
    path = Path(path)
    spec, config = read_config(path)
    if spec.drafter_class is None:
        raise ValueError(f"model type {spec.model_type!r} has no speculative drafter")
    files = weight_map(path)
    if not any(spec.weights.is_drafter(n) for n in files):
        return None
    with Shards(files) as shards:
        experts_packed = quantization == "auto" and experts_stored_packed(
            files, shards, spec.weights
        )
    host = _build(spec.drafter_class, config, dtype, device, False, experts_packed)
    packed_linears: list[str] = []
    if quantization == "auto":
        with Shards(files) as shards:
            names = packable_weights(
                list(host.state_dict(keep_vars=True)), files, shards, spec.weights
            )
        packed_linears = pack_linears(host, names)
    # Whatever lies outside the host's modules is the target's (the workers' share).
    kept = tuple(f"{name}." for name, _ in host.named_children())

    def left_out(name: str) -> str | None:
        return None if name.startswith(kept) else "target"

    options = LoadOptions(spec, dtype, False, frozenset(packed_linears), SINGLE, left_out)
    with Shards(files) as shards, torch.no_grad():
        plan = plan_reads(host, files, shards, options)
    stream_into(plan.reads, files, progress=False, label=str(path))
    return host


def _left_out(
    config: ModelConfig, kept_layers: int, parallel: Parallel, drafter: tuple[str, ...] = ()
) -> LeftOut:
    """The tensors this rank's load does not read: other ranks' routed experts, the
    layers an encoder-only model dropped and a drafter (names ``drafter``) it did not build."""
    decoder = tuple(f"layers.{l}." for l in range(kept_layers, config.num_hidden_layers))
    first, stop = parallel.experts(config.n_routed_experts)

    def left_out(name: str) -> str | None:
        if drafter and name.startswith(drafter):
            return "dspark"
        expert = expert_of(name)
        if expert is not None and not first <= expert < stop:
            return "other-rank-expert"
        return "decoder-layer" if decoder and name.startswith(decoder) else None

    return left_out


def _wants_engram_mmap(files: dict[str, Path], shards: Shards, rules: WeightRules) -> bool:
    """The default of ``engram_mmap``: the stored tables exceed ``ENGRAM_MMAP_MIN_BYTES``."""
    stored = 0
    for name in (n for n in files if rules.format_of(n) is WeightFormat.FP8_ROWS):
        for part in (name, scale_name(name)):
            if part in files:
                stored += shards.nbytes(part)
    return stored > ENGRAM_MMAP_MIN_BYTES


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
) -> CausalLM:
    """The model of ``config``'s type (engine/model/registry.py) on ``device``, with
    uninitialised parameters in ``dtype``.

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
    spec = spec_of(config)
    model = _build(
        spec.model_class,
        config,
        dtype,
        device,
        engram_tables_on_meta,
        quantization == "auto",
        parallel,
    )
    if quantization == "auto":
        fp8 = WeightFormat.FP8_BLOCK
        names = [n for n in model.state_dict() if spec.weights.format_of(n) is fp8]
        check_tp_packed(model, pack_linears(model, names), parallel)
    return model


def _build(
    model_class: Callable[[ModelConfig, Parallel], M],
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    engram_tables_on_meta: bool,
    experts_packed: bool,
    parallel: Parallel = SINGLE,
) -> M:
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
            return model_class(config, parallel)
    finally:
        torch.set_default_dtype(previous)


def set_engram_vocab(model: CausalLM, config: ModelConfig, tokenizer_file: Path) -> None:
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
