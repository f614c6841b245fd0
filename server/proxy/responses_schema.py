"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), validated, and its input
items as the chat template's messages.

``input`` is a string (one user message) or a list of items: messages (``input_text`` /
``output_text`` / ``refusal`` parts, or a string), ``function_call`` / ``custom_tool_call``
items and their ``..._output`` items, and ``reasoning`` items sent back by the client.
Anything that would change what is sampled in a way training cannot account for (top_p < 1)
or that proxrl cannot honour (images, files, stored prompts, conversations, background mode) is
refused with a 400 that names it; a forced tool call (``tool_choice``) starts in the prompt
(``forced_calls``), structured output follows the run's ``response_format``. Fields that do
not touch sampling (``include``, ``truncation``, ``user``, ``reasoning``'s effort,
``prompt_cache_key``, ...) are accepted and ignored.

Tools: ``function`` tools; ``custom`` tools (free-form input), offered to the chat template as a
function with one string argument ``input`` whose description carries the tool's grammar, so
the model calls one as ``{"name": ..., "arguments": {"input": "<raw text>"}}`` and the
tool-call parser reads it back (``tool_calls.ToolNames``); ``namespace`` tools, flattened into
the function and custom tools they hold (names must stay unique). Every other type is a tool
OpenAI runs on its side (``web_search``, ``tool_search``, ``file_search``, ...): the engine
cannot run it, and the run's ``hosted_tools`` policy leaves it out of the prompt or refuses
the request (``hosted_tools``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from server.errors import InvalidRequest
from server.proxy import forced_calls
from server.proxy.schemas import MAX_ITEMS, Label, ModelName, Text, TokenLimit
from server.proxy.tool_calls import FREE_FORM_ARGUMENT, ToolNames, free_form_arguments

MetadataValue = Annotated[str, StringConstraints(max_length=512)]
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MODEL_TOOLS = ("function", "custom")  # tools the model calls itself; "namespace" groups them


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
    input: Text | None = None  # a custom_tool_call's raw text
    namespace: Label | None = None
    output: Text | Parts | None = None
    summary: Parts | None = None


class FunctionTool(_Lenient):
    """A tool of any type: ``function``, ``custom`` (``format``: its grammar), ``namespace``
    (``tools``: the tools it groups) or a hosted one (its own fields, kept as sent)."""

    type: Label
    name: Label | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_ITEMS)] | None = None

    def template_tool(self) -> dict[str, Any]:
        """A function or custom tool in the chat template's (Chat Completions') form."""
        if self.type == "function":
            function = self.model_dump(
                include={"name", "description", "parameters"}, exclude_none=True
            )
            return {"type": "function", "function": function}
        argument = {"type": "string", "description": _free_form_description(self.format)}
        parameters = {
            "type": "object",
            "properties": {FREE_FORM_ARGUMENT: argument},
            "required": [FREE_FORM_ARGUMENT],
            "additionalProperties": False,
        }
        function = {
            "name": self.name,
            "description": self.description or "",
            "parameters": parameters,
        }
        return {"type": "function", "function": function}


def _free_form_description(form: dict[str, Any] | None) -> str:
    """What a custom tool's ``input`` argument says of its text: free-form, or its grammar."""
    if not form or form.get("type", "text") == "text":
        return "The raw text of the call (free-form)."
    syntax, definition = form.get("syntax", "lark"), form.get("definition", "")
    return f"The raw text of the call, following this {syntax} grammar:\n{definition}"


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
        self._model_tools()  # names checked

    def hosted_tools(self) -> list[tuple[str, str]]:
        """The tools OpenAI would run on its side (every type but function, custom and
        namespace), as (param, type): proxrl's engine cannot run them."""
        return [
            (f"tools.{index}.type", tool.type)
            for index, tool in enumerate(self.tools or [])
            if tool.type not in (*MODEL_TOOLS, "namespace")
        ]

    def _model_tools(self) -> list[tuple[str | None, FunctionTool]]:
        """The function and custom tools, namespaces' flattened, each with its namespace;
        refused (400) when one has no name, a namespace holds another kind of tool, or two
        share a name (the model calls a tool by its name alone)."""
        tools: list[tuple[str | None, FunctionTool]] = []
        seen: set[str] = set()
        for index, tool in enumerate(self.tools or []):
            where = f"tools.{index}"
            if tool.type == "namespace":
                if not tool.name:
                    raise InvalidRequest("A namespace tool needs a name.", f"{where}.name")
                inner = [(f"{where}.tools.{i}", t) for i, t in enumerate(tool.tools or [])]
                namespace: str | None = tool.name
            else:
                inner, namespace = [(where, tool)], None
            for place, member in inner:
                if member.type not in MODEL_TOOLS:
                    if namespace is None:
                        continue  # hosted
                    raise InvalidRequest(
                        f"A namespace holds function and custom tools, not {member.type!r}.",
                        f"{place}.type",
                    )
                if not member.name:
                    raise InvalidRequest(f"A {member.type} tool needs a name.", f"{place}.name")
                if member.name in seen:
                    raise InvalidRequest(
                        f"Two tools are named {member.name!r}: the model calls a tool by its "
                        "name, so names must be unique (namespaces included).",
                        f"{place}.name",
                    )
                seen.add(member.name)
                tools.append((namespace, member))
        return tools

    def forced_tool(self) -> tuple[str | None, str] | None:
        """What ``tool_choice`` forces: None when nothing (unset, ``auto``, ``none``); else the
        named function or custom tool (None: any of the tools) and how the request said it."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        tools = {name: kind for name, (kind, _) in self.tool_kinds().items()}
        if isinstance(choice, str):  # "required"
            return forced_calls.forced_tool(tools, choice), choice
        kind = choice.get("type")
        if kind not in ("function", "custom"):
            raise InvalidRequest(
                f"tool_choice of type {kind!r} is not supported: send 'auto', 'none', 'required' "
                'or {"type": "function" or "custom", "name": ...}.',
                param="tool_choice",
            )
        return forced_calls.forced_tool(tools, kind, choice.get("name")), kind

    @property
    def format_type(self) -> Any:
        """``text.format``'s type (``text`` when unset); a ``json_schema`` one needs its name
        and schema (the Response echoes the format)."""
        form = (self.text or {}).get("format") or {}
        if not isinstance(form, dict):
            raise InvalidRequest("text.format must be an object.", param="text.format")
        kind = form.get("type", "text")
        named = isinstance(form.get("name"), str) and isinstance(form.get("schema"), dict)
        if kind == "json_schema" and not named:
            raise InvalidRequest(
                "text.format json_schema needs a name and a schema.", param="text.format"
            )
        return kind

    def items(self) -> list[dict[str, Any]]:
        """The input as a list of items, as received (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True) for item in self.input]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The function and custom tools in the chat template's (Chat Completions') form;
        hosted tools left out. None when there are none."""
        tools = [tool.template_tool() for _, tool in self._model_tools()]
        return tools or None

    def tool_names(self) -> ToolNames:
        """The names the model may call, the custom tools' free-form."""
        tools = [tool for _, tool in self._model_tools()]
        custom = [tool.name for tool in tools if tool.type == "custom" and tool.name]
        return ToolNames((tool.name for tool in tools if tool.name), free_form=custom)

    def tool_kinds(self) -> dict[str, tuple[str, str | None]]:
        """Each callable tool's type (function or custom) and namespace, by name: what an
        output item of a call to it looks like."""
        return {t.name: (t.type, ns) for ns, t in self._model_tools() if t.name}


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
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, item, where, reasoning)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item.call_id is None:
                raise InvalidRequest(f"A {kind} needs call_id.", f"{where}.call_id")
            output = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif kind == "reasoning":
            # Its full text where the client sent it back, else its summary.
            parts = item.content if isinstance(item.content, list) and item.content else None
            reasoning += [p.as_text(where) for p in parts or item.summary or []]
        else:
            raise InvalidRequest(
                f"Input items of type {kind!r} are not supported: send messages, function_call, "
                "custom_tool_call, their outputs, and reasoning items.",
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
    """A call joins the assistant message before it; a custom tool's raw text is rendered as
    the one argument the model passes it (``FunctionTool.template_tool``)."""
    custom = item.type == "custom_tool_call"
    if custom:
        arguments = None if item.input is None else free_form_arguments(item.input)
    else:
        arguments = item.arguments
    if item.call_id is None or item.name is None or arguments is None:
        needs = "input" if custom else "arguments"
        raise InvalidRequest(f"A {item.type} item needs call_id, name and {needs}.", param=where)
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)
