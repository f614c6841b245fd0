"""Request bodies of the OpenAI-compatible API, validated; responses are built as plain dicts.

Fields OpenAI defines that would change what is sampled in a way the trainer cannot account
for (penalties, logit bias, top_p < 1) are refused with a 400 that names them; fields that do
not touch sampling (user, metadata, store, ...) are accepted and ignored. Unknown fields are
ignored, as many agent frameworks send extras. A forced tool call (``tool_choice`` "required"
or a named function) is honoured by starting the call in the prompt (``forced_calls``);
structured output (``response_format``) as the run's policy says (``plan.structured_output``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from server.bounds import MAX_INT, Count, NoNul
from server.errors import InvalidRequest
from server.proxy import forced_calls
from server.store.run_config import MODEL_NAME_LENGTH

MAX_N = 16
MAX_STOP = 16
# Bounds no agent reaches (content of a few MB, tens of thousands of messages), checked before
# anything is tokenized or reaches an engine.
MAX_TEXT = 8_000_000
MAX_ITEMS = 100_000
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Label = Annotated[str, StringConstraints(max_length=1000), NoNul]
# What a turn records of it (turns.model): a longer name is a 400, never a failed write.
ModelName = Annotated[str, StringConstraints(max_length=MODEL_NAME_LENGTH), NoNul]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
TokenLimit = Annotated[int, Field(ge=1, le=MAX_INT)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: Text


class FunctionCall(_Lenient):
    name: Label
    arguments: Text | dict[str, Any]


class ToolCallIn(_Lenient):
    id: Label | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_ITEMS)] | None = None
    name: Label | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_ITEMS)] | None = None
    tool_call_id: Label | None = None
    # An assistant message's reasoning, sent back as served: the template decides whether to
    # render it (reasoning templates keep it only after the last user message).
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it ("developer" is a system message)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        else:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionDef(_Lenient):
    name: Label
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    """What chat and text completions share."""

    model: ModelName
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[Label, float] | None = Field(None, max_length=MAX_ITEMS)

    def refuse_untrainable(self) -> None:
        if self.top_p is not None and self.top_p < 1:
            raise InvalidRequest(
                "top_p < 1 truncates the sampling distribution, so the logprobs proxrl records "
                "would not be the behaviour policy's; leave top_p unset or 1.",
                param="top_p",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(
                    f"{name} changes the sampling distribution, which training could not "
                    "account for; leave it unset or 0.",
                    param=name,
                )
        if self.logit_bias:
            raise InvalidRequest(
                "logit_bias is not supported: it would bias what is trained.", "logit_bias"
            )

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings (the schema holds them to MAX_STOP non-empty ones)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_ITEMS)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_tokens: TokenLimit | None = None
    max_completion_tokens: TokenLimit | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def refuse_untrainable(self) -> None:
        super().refuse_untrainable()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true.", param="top_logprobs")

    def forced_tool(self) -> tuple[str | None, str] | None:
        """What ``tool_choice`` forces: None when nothing (unset, ``auto``, ``none``); else the
        named function (None: any of the tools) and how the request said it."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        tools = {tool.function.name: "function" for tool in self.tools or []}
        if isinstance(choice, str):  # "required"
            return forced_calls.forced_tool(tools, choice), choice
        name = forced_calls.forced_tool(tools, "function", _function_name(choice))
        return name, "function"

    @property
    def format_type(self) -> Any:
        """``response_format``'s type (``text`` when unset); a ``json_schema`` one needs its
        ``json_schema`` object."""
        form = self.response_format or {}
        kind = form.get("type", "text")
        if kind == "json_schema" and not isinstance(form.get("json_schema"), dict):
            raise InvalidRequest(
                "response_format json_schema needs a json_schema object (name, schema).",
                param="response_format.json_schema",
            )
        return kind

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over the deprecated
        ``max_tokens`` when a request gives both."""
        return self.max_completion_tokens or self.max_tokens


def _function_name(choice: dict[str, Any]) -> Any:
    """The name a tool_choice object names: ``{"type": "function", "function": {"name": ...}}``;
    other kinds (``allowed_tools``, ``custom``) are refused by name."""
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise InvalidRequest(
            f"tool_choice of type {choice.get('type')!r} is not supported: send 'auto', 'none', "
            '\'required\' or {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    return function.get("name")


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_ITEMS)]
        | Annotated[list[Count], Field(max_length=MAX_ITEMS)]
        | Annotated[
            list[Annotated[list[Count], Field(max_length=MAX_ITEMS)]], Field(max_length=MAX_ITEMS)
        ]
    )
    max_tokens: TokenLimit | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def refuse_untrainable(self) -> None:
        super().refuse_untrainable()
        if self.suffix:
            raise InvalidRequest("suffix (insertion) is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported; use n.", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs (prompt logprobs) is not supported.", "echo")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt is empty.", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
