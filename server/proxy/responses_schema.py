"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), validated, and its input
items as the chat template's messages.

``input`` is a string (one user message) or a list of items: messages (``input_text`` /
``output_text`` / ``refusal`` parts, or a string), ``function_call`` and ``function_call_output``
items, and ``reasoning`` items sent back by the client. Anything that would change what is
sampled in a way training cannot account for (forced tool calls, structured output, top_p < 1)
or that proxrl cannot honour (images, files, hosted tools, stored prompts, conversations,
background mode) is refused with a 400 that names it. Fields that do not touch sampling
(``include``, ``truncation``, ``user``, ``reasoning``'s effort, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from server.errors import InvalidRequest
from server.proxy.schemas import MAX_ITEMS, Label, ModelName, Text, TokenLimit

MetadataValue = Annotated[str, StringConstraints(max_length=512)]
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Part(_Lenient):
    """A content part: text in one of its spellings, a refusal, or something refused by type."""

    type: Label
    text: Text | None = None
    refusal: Text | None = None

    def as_text(self, where: str) -> str:
        if self.type == "refusal":
            return self.refusal or ""
        if self.type not in TEXT_PARTS or self.text is None:
            raise InvalidRequest(
                f"Content parts of type {self.type!r} are not supported: proxrl serves a text "
                "model; send input_text parts.",
                param=where,
            )
        return self.text


Parts = Annotated[list[Part], Field(max_length=MAX_ITEMS)]


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.as_text(where) for part in content)


class Item(_Lenient):
    """One input item; which fields it needs depends on its ``type`` (a message when absent)."""

    type: Label = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Text | Parts | None = None
    id: Label | None = None
    call_id: Label | None = None
    name: Label | None = None
    arguments: Text | None = None
    output: Text | Parts | None = None
    summary: Parts | None = None


class FunctionTool(_Lenient):
    type: Label
    name: Label | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseRequest(_Lenient):
    model: ModelName
    input: Text | Annotated[list[Item], Field(max_length=MAX_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_ITEMS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_output_tokens: TokenLimit | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    store: bool | None = None
    previous_response_id: Label | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    conversation: Label | dict[str, Any] | None = None
    background: bool | None = None

    @property
    def seed(self) -> None:
        """What ``plan.sampling_request`` reads of a body; the Responses API has no seed."""
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        """...nor stop strings."""
        return ()

    def refuse_unsupported(self) -> None:
        refusals = [
            (
                "top_p",
                self.top_p is not None and self.top_p < 1,
                "top_p < 1 truncates the sampling distribution, so the recorded logprobs would "
                "not be the policy's",
            ),
            (
                "tool_choice",
                self.tool_choice not in (None, "auto", "none"),
                "tool_choice 'required' or a named tool needs constrained decoding; use 'auto' "
                "or 'none'",
            ),
            (
                "text",
                self._structured(),
                "structured output (text.format other than text) needs constrained decoding",
            ),
            ("prompt", self.prompt is not None, "stored prompts are not supported; send input"),
            (
                "conversation",
                self.conversation is not None,
                "conversations are not supported; chain responses with previous_response_id",
            ),
            ("background", bool(self.background), "background mode is not supported"),
        ]
        for param, refused, why in refusals:
            if refused:
                raise InvalidRequest(f"{why}.", param=param)
        for index, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise InvalidRequest(
                    f"Tools of type {tool.type!r} are not supported: proxrl serves function "
                    "tools only.",
                    param=f"tools.{index}.type",
                )
            if not tool.name:
                raise InvalidRequest("A function tool needs a name.", f"tools.{index}.name")

    def _structured(self) -> bool:
        form = (self.text or {}).get("format")
        return isinstance(form, dict) and form.get("type", "text") != "text"

    def items(self) -> list[dict[str, Any]]:
        """The input as a list of items, as received (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True) for item in self.input]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat template's (Chat Completions') form."""
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": tool.model_dump(
                    include={"name", "description", "parameters"}, exclude_none=True
                ),
            }
            for tool in self.tools
        ]


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (as stored or received) as the chat template's messages: a function
    call joins the assistant message before it (one response's text and calls are one
    assistant turn), a call's output is a tool message, and a reasoning item's text becomes
    the next assistant message's ``reasoning_content`` (templates that know it render it)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, raw in enumerate(items):
        item = Item.model_validate(raw)
        where = f"input.{index}"
        kind = item.type
        if kind == "message":
            messages.append(_message(item, where, reasoning))
        elif kind == "function_call":
            _add_call(messages, item, where, reasoning)
        elif kind == "function_call_output":
            if item.call_id is None:
                raise InvalidRequest("A function_call_output needs call_id.", f"{where}.call_id")
            output = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif kind == "reasoning":
            # Its full text where the client sent it back, else its summary.
            parts = item.content if isinstance(item.content, list) and item.content else None
            reasoning += [p.as_text(where) for p in parts or item.summary or []]
        else:
            raise InvalidRequest(
                f"Input items of type {kind!r} are not supported: send messages, function_call, "
                "function_call_output and reasoning items.",
                param=f"{where}.type",
            )
    return messages


def _message(item: Item, where: str, reasoning: list[str]) -> dict[str, Any]:
    if item.role is None:
        raise InvalidRequest("A message item needs a role.", param=f"{where}.role")
    role = "system" if item.role == "developer" else item.role
    message: dict[str, Any] = {"role": role, "content": _text(item.content, f"{where}.content")}
    if role == "assistant" and reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    return message


def _add_call(messages: list[dict[str, Any]], item: Item, where: str, reasoning: list[str]) -> None:
    if item.call_id is None or item.name is None or item.arguments is None:
        raise InvalidRequest("A function_call item needs call_id, name and arguments.", param=where)
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)
