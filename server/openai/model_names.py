"""Model names the API answers to, and what each implies for thinking mode.

flashserve serves one model under ``--served-model-name`` (``deepseek-flash`` by
default). DeepSeek's own names route to it so clients work unchanged:
``deepseek-v4-flash`` and ``deepseek-v4-pro`` (thinking on by default, as on
DeepSeek's API), ``deepseek-chat`` (thinking off) and ``deepseek-reasoner``
(thinking on). An explicit ``thinking`` parameter overrides the name's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.http.errors import APIError
from server.settings import DEFAULT_SERVED_MODEL_NAME

# DeepSeek's output budget when a request names no max_tokens (Models & Pricing,
# "MAX OUTPUT": deepseek-chat, non-thinking, "DEFAULT: 4K"; deepseek-reasoner,
# thinking, "DEFAULT: 32K"). Every name takes the budget of the mode the request
# runs in; ``--default-max-tokens`` replaces both.
DEFAULT_MAX_TOKENS_NON_THINKING = 4096
DEFAULT_MAX_TOKENS_THINKING = 32768

# alias -> its default thinking mode
ALIASES: dict[str, bool] = {
    "deepseek-v4-flash": True,
    "deepseek-v4-pro": True,
    "deepseek-chat": False,
    "deepseek-reasoner": True,
}


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where a request's ``model`` goes."""

    name: str  # as the client sent it; echoed back in responses
    served: str  # the served model
    default_thinking: bool


def model_not_exist() -> APIError:
    """DeepSeek's answer to an unknown model name, word for word."""
    return APIError(400, "Model Not Exist", param="model")


def resolve_model(name: str, served_name: str = DEFAULT_SERVED_MODEL_NAME) -> ModelRoute:
    """The route for ``name``; unknown names are a 400 "Model Not Exist"."""
    if name == served_name:
        return ModelRoute(name=name, served=served_name, default_thinking=True)
    if name in ALIASES:
        return ModelRoute(name=name, served=served_name, default_thinking=ALIASES[name])
    raise model_not_exist()


def model_ids(served_name: str = DEFAULT_SERVED_MODEL_NAME) -> list[str]:
    """Every name ``/v1/models`` lists: the served name first, then the aliases."""
    return [served_name, *(a for a in ALIASES if a != served_name)]


def thinking_enabled(
    route: ModelRoute, thinking_type: str | None, reasoning_effort: str | int | None
) -> bool:
    """Thinking mode for a request.

    ``thinking.type`` wins when given; ``reasoning_effort: "none"`` (OpenAI's way
    to turn reasoning off) disables it; otherwise the model name's default.
    """
    if thinking_type is not None:
        return thinking_type == "enabled"
    if reasoning_effort == "none":
        return False
    return route.default_thinking


def default_max_tokens(thinking: bool, override: int | None = None) -> int:
    """The output budget of a request that names none (capped later by the context)."""
    if override is not None:
        return override
    return DEFAULT_MAX_TOKENS_THINKING if thinking else DEFAULT_MAX_TOKENS_NON_THINKING
