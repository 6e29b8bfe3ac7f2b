"""The drafter's view of the model config: its stages and their MoE sizes."""

from __future__ import annotations

import dataclasses

from engine.model.deepseek_v41.config import ConfigError, ModelConfig


def drafter_config(config: ModelConfig) -> ModelConfig | None:
    """The config the DSpark stages are built from, or None for a model without one.

    The stages are ordinary V4.1 blocks with layer ids ``num_hidden_layers + i``
    (their ``compress_ratios`` entries, 0: sliding window only) whose MoE has its
    own expert count and top-k (``dspark_n_routed_experts``,
    ``dspark_num_experts_per_tok``).
    """
    if config.num_nextn_predict_layers == 0:
        return None
    check(config)
    return dataclasses.replace(
        config,
        n_routed_experts=config.dspark_n_routed_experts,
        num_experts_per_tok=config.dspark_num_experts_per_tok,
    )


def drafter_problem(config: ModelConfig) -> ConfigError | None:
    """Why ``config`` cannot build its drafter, or None (also None without one)."""
    if config.num_nextn_predict_layers == 0:
        return None
    try:
        check(config)
    except ConfigError as e:
        return e
    return None


def stage_layer_ids(config: ModelConfig) -> list[int]:
    """The layer ids of the stages ``mtp.0 .. mtp.n-1``."""
    n = config.num_hidden_layers
    return list(range(n, n + config.num_nextn_predict_layers))


def check(config: ModelConfig) -> None:
    """What the drafter needs of the config, refused with the field to fix."""
    if config.dspark_block_size < 1:
        raise ConfigError("dspark_block_size", "must be >= 1")
    if not 0 <= config.dspark_noise_token_id < config.vocab_size:
        raise ConfigError(
            "dspark_noise_token_id",
            f"{config.dspark_noise_token_id} is outside the vocabulary ({config.vocab_size})",
        )
    targets = config.dspark_target_layer_ids
    if not targets or any(not 0 <= l < config.num_hidden_layers for l in targets):
        raise ConfigError(
            "dspark_target_layer_ids",
            f"{targets}: need one or more target layers in [0, {config.num_hidden_layers})",
        )
    for l in stage_layer_ids(config):
        if config.compress_ratios[l] != 0:
            raise ConfigError(
                "compress_ratios",
                f"entry {l} (a DSpark stage) is {config.compress_ratios[l]}; "
                "the drafter's attention is sliding-window only (0)",
            )
    if not 1 <= config.dspark_num_experts_per_tok <= config.dspark_n_routed_experts:
        raise ConfigError(
            "dspark_num_experts_per_tok",
            f"{config.dspark_num_experts_per_tok} of {config.dspark_n_routed_experts} experts",
        )
    if config.dspark_markov_rank < 1:
        raise ConfigError("dspark_markov_rank", "must be >= 1")
