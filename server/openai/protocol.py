"""Request and response bodies of the OpenAI/DeepSeek-compatible API (pydantic v2).

Requests ignore unknown fields: the OpenAI SDK and agent frameworks send extras
(``metadata``, ``store``, ``service_tier``, ...) and DeepSeek accepts them, so
rejecting them would break drop-in use. Every check that fails raises a
pydantic error whose location names the field; ``server.http.errors`` turns it into
the API error body (400 for a wrong shape, 422 for a value out of range).

Responses follow DeepSeek's shapes, which are OpenAI's plus ``reasoning_content``
and the ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens`` usage fields.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.api.errors import RequestError
from engine.api.model_vision import IMAGE_PLACEHOLDER
from engine.api.request_limits import output_budget
from engine.api.sampling_params import MAX_TOP_LOGPROBS
from server.chat.tool_schemas import check_tool_schemas
from server.http.errors import APIError
from server.http.input_checks import InputProblem, check_arguments_text, check_body

MAX_TOOLS = 128
MAX_STOP = 16
MAX_TOKEN_ID_DIGITS = 9  # token ids stay below 10^9
MAX_N = 128
# DeepSeek's reasoning_effort aliases on the V4.1 budget scale (docs/design/architecture.md §3.2:
# low 50, high 75, max 100). "medium" and "xhigh" follow DeepSeek's API, which maps
# medium -> high and xhigh -> max; "minimal" is OpenAI's lowest level.
REASONING_EFFORT_ALIASES: dict[str, int] = {
    "minimal": 50,
    "low": 50,
    "medium": 75,
    "high": 75,
    "xhigh": 100,
    "max": 100,
}
DEFAULT_REASONING_EFFORT = 75
# Part types other APIs use for images; a chat message takes ``image_url`` parts.
OTHER_IMAGE_PART_TYPES = frozenset({"input_image", "image"})
# Roles whose content may hold images: a user turn, and tool results (the V4.1
# template folds those into the user turn). The model never saw an image in a
# system or assistant turn.
IMAGE_ROLES = frozenset({"user", "tool"})
# ``content_text`` writes the model's image placeholder (``IMAGE_PLACEHOLDER``) once per
# image part; the planner expands it to the image's span (server/chat/chat_images.py).

FinishReason = Literal[
    "stop", "length", "tool_calls", "content_filter", "insufficient_system_resource"
]


def _format_error(message: str, **ctx: Any) -> PydanticCustomError:
    """A 400 "invalid format" error at the current field."""
    return PydanticCustomError("invalid_format", message, ctx or None)


def _parameter_error(message: str, **ctx: Any) -> PydanticCustomError:
    """A 422 "invalid parameter" error at the current field."""
    return PydanticCustomError("invalid_parameter", message, ctx or None)


class _Request(BaseModel):
    # strict: no coercion of "2" to 2 or "yes" to True, as the OpenAI API (an int is
    # still a valid float).
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


def _drop_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


# ---------------------------------------------------------------- request pieces


class ImageUrl(_Request):
    """OpenAI's ``image_url`` object: a ``data:`` or ``http(s)`` URL; ``detail`` is
    accepted and not used (the resize plan alone sets an image's token count)."""

    url: str
    detail: str | None = None  # OpenAI's "auto" / "low" / "high", or a newer level


class ContentPart(_Request):
    """One part of a list-valued ``content``: ``text`` or ``image_url``."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="before")
    @classmethod
    def _url_string(cls, data: Any) -> Any:
        # Some clients send ``"image_url": "<url>"``; read it as ``{"url": ...}``.
        if isinstance(data, dict) and isinstance(data.get("image_url"), str):
            return {**data, "image_url": {"url": data["image_url"]}}
        return data

    @model_validator(mode="after")
    def _served(self) -> ContentPart:
        if self.type == "image_url":
            if self.image_url is None:
                raise _format_error("an 'image_url' part needs an 'image_url' object with a 'url'")
            return self
        if self.type in OTHER_IMAGE_PART_TYPES:
            raise _format_error(
                "unsupported content part type '{t}'; images go in 'image_url' parts", t=self.type
            )
        if self.type != "text":
            raise _format_error(
                "unsupported content part type '{t}'; served: 'text', 'image_url'", t=self.type
            )
        if self.text is None:
            raise _format_error("a 'text' part needs a string 'text'")
        return self

    @property
    def is_image(self) -> bool:
        return self.type == "image_url"


def content_text(content: str | list[ContentPart] | None) -> str:
    """Text of a message's content; list parts are joined by a blank line (as V4.1's
    encoder), an image part standing as one placeholder at its place."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n\n".join(IMAGE_PLACEHOLDER if part.is_image else part.text or "" for part in content)


def image_parts(content: str | list[ContentPart] | None) -> list[tuple[int, ImageUrl]]:
    """``(part index, image_url)`` of each image part, in order."""
    if not isinstance(content, list):
        return []
    return [(j, p.image_url) for j, p in enumerate(content) if p.is_image and p.image_url]


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _depth(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(value, str):
            try:
                check_arguments_text(value, "arguments")
            except InputProblem as exc:
                # The error's location names this field; a value inside it keeps its path.
                message = exc.problem if exc.where == "arguments" else str(exc)
                raise _format_error(message) from None
        return value


class ToolCall(_Request):
    """A tool call in a past assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message; ``developer`` is read as ``system``."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    prefix: bool = False

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.role == "developer":
            self.role = "system"
        if self.role in ("system", "user", "tool") and self.content is None:
            raise _format_error("a {role} message needs 'content'", role=self.role)
        if self.role == "tool" and not self.tool_call_id:
            raise _format_error("a tool message needs 'tool_call_id'")
        if self.role != "assistant" and (self.tool_calls or self.prefix):
            raise _format_error("only assistant messages carry 'tool_calls' or 'prefix'")
        if self.role not in IMAGE_ROLES and image_parts(self.content):
            raise _format_error(
                "a {role} message cannot hold images; send them in a user message",
                role=self.role,
            )
        return self

    def text(self) -> str:
        return content_text(self.content)


class FunctionDefinition(_Request):
    # OpenAI's name rule plus '.' and ':' for namespaced tools; a quote would break DSML.
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema_for_prompt(self) -> dict[str, Any]:
        """The function object as listed in the prompt's tool block."""
        return self.model_dump(exclude_none=True)


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _format_error("type 'json_schema' needs a 'json_schema' object")
        return self


class Thinking(_Request):
    type: Literal["enabled", "disabled"]


class StreamOptions(_Request):
    include_usage: bool = False


def reasoning_budget(effort: str | int | None) -> int:
    """The numeric V4.1 reasoning budget (1-100) of a ``reasoning_effort`` value."""
    if effort is None or effort == "none":
        return DEFAULT_REASONING_EFFORT
    if isinstance(effort, str):
        return REASONING_EFFORT_ALIASES[effort]
    return effort


# ---------------------------------------------------------------- requests


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    @model_validator(mode="before")
    @classmethod
    def _raw_body(cls, data: Any) -> Any:
        check_body(data)  # a 400 naming the field, before any field is read
        return data

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch can seed
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    user_id: str | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise _parameter_error("at most {m} stop sequences", m=MAX_STOP)
        if any(s == "" for s in stops):
            raise _parameter_error("stop sequences must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise _parameter_error("keys are token ids; got '{k}'", k=key[:32])
            # Past Python's int-string limit int() raises; no vocabulary is that large.
            if len(key) > MAX_TOKEN_ID_DIGITS:
                raise _parameter_error(
                    "keys are token ids of at most {d} digits; got {n} digits",
                    d=MAX_TOKEN_ID_DIGITS,
                    n=len(key),
                )
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise _parameter_error("biases lie in [-100, 100]; got {b}", b=bias)
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise _parameter_error("stream_options is only allowed when stream is true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def cache_salt(self) -> str | None:
        """The prefix-cache tenant: ``user_id``, else OpenAI's ``user``."""
        return self.user_id or self.user

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` (and ``/beta/chat/completions``)."""

    messages: list[ChatMessage]
    thinking: Thinking | None = None
    reasoning_effort: str | int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: score every prompt token (with the top k); in the non-streamed response.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise _format_error("messages must not be empty")
        for i, message in enumerate(value):
            if message.prefix and (i != len(value) - 1 or message.role != "assistant"):
                raise _format_error("only the last message, an assistant one, may set prefix")
            if message.prefix and message.tool_calls:
                raise _format_error("a prefix message cannot carry tool_calls")
        return value

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _effort(cls, value: Any) -> Any:
        # Checked by hand: pydantic's lax int would accept True and "7".
        # isinstance first: a list or dict is not hashable (a 500 from the `in` test).
        if value is None or (
            isinstance(value, str) and (value == "none" or value in REASONING_EFFORT_ALIASES)
        ):
            return value
        if type(value) is int and 1 <= value <= 100:
            return value
        names = ", ".join(["none", *REASONING_EFFORT_ALIASES])
        raise _parameter_error("must be one of {names} or an integer in [1, 100]", names=names)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise _format_error("function names must be unique")
        # Schemas the DSML call format cannot carry: a 400 naming the property
        # (server/chat/tool_schemas.py says why refuse rather than escape).
        check_tool_schemas([t.function.parameters for t in value or []])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if value not in (None, "none", "auto") and not names:
            raise _parameter_error("needs tools (without tools only 'none' or 'auto' is allowed)")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise _parameter_error("names an unknown function '{n}'", n=value.function.name)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise _parameter_error("top_logprobs requires logprobs to be true")
        return value

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def prefix_completion(self) -> bool:
        return self.messages[-1].prefix


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` and FIM at ``/beta/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: score every prompt token (with the top k) under the model's raw distribution.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise _format_error("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise _format_error("a token-id prompt must not be empty")
        if isinstance(value, list) and any(isinstance(t, int) and t < 0 for t in value):
            raise _parameter_error("token ids are >= 0")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise _parameter_error("best_of is not supported (it may only equal n)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def resolve_max_tokens(
    requested: int | None,
    prompt_tokens: int,
    max_model_len: int,
    *,
    default: int | None = None,
    prompt_param: str = "messages",
) -> int:
    """The output budget of ``output_budget`` (engine/api/request_limits.py): a
    ``requested`` beyond the room the prompt leaves is clamped to it, and the choice
    finishes with "length" there. Only a prompt that fills the context is refused,
    with OpenAI's 400 wording. Without ``requested`` it is the room, capped at
    ``default``."""
    try:
        return output_budget(requested, prompt_tokens, max_model_len, default)
    except RequestError:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_param} resulted in {prompt_tokens} tokens. Please reduce the length of "
            f"the {prompt_param}.",
            param=prompt_param,
        ) from None


# ---------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    reasoning_content: list[TokenLogprob] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):  # no return annotation: keeps the field schema in OpenAPI
        return _drop_none(handler(self), ("reasoning_content",))


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler(self), ("reasoning_content", "tool_calls"))


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageCost(BaseModel):
    """What the request cost at the server's price table (``--prices``/``--price-file``)."""

    currency: str
    cache_hit_input: float
    cache_miss_input: float
    output: float
    total: float
    off_peak: bool  # priced at the off-peak rates (arrival time, UTC)


class Usage(BaseModel):
    """Token counts; every field is always present (DeepSeek's and OpenAI's names).
    ``cost`` only when the server has prices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    cost: UsageCost | None = Field(default=None, exclude_if=lambda v: v is None)

    @classmethod
    def build(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> Usage:
        assert 0 <= cached_tokens <= prompt_tokens and 0 <= reasoning_tokens <= completion_tokens
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_cache_hit_tokens=cached_tokens,
            prompt_cache_miss_tokens=prompt_tokens - cached_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
        )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's field


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler(self), ("name", "arguments"))


class DeltaToolCall(BaseModel):
    """First delta of a call: index, id, type, name, ``arguments: ""``; later: index + arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler(self), ("id", "type", "function"))


class ChatDelta(BaseModel):
    """A streamed message piece; absent fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler(self), ("role", "content", "reasoning_content", "tool_calls"))


class ChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event; with ``include_usage`` every chunk carries ``usage`` (null but the last).
    ``prompt_logprobs`` (as ``ChatCompletion``'s) is in the first chunk only, absent elsewhere."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _ser(self, handler):
        return _drop_none(handler(self), ("prompt_logprobs",))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one candidate token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # With ``prompt_logprobs``: per prompt token, None for the first, else the token
    # and its best alternatives by token id (vLLM's shape).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "deepseek"
    # vLLM's field: prompt plus output tokens one request may hold, so a client can size
    # its prompts and its compaction. None where no engine is known (a router).
    max_model_len: int | None = None
    # What a request may hold: ["text", "image"] for a model with a vision tower, else
    # ["text"] (the playground reads it). None where no engine is known (a router).
    input_modalities: list[Literal["text", "image"]] | None = None


def input_modalities(takes_images: bool) -> list[Literal["text", "image"]]:
    return ["text", "image"] if takes_images else ["text"]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``; built by ``server.http.errors``."""

    error: ErrorInfo
