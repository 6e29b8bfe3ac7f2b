"""The release's ``vision_config`` and ``image_token_id``, read from a ``ModelConfig``.

``ModelConfig`` keeps every field of config.json it does not model verbatim in
``extra``; the vision fields live there under their official names, and this
dataclass is their typed view. A config without ``vision_config`` describes a
text-only model (no tower is built, an image is refused).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.model.deepseek_v41.config import ConfigError, ModelConfig

# The release's ``<｜deepseek_image｜>`` id (its config.json's ``image_token_id``).
RELEASE_IMAGE_TOKEN_ID = 129264
IMAGE_TOKEN = "<｜deepseek_image｜>"

# The vision RMSNorm's eps: not in the config; every public port uses 1e-6
# (the text model's is 1e-20).
VISION_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """Every field of the official ``vision_config`` (names as in config.json)."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    model_type: str = "deepseek_v41_vision"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "vision_config.num_attention_heads",
                f"{self.num_attention_heads} does not divide hidden_size={self.hidden_size}",
            )
        if self.head_dim % 4:
            # 2-D rotary: half the head's dims rotate, half of those per axis.
            raise ConfigError("vision_config.hidden_size", "head dim must be a multiple of 4")
        for name in ("patch_size", "downsample_ratio", "min_pixels", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision_config.{name}", "must be positive")
        if self.max_image_tokens < 4:
            raise ConfigError("vision_config.max_image_tokens", "must be at least 4")
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ConfigError("vision_config.max_wh_ratio", "must be positive or null")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels x patch x patch (588 for the release)."""
        return 3 * self.patch_size**2

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ConfigError("vision_config", str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def tiny(cls) -> VisionConfig:
        """A CPU-sized tower with the release's image-processor settings (patch 14,
        downsample 3, ``min_pixels`` 295,936, 1,024 image tokens): only the tower is small."""
        return cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48)


def vision_config(config: ModelConfig) -> VisionConfig | None:
    """The vision tower's config, or None for a text-only model."""
    data = config.extra.get("vision_config")
    if not data:
        return None
    return VisionConfig.from_dict(dict(data))


def image_token_id(config: ModelConfig) -> int | None:
    """The placeholder id every position of an image span carries, or None.

    A config.json's top-level ``image_token_id`` wins; a model with a vision tower
    and none takes the release's id.
    """
    value = config.extra.get("image_token_id")
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < config.vocab_size:
            raise ConfigError("image_token_id", f"{value} is outside the vocabulary")
        return value
    return RELEASE_IMAGE_TOKEN_ID if vision_config(config) is not None else None


def with_vision(
    config: ModelConfig, vision: VisionConfig, token_id: int = RELEASE_IMAGE_TOKEN_ID
) -> ModelConfig:
    """``config`` with a vision tower described (``vision_config`` and ``image_token_id``)."""
    extra = dict(config.extra) | {"vision_config": vision.to_dict(), "image_token_id": token_id}
    return config.replace(extra=extra)
