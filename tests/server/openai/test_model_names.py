"""Model names: DeepSeek's default output budget by thinking mode, through the names."""

from __future__ import annotations

import pytest

from server.openai.model_names import default_max_tokens, resolve_model, thinking_enabled


@pytest.mark.parametrize(
    ("name", "thinking_type", "expected"),
    [
        ("deepseek-chat", None, 4096),  # DeepSeek: "DEFAULT: 4K"
        ("deepseek-reasoner", None, 32768),  # "DEFAULT: 32K"
        ("deepseek-v4-flash", None, 32768),  # thinking by default
        ("deepseek-v4-flash", "disabled", 4096),
        ("deepseek-flash", None, 32768),
        ("deepseek-chat", "enabled", 32768),
    ],
)
def test_default_budget_follows_the_mode_the_name_runs_in(
    name: str, thinking_type: str | None, expected: int
) -> None:
    thinking = thinking_enabled(resolve_model(name), thinking_type, None)
    assert default_max_tokens(thinking) == expected
    assert default_max_tokens(thinking, override=64) == 64


class _Engine:
    max_model_len = 1_000_000
    vocab_size = 129280


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": "deepseek-chat"}, 4096),
        ({"model": "deepseek-reasoner"}, 32768),
        ({"model": "deepseek-v4-pro", "thinking": {"type": "disabled"}}, 4096),
        ({"model": "deepseek-chat", "max_tokens": 5}, 5),
    ],
)
def test_chat_requests_without_max_tokens_get_the_default(body: dict, expected: int) -> None:
    """Through ``plan_chat``: the engine request's budget."""
    from engine.loader.tokenizer import load_tokenizer
    from server.chat.chat_plan import plan_chat
    from server.metrics.metrics import ServerMetrics
    from server.openai.generation import ServingContext
    from server.openai.protocol import ChatCompletionRequest
    from server.settings import ServerSettings

    tokenizer = load_tokenizer()
    ctx = ServingContext(
        engine=_Engine(),  # type: ignore[arg-type]
        settings=ServerSettings(),
        metrics=ServerMetrics("m"),
        tokenizer=tokenizer,
        token_texts=None,  # type: ignore[arg-type]
    )
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], **body}
    )
    (call,) = plan_chat(ctx, request, None).calls
    assert call.request.sampling_params.max_tokens == expected
