"""Request, response and stream-event bodies of the Anthropic Messages API (pydantic v2).

Requests ignore unknown fields, as DeepSeek's Anthropic API does (``container``,
``mcp_servers``, ``service_tier``, ``cache_control`` on any block, ...): agents
send what the real API takes, and refusing it would break them. Content blocks
are read by their ``type``; an unknown block type is a 400 naming it. ``image``
blocks (base64 or URL sources) are served in user messages; documents are not.

Every range check that differs from the chat path's (``max_tokens`` required,
tool names) is made here; the rest is checked once, by the internal chat
request ``translate`` builds, so both front ends refuse the same values.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.chat.tool_schemas import check_tool_schemas
from server.http.input_checks import check_body

INPUT_SCHEMA_FIELD = "tools[{i}].input_schema"
# Anthropic's block types for media other than images: not served.
MEDIA_BLOCK_TYPES = frozenset({"document", "search_result"})

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Request(BaseModel):
    # strict, as the chat path: no "2" for 2. Unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


def _format_error(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("invalid_format", message, ctx or None)


# ---------------------------------------------------------------- content blocks


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class Base64Source(_Request):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Request):
    type: Literal["url"]
    url: str


class ImageBlock(_Request):
    """An image, inline (base64) or by URL; the chat path decodes or fetches it."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]

    def url(self) -> str:
        """The source as the chat path's ``image_url`` takes it (a data URL for base64)."""
        if isinstance(self.source, UrlSource):
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


class ToolUseBlock(_Request):
    """A past call of the assistant; ``input`` is its arguments object."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    """A tool's answer, in a user message; ``content`` a string or text and image
    blocks (a screenshot tool's answer, say), in order."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool = False

    @model_validator(mode="before")
    @classmethod
    def _media(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        # Only a list holds blocks; any other value is the field validation's to refuse.
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") in MEDIA_BLOCK_TYPES:
                raise PydanticCustomError(
                    "not_served",
                    "'{kind}' blocks inside a tool_result are not served; text and image "
                    "blocks are",
                    {"kind": block["type"]},
                )
        return data

    def text(self) -> str:
        """The text blocks alone (an image is the chat path's part, not text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(b, ImageBlock) for b in self.content
        )


class ThinkingBlock(_Request):
    """Past reasoning; its ``signature`` is accepted and not checked (nothing here signs)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    """Reasoning another server encrypted: nothing here can read it, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str = ""


def _block_type(value: Any) -> str | None:
    """The union tag of a block (``Message`` has refused unknown types already)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _BLOCK_TAGS else None


_BLOCK_TAGS = frozenset(
    {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}
)

ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class Message(_Request):
    # ``system`` is not in Anthropic's reference, but Claude Code sends one inside
    # ``messages`` (a reminder after the first user turn): it is read as a system
    # message in its place rather than refused, so the session needs no retry.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _served_blocks(cls, data: Any) -> Any:
        """Media and unknown block types: a 400 that says which, before the union
        reports that no member matched."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for j, block in enumerate(blocks if isinstance(blocks, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in MEDIA_BLOCK_TYPES:
                raise PydanticCustomError(
                    "not_served", "content[{j}]: '{t}' blocks are not served", {"j": j, "t": kind}
                )
            if kind not in _BLOCK_TAGS:
                raise _format_error(
                    "content[{j}]: unsupported content block type '{t}'; served: {served}",
                    j=j,
                    t=str(kind)[:40],
                    served=", ".join(sorted(_BLOCK_TAGS)),
                )
        return data

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        if isinstance(self.content, str):
            return self
        allowed = {
            "user": {"text", "image", "tool_result"},
            "system": {"text"},
            "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
        }[self.role]
        for block in self.content:
            if block.type not in allowed:
                raise _format_error(
                    "a {role} message cannot hold a '{t}' block", role=self.role, t=block.type
                )
        return self


# ---------------------------------------------------------------- tools, thinking


class ToolDefinition(_Request):
    """A client tool. Server tools (``web_search_...``, ``bash_...``) have a ``type`` of
    their own and are refused: nothing here runs them."""

    type: Literal["custom"] | None = None
    # Anthropic's name rule; the chat path's allows a superset.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise _format_error(
                "server tool '{t}' is not supported; only client tools (name, description, "
                "input_schema) are served",
                t=str(kind)[:40],
            )
        return data


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise _format_error("tool_choice of type 'tool' needs a 'name'")
        return self


class ThinkingConfig(_Request):
    """``enabled`` (``budget_tokens`` is accepted and ignored, as DeepSeek's API does:
    V4.1 has no token budget for its reasoning) or ``disabled``. ``adaptive`` (the
    model decides) is read as enabled."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class Metadata(_Request):
    user_id: str | None = None


# ---------------------------------------------------------------- requests


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: what the prompt of a ``MessagesRequest`` is."""

    @model_validator(mode="before")
    @classmethod
    def _raw_body(cls, data: Any) -> Any:
        check_body(data)  # unencodable text or deep nesting: a 400 before anything reads it
        return data

    model: str
    system: str | list[TextBlock] | None = None
    messages: list[Message]
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[Message]) -> list[Message]:
        if not value:
            raise _format_error("must not be empty")
        return value

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise _format_error("tool names must be unique")
        check_tool_schemas([t.input_schema for t in self.tools or []], INPUT_SCHEMA_FIELD)
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise _format_error("tool_choice names an unknown tool '{n}'", n=str(choice.name))
        return self

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n\n".join(b.text for b in self.system)

    @property
    def thinking_on(self) -> bool:
        """Anthropic's default: no ``thinking`` field, no thinking."""
        return self.thinking is not None and self.thinking.type != "disabled"


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (and ``/anthropic/v1/messages``)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    @property
    def user_id(self) -> str | None:
        return self.metadata.user_id if self.metadata else None


# ---------------------------------------------------------------- responses


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = ThinkingOut | TextOut | ToolUseOut


class MessageUsage(BaseModel):
    """``input_tokens`` excludes the prompt tokens read from the prefix cache, as on
    Anthropic's API (there the three input fields add up to the whole prompt);
    nothing is written to a cache on request, so ``cache_creation_input_tokens`` is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicModel(BaseModel):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    # Not Anthropic's: the same field as /v1/models, so a client sees image support here too.
    input_modalities: list[Literal["text", "image"]] | None = None


class AnthropicModelList(BaseModel):
    data: list[AnthropicModel]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """``{"type": "error", "error": {"type", "message"}}``; built by ``errors.py``."""

    type: Literal["error"] = "error"
    error: ErrorDetail
