"""DeepSeek-V4.1-Flash text configuration.

One dataclass holds every field of the official ``text_config`` under its
official name, so a reader holding ``config.json`` finds each number here.
Derived quantities (layer roles, the CED boundary) are methods, never stored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config that cannot describe a valid model; the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"config field `{field_name}`: {message}")
        self.field = field_name


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_table_primes(
    vocab_size: int, n_layers: int, orders: list[int], n_heads: int
) -> list[list[int]]:
    """Engram hash moduli, one list of ``len(orders) * n_heads`` primes per Engram layer.

    docs/design/architecture.md §1.9 and §3.6: for every (layer, order) the walk
    restarts just above ``vocab_size - 1``: the first candidate is ``vocab_size``
    itself, as in the release's layout. A prime is never used twice, across
    orders and layers. A layer's table has ``sum(primes)`` rows; the official config's
    ``engram_num_embeddings`` [384006168, 384016682] follow from this rule.
    """
    return [list(p) for p in _engram_table_primes(vocab_size, n_layers, tuple(orders), n_heads)]


@functools.lru_cache(maxsize=16)  # every Engram hash asks for them; the walk costs ~1 ms
def _engram_table_primes(
    vocab_size: int, n_layers: int, orders: tuple[int, ...], n_heads: int
) -> tuple[tuple[int, ...], ...]:
    used: set[int] = set()
    per_layer: list[tuple[int, ...]] = []
    for _ in range(n_layers):
        primes: list[int] = []
        for _order in orders:
            candidate = vocab_size
            for _head in range(n_heads):
                while not _is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                primes.append(candidate)
        per_layer.append(tuple(primes))
    return tuple(per_layer)


class LayerRole(StrEnum):
    """CSA2 role of a layer (docs/design/architecture.md §1.2)."""

    SWA_ONLY = "swa_only"  # compress ratio 0: sliding window only
    FULL = "full"  # kv source + index source: own compressor, own indexer
    REINDEX = "reindex"  # index source only: own indexer over S(l)'s keys
    REUSE = "reuse"  # neither: S(l)'s KV with the top-k published by I(l)


@dataclass(slots=True)
class RopeScaling:
    rope_type: str = "yarn"
    factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536


@dataclass(slots=True)
class QuantizationConfig:
    """Top-level ``quantization_config``: how the checkpoint stores weights."""

    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: list[int] = field(default_factory=lambda: [32, 32])
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"


@dataclass(slots=True)
class ModelConfig:
    """Every field of the official V4.1 ``text_config`` (names as in config.json)."""

    vocab_size: int = 129280
    # Special tokens of the DeepSeek tokenizer. The released config.json names
    # none; a checkpoint whose config.json does (text_config or top level) wins.
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list[int] = field(
        default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    )
    compress_rope_theta: float = 160000.0
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(
        default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36]
    )
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    model_type: str = "deepseek_v41_text"
    # Not in the text config: the checkpoint's top level. Kept here so one object
    # travels through loader, engine and kvstore.
    quantization_config: QuantizationConfig | None = field(default_factory=QuantizationConfig)
    # Fields of config.json we do not model (vision_config, ...) are kept verbatim.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- roles
    def kv_source(self, layer: int) -> int | None:
        """S(l): the largest kv source <= l (None for a layer below every source)."""
        below = [s for s in self.kv_source_layer_ids if s <= layer]
        return max(below) if below else None

    def index_source(self, layer: int) -> int | None:
        """I(l): the largest index source <= l."""
        below = [s for s in self.index_source_layer_ids if s <= layer]
        return max(below) if below else None

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def role(self, layer: int) -> LayerRole:
        if self.compress_ratios[layer] == 0:
            return LayerRole.SWA_ONLY
        is_kv = layer in self.kv_source_layer_ids
        is_index = layer in self.index_source_layer_ids
        if is_kv and is_index:
            return LayerRole.FULL
        if is_index:
            return LayerRole.REINDEX
        return LayerRole.REUSE

    @property
    def ced_boundary(self) -> int:
        """First decoder layer: the last kv source (layer 20 for the official config).

        CED prefill runs layers below it over every prompt token, plus this layer's
        KV writes; this layer's query side and everything above it replay only the
        last window (docs/design/architecture.md §2.1, §3.1).
        """
        return max(self.kv_source_layer_ids)

    def engram_primes(self) -> list[list[int]]:
        return engram_table_primes(
            self.engram_vocab_size,
            len(self.engram_layer_ids),
            self.engram_orders,
            self.engram_n_heads,
        )

    @property
    def engram_orders(self) -> list[int]:
        """n-gram orders with a table: 2..max_ngram_size."""
        return list(range(2, self.engram_max_ngram_size + 1))

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        n = self.num_hidden_layers
        layers = range(n)
        if len(self.compress_ratios) != n + self.num_nextn_predict_layers:
            raise ConfigError(
                "compress_ratios",
                f"has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"num_nextn_predict_layers = {n + self.num_nextn_predict_layers}",
            )
        bad = [r for r in self.compress_ratios if r not in (0, 1, 2)]
        if bad:
            raise ConfigError("compress_ratios", f"unsupported ratios {sorted(set(bad))}")
        if self.num_key_value_heads != 1:
            raise ConfigError("num_key_value_heads", "V4.1 attention is MQA: must be 1")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                "o_groups",
                f"{self.o_groups} does not divide num_attention_heads={self.num_attention_heads}",
            )
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim", "must be even and within head_dim")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if sorted(set(ids)) != list(ids):
                raise ConfigError(name, "must be strictly increasing")
            if any(i not in layers for i in ids):
                raise ConfigError(name, f"ids must lie in [0, {n})")
        compressing = {l for l in layers if self.compress_ratios[l] > 0}
        if not set(self.kv_source_layer_ids) <= compressing:
            raise ConfigError(
                "kv_source_layer_ids",
                f"{sorted(set(self.kv_source_layer_ids) - compressing)} are not compressing "
                "layers (compress ratio 0)",
            )
        if not set(self.index_source_layer_ids) <= compressing:
            raise ConfigError("index_source_layer_ids", "every index source must compress")
        missing = set(self.kv_source_layer_ids) - set(self.index_source_layer_ids)
        if missing:
            raise ConfigError(
                "index_source_layer_ids", f"kv sources {sorted(missing)} must be index sources"
            )
        for l in sorted(compressing):
            src = self.kv_source(l)
            if src is None:
                raise ConfigError(
                    "kv_source_layer_ids", f"layer {l} compresses but has no kv source"
                )
            if self.compress_ratios[src] != self.compress_ratios[l]:
                raise ConfigError(
                    "compress_ratios",
                    f"layer {l} has ratio {self.compress_ratios[l]} but its kv source {src} "
                    f"has ratio {self.compress_ratios[src]}",
                )
            if self.index_source(l) is None:
                raise ConfigError("index_source_layer_ids", f"layer {l} has no index source")
        c = self.candidate_source_layer_id
        if c not in self.kv_source_layer_ids:
            raise ConfigError("candidate_source_layer_id", f"{c} is not a kv source")
        if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
            raise ConfigError(
                "candidate_topk_blocks",
                f"candidate_topk_blocks * candidate_block_size = "
                f"{self.candidate_topk_blocks * self.candidate_block_size} < index_topk = "
                f"{self.index_topk}",
            )
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("engram_num_embeddings", "needs one entry per engram layer")
        rows = [sum(p) for p in self.engram_primes()]
        if list(self.engram_num_embeddings) != rows:
            raise ConfigError(
                "engram_num_embeddings",
                f"{self.engram_num_embeddings} does not follow the prime scheme from "
                f"engram_vocab_size={self.engram_vocab_size}: expected {rows}",
            )
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError("scoring_func", f"unsupported {self.scoring_func!r}")
        if self.n_shared_experts != 1:
            raise ConfigError("n_shared_experts", "V4.1 has exactly one shared expert")
        if self.rope_scaling.rope_type != "yarn":
            raise ConfigError("rope_scaling", "only yarn scaling is defined for V4.1")

    # ------------------------------------------------------------- (de)serialise
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a whole config.json (text fields nested or at top level)."""
        data = dict(data)
        text = dict(data.pop("text_config", {}) or {})
        quant = data.pop("quantization_config", None)
        merged = {**data, **text}
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "quantization_config"}
        kwargs: dict[str, Any] = {k: v for k, v in merged.items() if k in known}
        extra = {k: v for k, v in merged.items() if k not in known}
        if "rope_scaling" in kwargs:
            rs = dict(kwargs["rope_scaling"] or {})
            rs.setdefault("rope_type", rs.pop("type", "yarn"))
            known_rs = {f.name for f in dataclasses.fields(RopeScaling)}
            kwargs["rope_scaling"] = RopeScaling(**{k: v for k, v in rs.items() if k in known_rs})
        if quant is not None:
            known_q = {f.name for f in dataclasses.fields(QuantizationConfig)}
            quant = QuantizationConfig(**{k: v for k, v in quant.items() if k in known_q})
        try:
            return cls(**kwargs, quantization_config=quant, extra=extra)
        except TypeError as exc:  # a field with the wrong type shape
            raise ConfigError("config.json", str(exc)) from exc

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Parse a ``config.json`` file, or the one inside a checkpoint directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint layout: text fields under ``text_config``, extras kept."""
        text = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "quantization_config")
        }
        text["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            **{k: v for k, v in self.extra.items() if k not in text},
            "text_config": text,
        }
        if self.quantization_config is not None:
            out["quantization_config"] = dataclasses.asdict(self.quantization_config)
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------- presets
    @classmethod
    def official(cls) -> ModelConfig:
        """The released DeepSeek-V4.1-Flash config (shipped with the package)."""
        text = resources.files("engine.model.deepseek_v41").joinpath(
            "data/deepseek-v4.1-flash.config.json"
        )
        return cls.from_dict(json.loads(text.read_text(encoding="utf-8")))

    @classmethod
    def tiny(cls) -> ModelConfig:
        """CPU-sized model with the official topology.

        8 layers = 4 encoder + 4 decoder. Layers 0-1 SWA only, 2 Full (ratio 2,
        Engram), 3 Reuse (ratio 2), 4 Full (ratio 1, candidate source, CED
        boundary), 5 Reuse, 6 Reindex, 7 Reuse. The 512-d latent, 64 RoPE dims and
        128-d index keys stay at full size so the KV byte formats are the real ones.
        """
        heads, layers = 2, [1, 2]
        rows = [sum(p) for p in engram_table_primes(1000, len(layers), [2, 3, 4], heads)]
        return cls(
            engram_vocab_size=1000,
            engram_n_heads=heads,
            engram_layer_ids=layers,
            engram_num_embeddings=rows,
            hidden_size=256,
            moe_intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=8,
            q_lora_rank=64,
            o_lora_rank=64,
            o_groups=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0],
            kv_source_layer_ids=[2, 4],
            index_source_layer_ids=[2, 4, 6],
            index_n_heads=4,
            index_topk=16,
            candidate_source_layer_id=4,
            candidate_topk_blocks=4,
            candidate_block_size=8,
            engram_head_dim=32,
            num_nextn_predict_layers=1,
            dspark_target_layer_ids=[7],
            dspark_markov_rank=16,
            dspark_n_routed_experts=4,
            dspark_num_experts_per_tok=1,
            max_position_embeddings=65536,
        )

    @classmethod
    def preset(cls, name_or_path: str | Path) -> ModelConfig:
        """``tiny``, ``official``, a config.json path, or a checkpoint directory."""
        if str(name_or_path) == "tiny":
            return cls.tiny()
        if str(name_or_path) == "official":
            return cls.official()
        return cls.from_json(name_or_path)
