"""``/v1/chat/completions``: render the conversation, sample, parse tool calls, record, answer.

The prompt is rendered with the model's chat template and tokenized here (continuing the
session's last turn token for token when the history matches); the engines only ever see token
ids. A request without a temperature is sampled at its run's. ``n`` choices are ``n`` engine
requests. Every choice is stored as a turn before the client gets the end of the answer,
streamed or not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from server.context import ServerContext
from server.errors import (
    ContextLengthUnknown,
    InvalidRequest,
    ModelNotFound,
    PromptTooLong,
    RunNotFound,
)
from server.proxy import outputs, prompts
from server.proxy.generation import Completion, SamplingRequest, complete
from server.proxy.recording import RequestLog, Served, record
from server.proxy.schemas import ChatCompletionRequest
from server.proxy.session_cache import SessionState
from server.proxy.streaming import GuardedStream, drain, first_output, sse
from server.proxy.tool_calls import ContentDelta, ToolCallStream, parse_tool_calls
from server.text.tokenization import TemplateError


@dataclass(frozen=True)
class Plan:
    """A validated chat request, ready to sample."""

    request_id: str
    created: int
    prompt: prompts.Prompt
    sampling: SamplingRequest
    completion_ids: list[str]
    tool_names: set[str] | None  # None: do not parse tool calls
    log: RequestLog
    logprobs: bool


def check_model(ctx: ServerContext, model: str) -> None:
    if model != ctx.model_name:
        raise ModelNotFound(model, ctx.model_name)


def sampling_request(
    ctx: ServerContext,
    prompt_ids: list[int],
    limit: int | None,
    body: Any,
    top_logprobs: int,
    default_temperature: float,
) -> SamplingRequest:
    """Sampling settings, with max tokens checked against the context length (the engines'
    smallest; the pool routes only to engines that reported theirs); a request that gives no
    temperature is sampled at the run's."""
    context = ctx.context_length
    if context is None:
        raise ContextLengthUnknown()
    room = context - len(prompt_ids)
    if room <= 0:
        raise PromptTooLong(
            f"The prompt has {len(prompt_ids)} tokens; the model's context is {context}.",
            param="messages",
        )
    max_tokens = limit if limit is not None else room
    if max_tokens > room:
        raise PromptTooLong(
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt_ids)} and {max_tokens} were asked for the completion.",
            param="max_tokens",
        )
    temperature = default_temperature if body.temperature is None else body.temperature
    return SamplingRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(temperature),
        stop=body.stops,
        seed=body.seed,
        top_logprobs=top_logprobs,
    )


def plan_chat(
    ctx: ServerContext, state: SessionState, body: ChatCompletionRequest, default_temperature: float
) -> Plan:
    check_model(ctx, body.model)
    body.refuse_untrainable()
    messages = [message.for_template() for message in body.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    try:
        text = ctx.tokenizer.render(messages, tools=tools, add_generation_prompt=True)
    except TemplateError as exc:
        raise InvalidRequest(f"The chat template refused the messages: {exc}", "messages") from exc
    prompt = prompts.splice(ctx.tokenizer, text, state.last)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    sampling = sampling_request(ctx, prompt.ids, body.token_limit, body, top, default_temperature)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    parse_tools = tools is not None and body.tool_choice != "none"
    log = RequestLog(
        request_id=request_id,
        messages=messages,
        tools=tools,
        sampling={
            "temperature": sampling.temperature,
            "max_tokens": sampling.max_tokens,
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "n": body.n,
        },
    )
    return Plan(
        request_id=request_id,
        created=int(time.time()),
        prompt=prompt,
        sampling=sampling,
        completion_ids=ids,
        tool_names={t["function"]["name"] for t in tools} if parse_tools and tools else None,
        log=log,
        logprobs=body.logprobs,
    )


async def sample_all(
    ctx: ServerContext,
    state: SessionState,
    sampling: SamplingRequest,
    completion_ids: list[str],
    stream: bool = False,
    on_piece: Any = None,
) -> list[Completion]:
    """One completion per id, concurrently; ``on_piece(index, piece)`` sees streamed tokens."""

    async def one(index: int, rid: str) -> Completion:
        handler = (lambda piece: on_piece(index, piece)) if on_piece else None
        return await complete(
            ctx.pool, sampling, rid, prefer=state.engine, stream=stream, on_piece=handler
        )

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(completion_ids)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # one choice failed: the others are not wanted either
            task.cancel()


def _message(ctx: ServerContext, plan: Plan, completion: Completion) -> tuple[dict, str]:
    text = outputs.final_text(ctx.tokenizer, completion)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    if plan.tool_names is not None:
        parsed = parse_tool_calls(text, plan.tool_names)
        calls = parsed.tool_calls
        message["content"] = parsed.content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
    return message, outputs.finish_reason(completion, bool(calls))


def _logprobs(ctx: ServerContext, completion: Completion) -> dict:
    tops = completion.top or [None] * len(completion.ids)  # type: ignore[list-item]
    return {
        "content": [
            outputs.logprob_entry(ctx.tokenizer, token, lp, top)
            for token, lp, top in zip(completion.ids, completion.logprobs, tops, strict=True)
        ]
    }


async def run_temperature(ctx: ServerContext, state: SessionState) -> float:
    """The temperature of the session's run (kept in memory for a moment: ``ctx.run_configs``)."""
    config = await ctx.run_configs.get(state.run_id)
    if config is None:  # the run of a live session is never deleted
        raise RunNotFound(state.run_id)
    return config.temperature


async def chat_completion(
    ctx: ServerContext, state: SessionState, body: ChatCompletionRequest
) -> dict:
    plan = plan_chat(ctx, state, body, await run_temperature(ctx, state))
    completions = await sample_all(ctx, state, plan.sampling, plan.completion_ids)
    answers, served = [], []
    for index, (cid, completion) in enumerate(zip(plan.completion_ids, completions, strict=True)):
        message, finish = _message(ctx, plan, completion)
        served.append(Served(cid, completion, message, finish))
        answer: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": _logprobs(ctx, completion) if plan.logprobs else None,
            "finish_reason": finish,
        }
        if body.n > 1:
            answer["completion_id"] = cid
        answers.append(answer)
    await record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
    return {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": answers,
        "usage": outputs.usage(len(plan.prompt.ids), completions),
    }


class _ChoiceStream:
    """Deltas of one streamed choice: text (stop strings held back), tool calls, logprobs."""

    def __init__(self, ctx: ServerContext, plan: Plan, index: int) -> None:
        self.ctx, self.plan, self.index = ctx, plan, index
        self.text = outputs.TextStreamer(ctx.tokenizer, plan.sampling.stop)
        self.tools = ToolCallStream(plan.tool_names) if plan.tool_names is not None else None
        self.called = False

    def _deltas(self, text: str, final: bool) -> list[dict]:
        if self.tools is None:
            return [{"content": text}] if text else []
        events = self.tools.feed(text) + (self.tools.finish() if final else [])
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append({"content": event.text})
            else:
                self.called = True
                out.append({"tool_calls": [event.call.to_openai(event.index)]})
        return out

    def on_piece(self, ids: list[int], logprobs: list[float], top: list) -> list[dict]:
        deltas = self._deltas(self.text.push(ids), final=False)
        entries = None
        if self.plan.logprobs:
            tops = top or [None] * len(ids)
            entries = [
                outputs.logprob_entry(self.ctx.tokenizer, token, lp, t)
                for token, lp, t in zip(ids, logprobs, tops, strict=True)
            ]
            deltas = deltas or [{"content": ""}]
        choice_list = []
        for i, delta in enumerate(deltas):
            choice: dict[str, Any] = {
                "index": self.index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
            }
            if entries is not None and i == 0:
                choice["logprobs"] = {"content": entries}
            choice_list.append(choice)
        return choice_list

    def finish(self, completion: Completion) -> list[dict]:
        deltas = self._deltas(self.text.finish(completion), final=True)
        out: list[dict[str, Any]] = [
            {"index": self.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        finish = outputs.finish_reason(completion, self.called)
        out.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return out


async def chat_completion_stream(
    ctx: ServerContext, state: SessionState, body: ChatCompletionRequest
) -> GuardedStream:
    """Plan now (errors surface before the stream starts); chunks come from the generator."""
    plan = plan_chat(ctx, state, body, await run_temperature(ctx, state))
    return await _stream(ctx, state, plan, body.include_usage)


async def _stream(
    ctx: ServerContext, state: SessionState, plan: Plan, include_usage: bool
) -> GuardedStream:
    """Start sampling; once the first tokens came (or sampling failed: raised here, so the
    client gets a status code), the events."""
    head = {
        "id": plan.request_id,
        "object": "chat.completion.chunk",
        "created": plan.created,
        "model": ctx.model_name,
    }
    streams = [_ChoiceStream(ctx, plan, i) for i in range(len(plan.completion_ids))]
    queue: asyncio.Queue[list[dict]] = asyncio.Queue()
    produced = asyncio.Event()

    async def on_piece(index: int, piece: Any) -> None:
        produced.set()
        chunk = streams[index].on_piece(piece.ids, piece.logprobs, piece.top)
        if chunk:
            await queue.put(chunk)

    sampling = asyncio.create_task(
        sample_all(ctx, state, plan.sampling, plan.completion_ids, True, on_piece)
    )
    await first_output(sampling, produced)

    async def events() -> AsyncIterator[str]:
        for i in range(len(streams)):
            role = {"role": "assistant", "content": ""}
            first = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [first]})
        async for chunks in drain(sampling, queue):
            yield "".join(sse({**head, "choices": chunk}) for chunk in chunks)
        completions = sampling.result()
        served, tail = [], []
        for stream, cid, completion in zip(streams, plan.completion_ids, completions, strict=True):
            message, finish = _message(ctx, plan, completion)
            served.append(Served(cid, completion, message, finish))
            tail += stream.finish(completion)
        await record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
        for choice in tail:
            yield sse({**head, "choices": [choice]})
        if include_usage:
            usage = outputs.usage(len(plan.prompt.ids), completions)
            yield sse({**head, "choices": [], "usage": usage})

    return GuardedStream(events(), sampling)
