"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and its ``count_tokens``),
validated; answers are built as plain dicts by ``server.proxy.anthropic``.

Content blocks proxrl can put in a text model's prompt are ``text``, ``tool_use``,
``tool_result`` (its content: ``text`` and ``tool_reference`` blocks) and (sent back by the
client) ``thinking``; any other block (``image``, ``document``, ``search_result``, server tools'
blocks...) validates as an ``OtherBlock`` so that the refusal can name it. Messages have the
roles ``user``, ``assistant`` and ``system`` (a system message among the messages, as Claude
Code sends its environment: text only). Sampling fields that would change what is sampled in
a way the trainer cannot account for (``top_p`` < 1, ``top_k``) are refused; ``metadata``,
``thinking``, ``service_tier`` and unknown fields are accepted and ignored.

Errors on these routes have Anthropic's shape (``ERROR_SHAPE``, which ``server.main`` gives
``server.errors.install``): the status of the error table, Anthropic's name for its type.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from server.errors import TYPE_OF_STATUS, ErrorShape, InvalidRequest
from server.proxy import forced_calls
from server.proxy.schemas import MAX_ITEMS, MAX_STOP, Label, ModelName, StopString, Text, TokenLimit


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: Text


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: Label
    name: Label
    input: dict[str, Any]


class OtherBlock(_Lenient):
    """A block of a type proxrl does not take: refused by name when the prompt is built."""

    type: Label


class ToolReferenceBlock(_Lenient):
    """A tool search's result (Claude Code's ``ToolSearch``): the named tool, sent with
    ``defer_loading``, is loaded from here on."""

    type: Literal["tool_reference"]
    tool_name: Label


def _result_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if kind in ("text", "tool_reference") else "other"


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolReferenceBlock, Tag("tool_reference")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_result_kind),
]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: Label
    content: Text | Annotated[list[ResultBlock], Field(max_length=MAX_ITEMS)] = ""
    is_error: bool | None = None


_KNOWN = {"text", "thinking", "tool_use", "tool_result"}


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if isinstance(kind, str) and kind in _KNOWN else "other"


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]
Blocks = Annotated[list[Block], Field(max_length=MAX_ITEMS)]


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: Text | Blocks


class Tool(_Lenient):
    """A client tool (``type`` absent or ``custom``); Anthropic's server tools are refused.
    ``defer_loading``: the tool is not in the prompt until a ``tool_reference`` names it."""

    name: Label
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: Label | None = None
    defer_loading: bool | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "none", "tool"]
    name: Label | None = None
    disable_parallel_tool_use: bool | None = None


class Conversation(_Lenient):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    model: ModelName
    messages: list[Message] = Field(min_length=1, max_length=MAX_ITEMS)
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_ITEMS)] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_ITEMS)
    tool_choice: ToolChoice | None = None

    def refuse_unsupported(self) -> None:
        for index, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise InvalidRequest(
                    f"Tool {tool.name!r} is of type {tool.type!r}, one of Anthropic's server "
                    "tools, which proxrl does not run; give client tools (name, input_schema).",
                    param=f"tools.{index}",
                )
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return
        shown = self.shown_tools()
        hidden = [tool.name for tool in self.tools or [] if tool.name not in shown]
        if choice.name in hidden or (choice.type == "any" and hidden and not shown):
            which = f"the tool {choice.name!r}" if choice.type == "tool" else "only tools"
            raise InvalidRequest(
                f"tool_choice {choice.type!r} would force a call to {which} sent with "
                "defer_loading that no tool_reference in the conversation has loaded: the "
                "model was never shown it. Force a loaded tool, or use 'auto'.",
                param="tool_choice",
            )
        forced_calls.forced_tool(dict.fromkeys(shown, "tool"), choice.type, choice.name)

    def shown_tools(self) -> list[str]:
        """The names of the tools the prompt shows: those sent without ``defer_loading``, and
        the deferred ones a ``tool_reference`` in a tool result loaded (their definition is
        rendered there)."""
        loaded = {
            part.tool_name
            for message in self.messages
            if not isinstance(message.content, str)
            for block in message.content
            if isinstance(block, ToolResultBlock) and not isinstance(block.content, str)
            for part in block.content
            if isinstance(part, ToolReferenceBlock)
        }
        return [t.name for t in self.tools or [] if not t.defer_loading or t.name in loaded]

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and not (self.tool_choice and self.tool_choice.type == "none")


class MessagesRequest(Conversation):
    max_tokens: TokenLimit
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_p is not None and self.top_p < 1:
            raise InvalidRequest(
                "top_p < 1 truncates the sampling distribution, so the logprobs proxrl records "
                "would not be the behaviour policy's; leave top_p unset or 1.",
                param="top_p",
            )
        if self.top_k:
            raise InvalidRequest(
                "top_k truncates the sampling distribution, so the logprobs proxrl records "
                "would not be the behaviour policy's; leave top_k unset.",
                param="top_k",
            )

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    @property
    def seed(self) -> None:  # Anthropic has no seed
        return None


class CountTokensRequest(Conversation):
    pass


# ----- errors in Anthropic's shape ---------------------------------------------------------------

# Anthropic's name for each error type of ours that its API lacks (the others it shares).
_ANTHROPIC_TYPES = {
    "conflict_error": "invalid_request_error",
    "gone_error": "not_found_error",
    "server_error": "api_error",
    "engine_error": "api_error",
    "service_unavailable": "overloaded_error",
}
_PATH = re.compile(r"^(/sessions/[^/]+)?/v1/messages(/|$)")


def anthropic_type(status: int) -> str:
    kind = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return _ANTHROPIC_TYPES.get(kind, kind)


def anthropic_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """Anthropic's shape has no ``param``: the message names it, where it does not already."""
    if param and param not in message:
        message = f"{message} (at {param})"
    return {"type": "error", "error": {"type": anthropic_type(status), "message": message}}


def is_anthropic_path(path: str) -> bool:
    """``/v1/messages...`` and ``/sessions/{id}/v1/messages...``."""
    return _PATH.match(path) is not None


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type, e.g. invalid_request_error.")
    message: str = Field(description="What went wrong, and what to change.")


class AnthropicErrorBody(BaseModel):
    """Every error answer's body on the routes of Anthropic's Messages API."""

    type: Literal["error"]
    error: AnthropicErrorDetail


ERROR_SHAPE = ErrorShape(is_anthropic_path, anthropic_body, AnthropicErrorBody)
