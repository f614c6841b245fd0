"""What a Responses API answer looks like: the Response object and its stream of events.

Output items are a ``message`` (its text as one ``output_text`` part) and one ``function_call``
item per tool call the model made (``<tool_call>`` blocks that parse; malformed ones stay text).
Streamed, the events follow OpenAI's sequence: ``response.created``, ``response.in_progress``,
then per item ``response.output_item.added``, (for a message) ``response.content_part.added``,
``response.output_text.delta``... ``response.output_text.done``, ``response.content_part.done``,
(for a call) ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when the
output token budget ran out) with the whole Response. Every event has its ``sequence_number``.
The streamed items are what the Response holds and what the turn records: a call keeps the id
it was streamed with, and text after a call opens a new message item.

It knows no engines, sessions or store (``answer.Renderer``).
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
from server.proxy.recording import Served
from server.proxy.responses_schema import ResponseRequest
from server.proxy.tool_calls import ContentDelta, ParsedOutput, StreamEvent, parse_tool_calls


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _message(text: str = "", status: str = "in_progress") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if status != "in_progress" else []
    return {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesRenderer:
    """The Response and its events for a plan of one choice (``answer.Renderer``)."""

    named_events = True

    def __init__(self, ctx: ServerContext, plan: Plan, body: ResponseRequest) -> None:
        self.tokenizer = ctx.tokenizer
        self.plan, self.body = plan, body
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items streamed so far
        self.texts: list[str] = []  # the text streamed into each item (messages)
        self.open: int | None = None  # the message item being streamed into
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
            "model": body.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": self.plan.sampling.temperature,
            "top_p": 1.0,
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "store": body.store is not False,
            "usage": usage,
        }

    def served(self, completion_id: str, completion: Completion) -> Served:
        """The Response: the items streamed so far, then what is left of the parse (all of it
        when not streamed)."""
        text = outputs.final_text(self.tokenizer, completion)
        names = self.plan.tool_names
        parsed = parse_tool_calls(text, names) if names is not None else ParsedOutput(text, [])
        output = self._output(parsed)
        calls = any(item["type"] == "function_call" for item in output)
        finish = outputs.finish_reason(completion, calls)
        status = "incomplete" if finish == "length" else "completed"
        for item in output:
            if item["type"] == "message":
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

    def _output(self, parsed: ParsedOutput) -> list[dict[str, Any]]:
        output = copy.deepcopy(self.items)
        content = parsed.content or ""
        rest = content[len("".join(self.texts)) :]
        if self.open is not None:
            output[self.open] = _message(self.texts[self.open] + rest, "completed")
        elif rest or (not parsed.tool_calls and not output):
            output.append(_message(rest, "completed"))
        sent = sum(item["type"] == "function_call" for item in self.items)
        for call in parsed.tool_calls[sent:]:
            output.append(_call(call.id, call.name, call.arguments))
        for index, item in enumerate(self.items):  # streamed items keep their ids
            output[index]["id"] = item["id"]
        return output

    def response(self, served: list[Served], usage: dict) -> dict:
        return served[0].response

    # ----- the events --------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return self.opening

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                events += self._text(delta.text)
            else:
                events += self._close()
                call = delta.call
                events += self._whole(_call(call.id, call.name, call.arguments))
        return events

    def _text(self, text: str, opening: dict[str, Any] | None = None) -> list[dict]:
        """Stream ``text`` into the open message, opening one (with ``opening``'s id) if none."""
        events = []
        if self.open is None:
            self.open = len(self.items)
            self.items.append({**_message(), "id": (opening or _message())["id"]})
            self.texts.append("")
            item = self.items[self.open]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [
                self.event("output_item.added", output_index=self.open, item=item),
                self.event("content_part.added", part=part, **self._at()),
            ]
        self.texts[self.open] += text
        if text:
            events.append(self.event("output_text.delta", delta=text, logprobs=[], **self._at()))
        return events

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {
            "item_id": self.items[self.open]["id"],
            "output_index": self.open,
            "content_index": 0,
        }

    def _close(self, final: dict | None = None) -> list[dict]:
        """Finish the open message (with the rest of its text, from ``final``)."""
        if self.open is None:
            return []
        events = []
        item = final or _message(self.texts[self.open], "completed")
        text = item["content"][0]["text"]
        rest = text[len(self.texts[self.open]) :]
        if rest:
            events += self._text(rest)
        part = item["content"][0]
        events += [
            self.event("output_text.done", text=text, logprobs=[], **self._at()),
            self.event("content_part.done", part=part, **self._at()),
        ]
        item = {**item, "id": self.items[self.open]["id"]}
        events.append(self.event("output_item.done", output_index=self.open, item=item))
        self.items[self.open] = item
        self.open = None
        return events

    def _whole(self, item: dict[str, Any]) -> list[dict]:
        """All the events of an item not streamed yet."""
        if item["type"] == "message":
            events = self._text(item["content"][0]["text"], opening=item)
            return events + self._close(item)
        index = len(self.items)
        self.items.append(item)
        self.texts.append("")
        at = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.event("output_item.added", output_index=index, item=added),
            self.event("function_call_arguments.delta", delta=item["arguments"], **at),
            self.event("function_call_arguments.done", arguments=item["arguments"], **at),
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
