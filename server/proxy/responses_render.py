"""What a Responses API answer looks like: the Response object and its stream of events.

Output items are a ``reasoning`` item (a reasoning model's ``<think>`` block, as one
``reasoning_text`` part), a ``message`` (its text as one ``output_text`` part) and one
``function_call`` item per tool call the model made (``<tool_call>`` blocks that parse;
malformed ones stay text), a ``custom_tool_call`` with the raw ``input`` for a call to a custom
tool (``responses_schema``), either with its ``namespace`` where the tool was in one.
Streamed, the events follow OpenAI's sequence: ``response.created``, ``response.in_progress``,
then per item ``response.output_item.added``, (for reasoning) ``response.reasoning_text.delta``...
``.done``, (for a message) ``response.content_part.added``,
``response.output_text.delta``... ``response.output_text.done``, ``response.content_part.done``,
(for a call) ``response.function_call_arguments.delta`` / ``.done`` (a custom tool's:
``response.custom_tool_call_input.delta`` / ``.done``), then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when the
output token budget ran out) with the whole Response. Every event has its ``sequence_number``.
The streamed items are what the Response holds and what the turn records: a call keeps the id
it was streamed with, and text after a call opens a new message item.

It knows no engines, sessions or store (``answer.Renderer``). Once the answer is served (the
Response returned, or the stream's last event), it counts the hosted tools the request's prompt
left out (``proxrl_hosted_tools_omitted``): a request that failed on the way counts nothing.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from server.context import ServerContext
from server.engine_client.client import Piece
from server.errors import ProxrlError
from server.proxy import outputs
from server.proxy.generation import Completion
from server.proxy.plan import Plan
from server.proxy.reasoning import reasoning_style, split_reasoning
from server.proxy.recording import Served
from server.proxy.responses_schema import ResponseRequest
from server.proxy.tool_calls import (
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    free_form_input,
    parse_tool_calls,
)

# Hosted tool types counted by name (proxrl_hosted_tools_omitted); any other type is "other",
# so a client cannot grow the metric's label set.
HOSTED_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "tool_search",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
    }
)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _message(text: str = "", status: str = "in_progress", id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": id or _id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if status != "in_progress" else [],
    }


def _reasoning(text: str = "", status: str = "in_progress", id: str | None = None) -> dict:
    part = {"type": "reasoning_text", "text": text}
    return {
        "id": id or _id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [part] if status != "in_progress" else [],
        "status": status,
    }


def _call(call: ToolCall, kinds: dict[str, tuple[str, str | None]]) -> dict[str, Any]:
    """The output item of a call: a ``function_call``, or a ``custom_tool_call`` with its raw
    ``input``; with the tool's ``namespace`` where it has one."""
    kind, namespace = kinds.get(call.name, ("function", None))
    head = {"call_id": call.id, "name": call.name}
    if kind == "custom":
        item = {
            "id": _id("ctc"),
            "type": "custom_tool_call",
            **head,
            "input": free_form_input(call),
        }
    else:
        item = {
            "id": _id("fc"),
            "type": "function_call",
            **head,
            "arguments": call.arguments,
            "status": "completed",
        }
    return item | ({"namespace": namespace} if namespace else {})


CALL_ITEMS = ("function_call", "custom_tool_call")
# What each kind of call's stream says between output_item.added and .done: its delta and done
# events, and the field they carry.
CALL_EVENTS = {
    "function_call": ("function_call_arguments.delta", "function_call_arguments.done", "arguments"),
    "custom_tool_call": ("custom_tool_call_input.delta", "custom_tool_call_input.done", "input"),
}


OPEN_ITEMS = {"message": _message, "reasoning": _reasoning}  # the items streamed as text
# What each kind of text item's stream says, after output_item.added and before .done.
TEXT_EVENTS = {
    "message": ("content_part.added", "output_text.delta", "output_text.done", "content_part.done"),
    "reasoning": (None, "reasoning_text.delta", "reasoning_text.done", None),
}


class ResponsesRenderer:
    """The Response and its events for a plan of one choice (``answer.Renderer``)."""

    named_events = True

    def __init__(self, ctx: ServerContext, plan: Plan, body: ResponseRequest) -> None:
        self.tokenizer = ctx.tokenizer
        self.metrics = ctx.metrics
        self.plan, self.body = plan, body
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items streamed so far
        self.texts: dict[int, str] = {}  # the text streamed into each text item, by index
        self.open: int | None = None  # the text item (message, reasoning) being streamed into
        self.reasoning = reasoning_style(ctx.tokenizer)
        self.served_model = ctx.model_name
        self.tool_kinds = body.tool_kinds()
        self.final: dict[str, Any] = {}
        # Numbered first, though sent once the first tokens came (and were given their events).
        head = self.head("in_progress", [], None)
        self.opening = [
            self.event("created", response=head),
            self.event("in_progress", response=head),
        ]

    # ----- the Response ------------------------------------------------------------------

    def head(self, status: str, output: list[dict], usage: dict | None) -> dict[str, Any]:
        body = self.body
        length = status == "incomplete"
        return {
            "id": self.plan.request_id,
            "object": "response",
            "created_at": self.plan.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.served_model,  # what produced the tokens (docs/concepts.md: Model names)
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": self.plan.sampling.temperature,
            "top_p": 1.0,
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "store": body.store is not False,
            "usage": usage,
        }

    def served(self, completion_id: str, completion: Completion) -> Served:
        """The Response: the items streamed so far, then what is left of the parse (all of it
        when not streamed)."""
        full = outputs.final_text(self.tokenizer, completion)
        reasoning, text = split_reasoning(full, self.reasoning)
        text = self.plan.forced + text  # a forced call's start (forced_calls)
        names = self.plan.tool_names
        parsed = parse_tool_calls(text, names) if names is not None else ParsedOutput(text, [])
        output = self._output(reasoning, parsed)
        calls = any(item["type"] in CALL_ITEMS for item in output)
        finish = outputs.finish_reason(completion, calls)
        length = completion.finish_reason.get("type") == "length"
        status = "incomplete" if length else "completed"  # calls or not
        for item in output:
            if item["type"] in OPEN_ITEMS:
                item["status"] = status
        prompt = len(self.plan.prompt.ids)
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(completion.ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + len(completion.ids),
        }
        self.final = self.head(status, output, usage)
        return Served(completion_id, completion, self.final, finish)

    def _output(self, reasoning: str | None, parsed: ParsedOutput) -> list[dict[str, Any]]:
        """The items streamed so far (the open one completed), then the rest. Reasoning comes
        first in any stream, so an item not streamed yet goes after every streamed one."""
        output = copy.deepcopy(self.items)
        kinds = [item["type"] for item in output]
        for index, item in enumerate(output):
            if item["type"] == "reasoning" and reasoning is not None:
                output[index] = _reasoning(reasoning, "completed", item["id"])
        if reasoning is not None and "reasoning" not in kinds:
            output.append(_reasoning(reasoning, "completed"))
        sent = "".join(self.texts[i] for i, kind in enumerate(kinds) if kind == "message")
        rest = (parsed.content or "")[len(sent) :]
        if self.open is not None and kinds[self.open] == "message":
            item = output[self.open]
            output[self.open] = _message(self.texts[self.open] + rest, "completed", item["id"])
        elif rest or (not parsed.tool_calls and "message" not in kinds):
            output.append(_message(rest, "completed"))
        streamed = sum(kind in CALL_ITEMS for kind in kinds)
        for call in parsed.tool_calls[streamed:]:
            output.append(_call(call, self.tool_kinds))
        return output

    def response(self, served: list[Served], usage: dict) -> dict:
        self._count_omitted()
        return served[0].response

    def _count_omitted(self) -> None:
        """Count the hosted tools left out of a served request's prompt, by type (any type not
        in ``HOSTED_TYPES`` as "other", so a client cannot grow the label set)."""
        for kind in self.plan.log.sampling.get("omitted_tools", []):
            label = kind if kind in HOSTED_TYPES else "other"
            self.metrics.hosted_tools_omitted.labels(label).inc()

    # ----- the events --------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return self.opening

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if isinstance(delta, ToolCallDelta):
                events += self._whole(_call(delta.call, self.tool_kinds))
            else:
                kind = "reasoning" if isinstance(delta, ReasoningDelta) else "message"
                events += self._text(kind, delta.text)
        return events

    def _text(self, kind: str, text: str, opening: dict[str, Any] | None = None) -> list[dict]:
        """Stream ``text`` into an open item of ``kind``, opening one (with ``opening``'s id)
        after closing any other."""
        events = []
        if self.open is not None and self.items[self.open]["type"] != kind:
            events += self._close()
        if self.open is None:
            self.open = len(self.items)
            item = OPEN_ITEMS[kind](id=opening["id"] if opening else None)
            self.items.append(item)
            self.texts[self.open] = ""
            events.append(self.event("output_item.added", output_index=self.open, item=item))
            part_added = TEXT_EVENTS[kind][0]
            if part_added:
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self.event(part_added, part=part, **self._at()))
        self.texts[self.open] += text
        if text:
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events.append(self.event(TEXT_EVENTS[kind][1], delta=text, **extra, **self._at()))
        return events

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {
            "item_id": self.items[self.open]["id"],
            "output_index": self.open,
            "content_index": 0,
        }

    def _close(self, final: dict | None = None) -> list[dict]:
        """Finish the open text item (with the rest of its text, from ``final``)."""
        if self.open is None:
            return []
        events = []
        kind = self.items[self.open]["type"]
        item = final or OPEN_ITEMS[kind](self.texts[self.open], "completed")
        text = item["content"][0]["text"]
        rest = text[len(self.texts[self.open]) :]
        if rest:
            events += self._text(kind, rest)
        _, _, text_done, part_done = TEXT_EVENTS[kind]
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(text_done, text=text, **extra, **self._at()))
        if part_done:
            events.append(self.event(part_done, part=item["content"][0], **self._at()))
        item = {**item, "id": self.items[self.open]["id"]}
        events.append(self.event("output_item.done", output_index=self.open, item=item))
        self.items[self.open] = item
        self.open = None
        return events

    def _whole(self, item: dict[str, Any]) -> list[dict]:
        """All the events of an item not streamed yet."""
        if item["type"] in OPEN_ITEMS:
            events = self._text(item["type"], item["content"][0]["text"], opening=item)
            return events + self._close(item)
        events = self._close()
        index = len(self.items)
        self.items.append(item)
        at = {"item_id": item["id"], "output_index": index}
        delta, done, field = CALL_EVENTS[item["type"]]
        added = {**item, field: ""}
        if "status" in item:
            added["status"] = "in_progress"
        return [
            *events,
            self.event("output_item.added", output_index=index, item=added),
            self.event(delta, delta=item[field], **at),
            self.event(done, **{field: item[field]}, **at),
            self.event("output_item.done", output_index=index, item=item),
        ]

    def finish(self, index: int, deltas: list[StreamEvent], finish_reason: str) -> list[dict]:
        """Bring the stream to the Response ``served`` made: the rest of the open message,
        then the items not streamed yet."""
        output = self.final["output"]
        streamed = len(self.items)
        events = self._close(output[self.open]) if self.open is not None else []
        for item in output[streamed:]:
            events += self._whole(item)
        return events

    def end(self, usage: dict) -> list[dict]:
        kind = "incomplete" if self.final["status"] == "incomplete" else "completed"
        self._count_omitted()
        return [self.event(kind, response=self.final)]

    def error(self, error: ProxrlError) -> list[dict]:
        self.sequence += 1
        return [
            {
                "type": "error",
                "code": error.code,
                "message": error.message,
                "param": error.param,
                "sequence_number": self.sequence - 1,
            }
        ]

    @staticmethod
    def closing() -> list[str]:
        return []  # a Responses stream has no [DONE]
