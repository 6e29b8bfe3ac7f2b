"""Building an engine: the model, its tokenizer and the ``LLMEngine`` around them.

``AsyncEngine`` calls ``build_engine``; ``flashserve serve`` uses
``checkpoint_fingerprint`` to name the weights it serves (the prefill/decode
pairing of disaggregated serving compares it).
"""

from __future__ import annotations

from pathlib import Path

import blake3
import torch

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.model import DeepseekV41
from engine.tokenizer import TOKENIZER_FILE, load_tokenizer, packaged_tokenizer_path


def build_engine(
    config: EngineConfig, model: str | Path, *, encoder_only: bool = False
) -> LLMEngine:
    """Model, tokenizer and engine for ``model`` ("tiny" or a checkpoint directory).

    A checkpoint's own ``tokenizer.json`` wins (``load_checkpoint`` then sets
    Engram's token classes from it); otherwise the packaged tokenizer serves
    both the text and the classes. ``encoder_only``: a prefill worker's engine,
    without the decoder layers (it runs prefill-only requests only).
    """
    from engine.checkpoint import load_checkpoint, set_engram_vocab

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
    return LLMEngine.build(config, net.eval(), tokenizer=tokenizer, model_id=model_id)


def _tiny_model(config: EngineConfig) -> DeepseekV41:
    from engine.model.config import ModelConfig

    net = DeepseekV41(ModelConfig.tiny())
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
