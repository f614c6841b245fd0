"""``/v1/messages`` (Anthropic's Messages API): its conversation into a plan; its message and
event stream.

The request's ``system``, messages and content blocks become the chat template's messages:
``text`` blocks its content, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's
``tool_result`` blocks ``tool`` messages (rendered the way the model was trained to read tool
results), ``thinking`` blocks sent back the assistant's reasoning. A final assistant message is
a prefill: the answer continues its text. Other blocks (images, documents, ...) are refused by
name.

A message of role ``system`` among the messages (Claude Code sends its environment so, after
the first user message) is a system turn where it stands, when the model's chat template
renders a system message there; otherwise (a template that refuses it, or keeps only a leading
system message) its text joins the leading system text (``system``), after it, in order
(``system_in_place``). Tools sent with ``defer_loading`` (Claude Code's tool search) are not in
the prompt's tools: a ``tool_reference`` block in a tool result that names one renders as the
tool's definition there, where the model learns of it, as Anthropic's API expands it; the
prompt's beginning stays the same when a tool is found, so the row goes on.

Sampling, recording and streaming are ``answer``'s; this module says what an Anthropic
message and its events look like: text blocks, ``tool_use`` blocks for the model's
``<tool_call>`` output (malformed tool-call text stays text), stop reasons and usage in
Anthropic's words. A turn records the request's messages as received (``system`` first, as a
message of role ``system``), its tools as received, and the message the client got.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

from server.context import ServerContext
from server.engine_client.client import Piece
from server.errors import InvalidRequest, ProxrlError
from server.proxy import forced_calls, outputs, prompts
from server.proxy.anthropic_schemas import (
    Conversation,
    CountTokensRequest,
    Message,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_body,
)
from server.proxy.generation import Completion
from server.proxy.plan import (
    Plan,
    build_prompt,
    check_model,
    new_plan,
    refuse_oversize,
    rendered,
    run_config,
    sampling_request,
)
from server.proxy.reasoning import reasoning_style, split_reasoning
from server.proxy.recording import Served
from server.proxy.session_cache import SessionState
from server.proxy.tool_calls import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
)
from server.text.tokenization import PromptText, TemplateError, Tokenizer


async def plan_messages(ctx: ServerContext, state: SessionState, body: MessagesRequest) -> Plan:
    config = await run_config(ctx, state)
    version = await check_model(ctx, state, body.model)
    body.refuse_unsupported()
    client = config.client_special_tokens
    prompt = await build_prompt(ctx, state, lambda: prompt_text(ctx, body, client), "messages")
    limit = _token_limit(ctx, len(prompt.ids), body.max_tokens)
    sampling = sampling_request(ctx, prompt.ids, limit, body, 0, config)
    return new_plan(
        "msg",
        prompt,
        sampling,
        1,
        surface="messages",
        model=body.model,
        version=version,
        messages=_as_received(body),
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
        tool_names=_tool_names(body),
        forced=forced_call(ctx.tokenizer, body),
    )


def _token_limit(ctx: ServerContext, prompt_tokens: int, max_tokens: int) -> int:
    """``max_tokens``, or what the context leaves when that is less. Anthropic's clients ask
    for as much as Claude writes (LangChain: 64k and more), which would refuse nearly every
    request to a smaller model; an answer the context cut ends with Anthropic's stop reason
    ``model_context_window_exceeded``. A prompt that leaves no room is still refused."""
    context = ctx.context_length
    if context is None or context - prompt_tokens < 1:
        return max_tokens  # refused by sampling_request, as on every surface
    return min(max_tokens, context - prompt_tokens)


def _tool_names(body: Conversation) -> set[str] | None:
    return {tool.name for tool in body.tools or []} if body.parses_tools else None


def forced_call(tokenizer: Tokenizer, body: Conversation) -> str:
    """How ``tool_choice`` ``any`` or a named tool is honoured: the answer starts inside a tool
    call, its start written into the prompt (``forced_calls``). Empty for ``auto`` and
    ``none``."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return ""
    name = choice.name if choice.type == "tool" else None
    return forced_calls.forced_start(tokenizer, name, choice.type, "tool_choice")


async def count_tokens(ctx: ServerContext, state: SessionState, body: CountTokensRequest) -> dict:
    """The prompt's token count, as ``/v1/messages`` would tokenize it in a fresh session."""
    config = await run_config(ctx, state)
    await check_model(ctx, state, body.model)
    body.refuse_unsupported()

    def count() -> int:
        text = prompt_text(ctx, body, config.client_special_tokens)
        refuse_oversize(ctx, len(text.text), "messages")
        return ctx.tokenizer.count_prompt(text)

    return {"input_tokens": await prompts.off_loop(count)}


def prompt_text(ctx: ServerContext, body: Conversation, client: str = "text") -> PromptText:
    """The prompt: the conversation rendered, then a final assistant message's text or the
    start of a forced tool call; the client's special-token texts kept as text unless
    ``client`` (the run's ``client_special_tokens``) is "parse"."""
    messages, tools, prefill = conversation(body, system_in_place(ctx.tokenizer))
    forced = forced_call(ctx.tokenizer, body)
    if forced and prefill:
        raise InvalidRequest(
            "tool_choice 'any' or a named tool starts the answer with a tool call, so the "
            "answer cannot also continue a final assistant message.",
            param="tool_choice",
        )
    return ctx.tokenizer.client_text(
        rendered(ctx, messages, tools, client, "messages"), prefill + forced, client
    )


def _as_received(body: MessagesRequest) -> list[dict]:
    received = [m.model_dump(mode="json", exclude_unset=True) for m in body.messages]
    if body.system is None:
        return received
    system = body.system if isinstance(body.system, str) else [b.model_dump() for b in body.system]
    return [{"role": "system", "content": system}, *received]


# ----- the conversation, for the chat template -------------------------------------------------


_PROBE_USER, _PROBE_SYSTEM = "proxrl-probe-user", "proxrl-probe-system"


@lru_cache(maxsize=64)
def system_in_place(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a system message that follows a user message, where
    it stands (Hermes/Qwen and Llama 3 templates do; Mistral's and Gemma's refuse it, others
    keep only a leading system message)."""
    probe = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "system", "content": _PROBE_SYSTEM},
        {"role": "user", "content": "?"},
    ]
    try:
        rendered = tokenizer.render(probe, add_generation_prompt=True)
    except TemplateError:
        return False
    return rendered.find(_PROBE_SYSTEM) > rendered.find(_PROBE_USER) >= 0


def conversation(
    body: Conversation, system_in_place: bool = True
) -> tuple[list[dict], list[dict] | None, str]:
    """The chat template's messages and tools, and the prefill: the text of a final assistant
    message, which the answer continues. System messages among the messages stay where they
    are, or with ``system_in_place`` false join the leading system text (module docstring)."""
    tools_by_name = {tool.name: tool for tool in body.tools or []}
    out: list[dict] = []
    for index, message in enumerate(body.messages):
        out += _for_template(message, f"messages.{index}", tools_by_name)
    leading = [] if body.system is None else [_joined(body.system)]
    if not system_in_place:
        leading += [m["content"] for m in out if m["role"] == "system"]
        out = [m for m in out if m["role"] != "system"]
    if any(leading):
        out.insert(0, {"role": "system", "content": "\n\n".join(t for t in leading if t)})
    prefill = ""
    if body.messages[-1].role == "assistant":
        final = out.pop()
        if final.get("tool_calls"):
            raise InvalidRequest(
                "The last message is the assistant's tool_use: send its tool_result blocks in a "
                "user message after it.",
                param="messages",
            )
        prefill = final.get("content") or ""
    listed = [_tool(tool) for tool in body.tools or [] if not tool.defer_loading]
    return out, listed or None, prefill


def _tool(tool: Any) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _for_template(message: Message, where: str, tools: dict[str, Tool]) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = message.content
    for index, block in enumerate(blocks):
        _check_block(message.role, block, f"{where}.content.{index}")
    if message.role == "assistant":
        return [_assistant(blocks)]
    out: list[dict] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            content = _result(block, tools)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif out and out[-1]["role"] == message.role:
            out[-1]["content"] += block.text  # type: ignore[union-attr]
        else:
            out.append({"role": message.role, "content": block.text})  # type: ignore[union-attr]
    return out


def _check_block(role: str, block: Any, where: str) -> None:
    kind = block.type
    allowed: dict[str, tuple[type, ...]] = {
        "user": (TextBlock, ToolResultBlock),
        "assistant": (TextBlock, ToolUseBlock),
        "system": (TextBlock,),
    }
    if isinstance(block, OtherBlock):
        raise InvalidRequest(
            f"Content blocks of type {kind!r} are not supported: proxrl serves a text model and "
            "takes text, tool_use, tool_result and thinking blocks.",
            param=where,
        )
    if not isinstance(block, allowed[role]) and not (
        role == "assistant" and isinstance(block, ThinkingBlock)
    ):
        raise InvalidRequest(f"A {role} message cannot hold a {kind} block.", param=where)


def _assistant(blocks: list) -> dict:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if isinstance(b, TextBlock)),
    }
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    return message


def _result(block: ToolResultBlock, tools: dict[str, Tool]) -> str:
    """A tool result's text: its text blocks joined, a ``tool_reference`` block as the named
    tool's definition (as the template lists tools; the bare name when it is not among the
    tools), each on a line of its own."""
    if isinstance(block.content, str):
        return block.content
    parts = []
    for part in block.content:
        if isinstance(part, OtherBlock):
            raise InvalidRequest(
                f"tool_result content of type {part.type!r} is not supported; give text or "
                "tool_reference blocks.",
                param="messages",
            )
        if isinstance(part, ToolReferenceBlock):
            tool = tools.get(part.tool_name)
            parts.append(json.dumps(_tool(tool), ensure_ascii=False) if tool else part.tool_name)
        else:
            parts.append(part.text)
    referenced = any(isinstance(part, ToolReferenceBlock) for part in block.content)
    return ("\n" if referenced else "").join(parts)


def _joined(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "".join(block.text for block in system)


# ----- the answer --------------------------------------------------------------------------------


def usage(counts: dict) -> dict:
    """OpenAI's usage counts (``outputs.usage``) in Anthropic's words."""
    return {
        "input_tokens": counts["prompt_tokens"],
        "output_tokens": counts["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class _Blocks:
    """An answer's content blocks built from its reasoning, text and tool-call events, and the
    stream events that build them: a ``thinking`` block for the reasoning, one text block per
    run of text, a ``tool_use`` block per call."""

    def __init__(self) -> None:
        self.content: list[dict] = []
        self.open: str | None = None  # the kind of the last block while it takes more text

    def push(self, events: list[StreamEvent]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._text("thinking", event.text)
            elif isinstance(event, ContentDelta):
                out += self._text("text", event.text)
            elif isinstance(event, ToolCallDelta):
                out += self.close()
                call = event.call
                tool_id = "toolu_" + call.id.removeprefix("call_")
                block = {"type": "tool_use", "id": tool_id, "name": call.name, "input": {}}
                out.append(self._start(block))
                self.content[-1]["input"] = json.loads(call.arguments)
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                )
                out.append({"type": "content_block_stop", "index": len(self.content) - 1})
        return out

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _text(self, kind: Literal["text", "thinking"], text: str) -> list[dict]:
        out = []
        if self.open != kind:
            out += self.close()
            block = {"type": "text", "text": ""} if kind == "text" else _THINKING
            out.append(self._start(dict(block)))
            self.open = kind
        self.content[-1][kind] += text
        out.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return out

    def _start(self, block: dict) -> dict:
        self.content.append(block)
        start = {"type": "content_block_start", "index": len(self.content) - 1}
        return start | {"content_block": dict(block)}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}


# A thinking block's signature proves to Anthropic that Claude wrote it; proxrl has none to give.
_THINKING = {"type": "thinking", "thinking": "", "signature": ""}


class MessagesRenderer:
    """An Anthropic message and its event stream (``answer.Renderer``; one choice).

    Streamed, the turn records the blocks as they were streamed (tool_use ids included): the
    content list ``served`` returns is the one the stream builds, which ``finish`` completes
    before ``answer`` records the turn."""

    named_events = True

    def __init__(self, ctx: ServerContext, plan: Plan, body: MessagesRequest) -> None:
        self.tokenizer, self.plan = ctx.tokenizer, plan
        self.reasoning = reasoning_style(ctx.tokenizer)
        self.names = _tool_names(body)
        # The answer names the served model, as every surface's does (docs/concepts.md#model-names).
        self.model, self.stops, self.streamed = ctx.model_name, body.stops, body.stream
        # Cut by the context (see _token_limit), not by the run's max_completion_tokens.
        room = (ctx.context_length or 0) - len(plan.sampling.prompt_ids)
        self.context_cut = (
            plan.sampling.max_tokens < body.max_tokens and plan.sampling.max_tokens >= room
        )
        self.blocks = _Blocks()
        self.message: dict[str, Any] = {}

    def served(self, completion_id: str, completion: Completion) -> Served:
        full = outputs.final_text(self.tokenizer, completion)
        reasoning, text = split_reasoning(full, self.reasoning)
        text = self.plan.forced + text  # a forced call's start (forced_calls)
        names = self.names
        called = names is not None and bool(parse_tool_calls(text, names).tool_calls)
        if self.streamed:
            content = self.blocks.content
        else:
            blocks = _Blocks()
            blocks.push(_events(reasoning, text, names))
            content = blocks.content
        reason, sequence = self._stop(completion, called)
        self.message = {
            "role": "assistant",
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }
        return Served(
            completion_id, completion, self.message, outputs.finish_reason(completion, called)
        )

    def _stop(self, completion: Completion, called: bool) -> tuple[str, str | None]:
        if called:
            return "tool_use", None
        if completion.finish_reason.get("type") == "length":
            return ("model_context_window_exceeded" if self.context_cut else "max_tokens"), None
        matched = completion.finish_reason.get("matched")
        if isinstance(matched, str) and matched in self.stops:
            return "stop_sequence", matched
        return "end_turn", None

    def response(self, served: list[Served], counts: dict) -> dict:
        (item,) = served
        head = {"id": self.plan.request_id, "type": "message", "model": self.model}
        return head | item.response | {"usage": usage(counts)}

    def start(self) -> list[dict]:
        message: dict[str, Any] = {
            "id": self.plan.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage({"prompt_tokens": len(self.plan.prompt.ids), "completion_tokens": 0}),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> list[dict]:
        return self.blocks.push(deltas)

    def finish(self, index: int, deltas: list[StreamEvent], finish_reason: str) -> list[dict]:
        return self.blocks.push(deltas) + self.blocks.close()

    def end(self, counts: dict) -> list[dict]:
        stop = {k: self.message.get(k) for k in ("stop_reason", "stop_sequence")}
        delta_usage = {"output_tokens": counts["completion_tokens"]}
        return [
            {"type": "message_delta", "delta": stop, "usage": delta_usage},
            {"type": "message_stop"},
        ]

    @staticmethod
    def error(error: ProxrlError) -> list[dict]:
        return [anthropic_body(error.message, error.status, error.param)]

    @staticmethod
    def closing() -> list[dict]:
        return []


def _events(reasoning: str | None, text: str, tool_names: set[str] | None) -> list[StreamEvent]:
    """A finished answer as the events a stream of it gives (same blocks, streamed or not)."""
    events: list[StreamEvent] = [ReasoningDelta(reasoning)] if reasoning else []
    if tool_names is None:
        return events + ([ContentDelta(text)] if text else [])
    calls = ToolCallStream(tool_names)
    return events + calls.feed(text) + calls.finish()
