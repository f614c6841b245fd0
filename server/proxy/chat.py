"""``/v1/chat/completions``: render the conversation into a plan; chat's answer and chunks.

The prompt is rendered with the model's chat template and tokenized here, on a prompt thread
(continuing the session's last turn token for token when the history matches); a special
token's text in the client's messages or tools is tokenized as text (the run's
``client_special_tokens``). The engines only ever see token ids. A request without a
temperature is sampled at its run's. ``tool_choice`` "required" or a named function ends the
prompt with the start of a call (``forced_calls``); ``response_format`` is served or refused by
the run's policy (``plan.structured_output``). Sampling, recording and streaming are
``answer``'s; this module says what a chat answer and its chunks look like.
"""

from __future__ import annotations

from typing import Any

from server.context import ServerContext
from server.engine_client.client import Piece
from server.proxy import forced_calls, outputs
from server.proxy.generation import Completion
from server.proxy.plan import (
    Plan,
    build_prompt,
    check_model,
    new_plan,
    rendered,
    run_config,
    sampling_request,
    structured_output,
)
from server.proxy.reasoning import reasoning_style, split_reasoning
from server.proxy.recording import Served
from server.proxy.schemas import ChatCompletionRequest
from server.proxy.session_cache import SessionState
from server.proxy.tool_calls import ContentDelta, ReasoningDelta, StreamEvent, parse_tool_calls
from server.text.tokenization import PromptText


async def plan_chat(ctx: ServerContext, state: SessionState, body: ChatCompletionRequest) -> Plan:
    config = await run_config(ctx, state)
    version = await check_model(ctx, state, body.model)
    body.refuse_untrainable()
    headers = await structured_output(ctx, state, body.format_type, "response_format")
    forced = body.forced_tool()
    messages = [message.for_template() for message in body.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    start = forced_calls.forced_start(ctx.tokenizer, *forced, "tool_choice") if forced else ""
    client = config.client_special_tokens

    def render() -> PromptText:
        text = rendered(ctx, messages, tools, client, "messages")
        return ctx.tokenizer.client_text(text, start, client)

    prompt = await build_prompt(ctx, state, render, "messages")
    top = (body.top_logprobs or 0) if body.logprobs else 0
    sampling = sampling_request(ctx, prompt.ids, body.token_limit, body, top, config)
    parse_tools = tools is not None and body.tool_choice != "none"
    return new_plan(
        "chatcmpl",
        prompt,
        sampling,
        body.n,
        surface="chat",
        model=body.model,
        version=version,
        messages=messages,
        tools=tools,
        logprobs=body.logprobs,
        tool_names={t["function"]["name"] for t in tools} if parse_tools and tools else None,
        forced=start,
        headers=headers,
    )


class ChatRenderer(outputs.OpenAIRenderer):
    """A chat completion and its chunks (``answer.Renderer``)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, plan: Plan, include_usage: bool) -> None:
        super().__init__(ctx.model_name, plan, include_usage)
        self.tokenizer = ctx.tokenizer

    def served(self, completion_id: str, completion: Completion) -> Served:
        """The assistant message: the text, or its tool calls and the rest of the text; a
        reasoning model's reasoning as ``reasoning_content`` (the text then is the answer)."""
        full = outputs.final_text(self.tokenizer, completion)
        reasoning, text = split_reasoning(full, reasoning_style(self.tokenizer))
        text = self.plan.forced + text  # a forced call's start (forced_calls)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        calls = []
        if self.plan.tool_names is not None:
            parsed = parse_tool_calls(text, self.plan.tool_names)
            calls = parsed.tool_calls
            message["content"] = parsed.content
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
        finish = outputs.finish_reason(completion, bool(calls))
        return Served(completion_id, completion, message, finish)

    def response(self, served: list[Served], usage: dict) -> dict:
        choices = []
        for index, item in enumerate(served):
            choice: dict[str, Any] = {
                "index": index,
                "message": item.response,
                "logprobs": self._logprobs(item.completion) if self.plan.logprobs else None,
                "finish_reason": item.finish_reason,
            }
            if len(served) > 1:
                choice["completion_id"] = item.completion_id
            choices.append(choice)
        return self.envelope(choices, usage)

    def _logprobs(self, completion: Completion) -> dict:
        tops = completion.top or [None] * len(completion.ids)  # type: ignore[list-item]
        return {"content": self._entries(completion.ids, completion.logprobs, tops)}

    def _entries(self, ids: list[int], logprobs: list[float], tops: list) -> list[dict]:
        return [
            outputs.logprob_entry(self.tokenizer, token, lp, top)
            for token, lp, top in zip(ids, logprobs, tops, strict=True)
        ]

    def start(self) -> list[dict]:
        """Each choice opens with the assistant's role."""
        role = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
            for i in range(len(self.plan.completion_ids))
        ]

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> list[dict]:
        """One chunk of one choice entry: the deltas as one (``_merged``), the piece's
        logprobs."""
        delta = _merged(deltas)
        logprobs = None
        if self.plan.logprobs:
            tops = piece.top or [None] * len(piece.ids)  # type: ignore[list-item]
            logprobs = {"content": self._entries(piece.ids, piece.logprobs, tops)}
            delta = delta or {"content": ""}
        if not delta:
            return []
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return [self.chunk([choice])]

    def finish(self, index: int, deltas: list[StreamEvent], finish_reason: str) -> list[dict]:
        """A chunk per held-back delta, then one with the finish reason."""
        last: list[tuple[dict, str | None]] = [(_delta(event), None) for event in deltas]
        last.append(({}, finish_reason))
        return [
            self.chunk([{"index": index, "delta": d, "logprobs": None, "finish_reason": reason}])
            for d, reason in last
        ]


def _merged(events: list[StreamEvent]) -> dict:
    """Events of one choice as one delta: reasoning and content each joined, tool calls in order
    (a client gathers each field on its own, as OpenAI's SDK does: one chunk of coalesced tokens
    holds what a chunk per token would, and a reader of the first choice entry misses none)."""
    merged: dict[str, Any] = {}
    for event in events:
        for key, value in _delta(event).items():
            merged[key] = merged[key] + value if key in merged else value
    return merged


def _delta(event: StreamEvent) -> dict:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    return {"tool_calls": [event.call.to_openai(event.index)]}
