"""``/v1/completions``: a text or token-id prompt, sampled ``n`` times, recorded, answered.

A text prompt that begins with a previous turn's exact text reuses that turn's tokens (as chat
does); a token-id prompt continues a turn when it starts with that turn's ids. One prompt per
request: a batch of prompts is refused (each would be its own turn).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.context import ServerContext
from server.errors import InvalidRequest
from server.proxy import outputs, prompts
from server.proxy.chat import check_model, run_temperature, sample_all, sampling_request
from server.proxy.generation import Completion
from server.proxy.recording import RequestLog, Served, record
from server.proxy.schemas import CompletionRequest
from server.proxy.session_cache import SessionState
from server.proxy.streaming import GuardedStream, drain, first_output, sse


class _Plan:
    def __init__(
        self,
        ctx: ServerContext,
        state: SessionState,
        body: CompletionRequest,
        default_temperature: float,
    ) -> None:
        check_model(ctx, body.model)
        body.refuse_untrainable()
        (prompt,) = _single(body)
        if isinstance(prompt, str):
            self.prompt = prompts.splice(ctx.tokenizer, prompt, state.last)
            self.echo = prompt
        else:
            if any(not 0 <= t < ctx.tokenizer.vocab_size for t in prompt):
                raise InvalidRequest("prompt holds a token id outside the vocabulary.", "prompt")
            self.prompt = prompts.from_ids(prompt, state.last)
            self.echo = ctx.tokenizer.decode(prompt)
        self.echo = self.echo if body.echo else ""
        top = body.logprobs or 0
        self.sampling = sampling_request(
            ctx, self.prompt.ids, body.max_tokens, body, top, default_temperature
        )
        self.request_id = f"cmpl-{uuid.uuid4().hex}"
        n = body.n
        self.completion_ids = (
            [self.request_id] if n == 1 else [f"{self.request_id}-{i}" for i in range(n)]
        )
        self.logprobs = body.logprobs is not None
        self.created = int(time.time())
        self.log = RequestLog(
            request_id=self.request_id,
            messages=None,
            tools=None,
            sampling={
                "temperature": self.sampling.temperature,
                "max_tokens": self.sampling.max_tokens,
                "stop": list(self.sampling.stop),
                "seed": self.sampling.seed,
                "n": n,
            },
        )
        self.tool_names = None


def _single(body: CompletionRequest) -> list[str | list[int]]:
    prompts_ = body.prompts()
    if len(prompts_) != 1:
        raise InvalidRequest("Send one prompt per request; batches of prompts are not supported.")
    if not prompts_[0]:
        raise InvalidRequest("prompt is empty.", param="prompt")
    return prompts_


def _legacy_logprobs(ctx: ServerContext, completion: Completion) -> dict:
    """The ``logprobs`` object of OpenAI's (legacy) completions API."""
    tokens = [ctx.tokenizer.token_text(t) for t in completion.ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    tops = completion.top or [[] for _ in completion.ids]
    return {
        "tokens": tokens,
        "token_logprobs": list(completion.logprobs),
        "top_logprobs": [{ctx.tokenizer.token_text(t): lp for lp, t in top} for top in tops],
        "text_offset": offsets,
    }


async def text_completion(ctx: ServerContext, state: SessionState, body: CompletionRequest) -> dict:
    plan = _Plan(ctx, state, body, await run_temperature(ctx, state))
    completions = await sample_all(ctx, state, plan.sampling, plan.completion_ids)
    answers, served = [], []
    for index, (cid, completion) in enumerate(zip(plan.completion_ids, completions, strict=True)):
        text = outputs.final_text(ctx.tokenizer, completion)
        finish = outputs.finish_reason(completion)
        served.append(Served(cid, completion, {"text": text}, finish))
        answer: dict[str, Any] = {
            "index": index,
            "text": plan.echo + text,
            "logprobs": _legacy_logprobs(ctx, completion) if plan.logprobs else None,
            "finish_reason": finish,
        }
        if body.n > 1:
            answer["completion_id"] = cid
        answers.append(answer)
    await record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
    return {
        "id": plan.request_id,
        "object": "text_completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": answers,
        "usage": outputs.usage(len(plan.prompt.ids), completions),
    }


async def text_completion_stream(
    ctx: ServerContext, state: SessionState, body: CompletionRequest
) -> GuardedStream:
    plan = _Plan(ctx, state, body, await run_temperature(ctx, state))
    return await _stream(ctx, state, plan, body.include_usage)


async def _stream(
    ctx: ServerContext, state: SessionState, plan: _Plan, include_usage: bool
) -> GuardedStream:
    """Start sampling; once the first tokens came (or sampling failed: raised here, so the
    client gets a status code), the events."""
    head = {
        "id": plan.request_id,
        "object": "text_completion",
        "created": plan.created,
        "model": ctx.model_name,
    }
    streamers = [
        outputs.TextStreamer(ctx.tokenizer, plan.sampling.stop) for _ in plan.completion_ids
    ]
    queue: asyncio.Queue[dict] = asyncio.Queue()
    produced = asyncio.Event()

    def choice(index: int, text: str, finish: str | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    async def on_piece(index: int, piece: Any) -> None:
        produced.set()
        text = streamers[index].push(piece.ids)
        if text:
            await queue.put(choice(index, text))

    sampling = asyncio.create_task(
        sample_all(ctx, state, plan.sampling, plan.completion_ids, True, on_piece)
    )
    await first_output(sampling, produced)

    async def events() -> AsyncIterator[str]:
        if plan.echo:
            for index in range(len(streamers)):
                yield sse({**head, "choices": [choice(index, plan.echo)]})
        async for items in drain(sampling, queue):
            yield "".join(sse({**head, "choices": [item]}) for item in items)
        completions = sampling.result()
        served, tail = [], []
        for index, (cid, completion) in enumerate(
            zip(plan.completion_ids, completions, strict=True)
        ):
            text = outputs.final_text(ctx.tokenizer, completion)
            finish = outputs.finish_reason(completion)
            served.append(Served(cid, completion, {"text": text}, finish))
            tail.append(choice(index, streamers[index].finish(completion), finish))
        await record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
        for item in tail:
            yield sse({**head, "choices": [item]})
        if include_usage:
            usage = outputs.usage(len(plan.prompt.ids), completions)
            yield sse({**head, "choices": [], "usage": usage})

    return GuardedStream(events(), sampling)
