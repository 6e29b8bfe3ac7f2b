"""Building an engine: the model, its tokenizer and the ``LLMEngine`` around them.

The one builder. ``build_engine`` (``AsyncEngine``, the engine core process,
``flashserve serve``) loads "tiny" or a checkpoint directory and hands the model
to ``engine_for_model``, which builds the KV cache manager, the runner and the
engine; tests and benches that hold a model already call ``engine_for_model``
itself. ``flashserve serve`` uses ``checkpoint_fingerprint`` to name the weights
it serves (the prefill/decode pairing of disaggregated serving compares it).
"""

from __future__ import annotations

from pathlib import Path

import blake3
import torch
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.step import ModelRunner
from engine.loader.tokenizer import TOKENIZER_FILE, load_tokenizer, packaged_tokenizer_path
from engine.model.base import CausalLM
from engine.model.kv.dense_backend import KVPrecision
from engine.model.registry import model_spec
from engine.spec_decode.proposer import Proposer
from kvstore.device.layout import kv_layout
from kvstore.local import open_local_kv

# "tiny": the CPU-sized preset (``tiny()``) of this registered model type.
TINY_MODEL_TYPE = "deepseek_v41"


def build_engine(
    config: EngineConfig, model: str | Path, *, encoder_only: bool = False
) -> LLMEngine:
    """Model, tokenizer and engine for ``model`` ("tiny" or a checkpoint directory).

    A checkpoint's own ``tokenizer.json`` wins (``load_checkpoint`` then sets
    Engram's token classes from it); otherwise the packaged tokenizer serves
    both the text and the classes. ``encoder_only``: a prefill worker's engine,
    without the decoder layers (it runs prefill-only requests only).
    """
    from engine.loader.checkpoint import load_checkpoint, set_engram_vocab

    if config.world_size > 1:
        if encoder_only:
            raise ValueError("a prefill worker (--role prefill) is not served in parallel yet")
        return build_parallel_engine(config, model)
    if str(model) == "tiny":
        net, model_id, own_tokenizer = _tiny_model(config), f"tiny-random-seed{config.seed}", None
        if encoder_only:
            net.drop_decoder_layers()
    else:
        path = Path(model)
        _, net = load_checkpoint(
            path,
            dtype=config.torch_dtype,
            device=config.device,
            encoder_only=encoder_only,
            quantization=config.quantization,
        )
        model_id = checkpoint_fingerprint(path)
        own_tokenizer = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else None
    if config.torch_dtype == torch.float64:
        # Every parameter, mHC and router weights kept in fp32 by the loader included:
        # an exact run must not mix precisions. Packed FP8 bytes keep their dtype
        # (their GEMM accumulates in float64 for float64 activations).
        net = net.double()
    if own_tokenizer is None:
        set_engram_vocab(net, net.config, packaged_tokenizer_path())
    tokenizer = load_tokenizer(own_tokenizer)
    torch.manual_seed(config.seed)  # the global RNG of unseeded sampling
    return engine_for_model(config, net.eval(), tokenizer=tokenizer, model_id=model_id)


def engine_for_model(
    config: EngineConfig,
    model: CausalLM,
    *,
    tokenizer: Tokenizer | None = None,
    model_id: str = "",
    eos_token_id: int | None = None,
) -> LLMEngine:
    """The engine over ``model``: its KV bookkeeping and runner as ``config`` asks; the
    runner owns the device pages."""
    mc = model.config
    layout = kv_layout(
        mc.kv_source_layer_ids,
        mc.compress_ratios,
        config.page_tokens,
        config.kv_dtype,
        model_id,
    )
    kv, pages = open_local_kv(
        layout, config.kv_cache_bytes, config.device, config.kv_dir, config.kv_dir_bytes
    )
    spec = config.speculative()
    runner: ModelRunner
    if config.runner == "reference":
        from engine.runner.reference_runner import ReferenceRunner

        runner = ReferenceRunner(
            model,
            pages,
            KVPrecision(global_kv=config.kv_dtype),
            encoder_cache_bytes=config.encoder_cache_bytes,
        )
    else:
        from engine.runner.cuda_graphs import decode_graphs_for, max_step_rows
        from engine.runner.model_runner import PagedModelRunner

        graphs = decode_graphs_for(
            model,
            config.device,
            # Verify steps replay the graphs too: buckets up to their rows.
            max_step_rows(
                config.max_num_seqs,
                spec.num_speculative_tokens if spec is not None else 0,
                spec.max_batch_size if spec is not None else None,
                config.max_num_batched_tokens,
            ),
            enforce_eager=config.enforce_eager,
            sizes=config.cuda_graph_sizes,
            layer_inputs=spec is not None and spec.method == "dspark",
        )
        runner = PagedModelRunner(
            model,
            pages,
            config.max_num_seqs,
            graphs,
            encoder_cache_bytes=config.encoder_cache_bytes,
        )
    proposer = None
    if spec is not None:
        from engine.spec_decode.build import build_proposer

        proposer = build_proposer(spec, model)
    return _warmed(
        LLMEngine(
            config,
            runner,
            kv,
            model_config=mc,
            tokenizer=tokenizer,
            eos_token_id=eos_token_id,
            encoder_only=model.encoder_only,
            proposer=proposer,
        )
    )


def build_parallel_engine(config: EngineConfig, model: str | Path) -> LLMEngine:
    """The engine core of parallel serving: the scheduler and the KV bookkeeping here,
    the model on ``config.world_size`` worker ranks (``engine/parallel/executor.py``).

    With data parallelism the core keeps one KV pool's bookkeeping per DP rank
    (``engine/parallel/dp_kv.py``); each sequence's pages live on one rank.
    """
    from engine.model.registry import read_config
    from engine.parallel.dp_kv import DataParallelKV
    from engine.parallel.executor import ParallelExecutor
    from kvstore.device.layout import kv_layout

    if str(model) == "tiny":
        raise ValueError("parallel serving loads a checkpoint directory (serve writes tiny's)")
    if config.runner != "paged":
        raise ValueError("parallel serving runs the paged runner")
    path = Path(model)
    _, mc = read_config(path)
    model_id = checkpoint_fingerprint(path)
    layout = kv_layout(
        mc.kv_source_layer_ids, mc.compress_ratios, config.page_tokens, config.kv_dtype, model_id
    )
    kv = DataParallelKV(
        layout, config.kv_cache_bytes, config.data_parallel_size, config.kv_dir, config.kv_dir_bytes
    )
    runner = ParallelExecutor(config, str(path), model_id, kv.pool_of)
    runner.kv = kv
    own = path / TOKENIZER_FILE
    tokenizer = load_tokenizer(own if own.is_file() else None)
    torch.manual_seed(config.seed)
    try:
        proposer = _parallel_proposer(config, path)
        engine = LLMEngine(
            config, runner, kv, model_config=mc, tokenizer=tokenizer, proposer=proposer
        )
    except BaseException:
        runner.close()
        raise
    return _warmed(engine)


def _parallel_proposer(config: EngineConfig, path: Path) -> Proposer | None:
    """The proposer of parallel serving, in the engine core: ``ngram`` needs no model;
    ``dspark`` runs the checkpoint's drafter here, on the target's layer inputs that
    the workers send back (docs/design/parallelism.md, "Speculative decoding"), so
    the core loads the drafter and the target's embedding and head, nothing else."""
    spec = config.speculative()
    if spec is None:
        return None
    from engine.spec_decode.build import build_proposer

    if spec.method != "dspark":
        return build_proposer(spec, None)
    from engine.loader.checkpoint import load_drafter

    drafter = load_drafter(
        path, dtype=config.torch_dtype, device=config.device, quantization=config.quantization
    )
    if drafter is not None and config.torch_dtype == torch.float64:
        drafter = drafter.double()  # as the workers' model: an exact run mixes no precisions
    return build_proposer(spec, drafter)


def _warmed(engine: LLMEngine) -> LLMEngine:
    """An engine about to serve builds its grammar vocabulary now, in the grammar pool,
    rather than while the first spec's request and every other stream run."""
    if engine.grammars is not None and not engine.encoder_only:
        engine.grammars.warm()
    return engine


def _tiny_model(config: EngineConfig) -> CausalLM:
    spec = model_spec(TINY_MODEL_TYPE)
    net = spec.model_class(spec.config_class.tiny())
    net.init_weights(torch.Generator().manual_seed(config.seed))
    return net.to(device=config.device, dtype=config.torch_dtype)


def checkpoint_fingerprint(path: Path, sample_bytes: int = 1 << 20) -> str:
    """Identity of a checkpoint's weights for the KV layout: pages of other weights never mix.

    Hashes config.json and, per weight file, its name, size and first and last
    ``sample_bytes`` (cheap even for hundreds of GB, and two random checkpoints
    differ in their first bytes of data).
    """
    h = blake3.blake3((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(sample_bytes))
            f.seek(max(0, size - sample_bytes))
            h.update(f.read(sample_bytes))
    return h.hexdigest(length=16)
