"""Sample a plan, record its turns, answer: one path for every surface, streamed or not.

A surface (``chat``, ``completions``; later the Responses API and Anthropic Messages) parses its
request into a ``Plan`` and gives a ``Renderer``: what the client is served of a finished choice
(recorded as the turn's response), the whole answer at once, and the events of a stream. This
module runs the rest once: ``n`` concurrent generations, the streamed text of each choice (stop
strings held back, tool calls split out: ``outputs.ChoiceText``), recording every choice before
the client gets the end of the answer, usage, SSE framing and in-band errors. A stream starts
only once the first tokens came, so a request that fails before that gets a status code.

It knows no surface's shapes; a renderer knows no engines, sessions or store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from server.context import ServerContext
from server.engine_client.client import Piece, joined
from server.errors import ProxrlError
from server.proxy import outputs, versions
from server.proxy.generation import Completion, complete
from server.proxy.plan import Plan
from server.proxy.recording import Served, record
from server.proxy.session_cache import SessionState
from server.proxy.streaming import Final, GuardedStream, Inbox, drain, first_output, sse
from server.proxy.tool_calls import StreamEvent, malformed_blocks

Event = dict[str, Any] | str  # one SSE event's payload: JSON, or a bare string ("[DONE]")


class Renderer(Protocol):
    """How one surface answers one plan. ``index`` is a choice's place in the plan; a finish
    reason is in OpenAI's words (``stop``, ``length``, ``tool_calls``), for a surface to map."""

    named_events: bool  # frame each event with ``event: <its "type">`` (Anthropic, Responses)

    def served(self, completion_id: str, completion: Completion) -> Served:
        """What the client gets of a finished choice: the turn's ``response``."""
        ...

    def response(self, served: list[Served], usage: dict) -> dict:
        """The whole answer, not streamed."""
        ...

    def start(self) -> Sequence[Event]:
        """Events before any token (a head; each choice's opening)."""
        ...

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> Sequence[Event]:
        """Events for newly sampled tokens: ``deltas`` is the text and tool calls that can be
        sent now (possibly none), ``piece`` the tokens with their logprobs."""
        ...

    def finish(self, index: int, deltas: list[StreamEvent], finish_reason: str) -> Sequence[Event]:
        """A choice's last events: what was held back, and how it ended."""
        ...

    def end(self, usage: dict) -> Sequence[Event]:
        """Events after every choice has finished and been recorded."""
        ...

    def error(self, error: ProxrlError) -> Sequence[Event]:
        """An error in the stream (the status, 200, is already sent)."""
        ...

    def closing(self) -> Sequence[Event]:
        """The stream's very last events, after its end or an error."""
        ...


OnPiece = Callable[[int, Piece], None]


async def sample_all(
    ctx: ServerContext,
    state: SessionState,
    plan: Plan,
    stream: bool = False,
    on_piece: OnPiece | None = None,
) -> list[Completion]:
    """One completion per choice, concurrently; ``on_piece(index, piece)`` sees streamed tokens.
    An engine failure propagates as it is (it is an error of ``server.errors``' tree)."""

    adapter = await versions.served(ctx, state, plan.version, plan.version_param)

    async def one(index: int, rid: str) -> Completion:
        handler = (lambda piece: on_piece(index, piece)) if on_piece else None
        return await complete(
            ctx.pool,
            plan.sampling,
            rid,
            prefer=state.engine,
            stream=stream,
            on_piece=handler,
            adapter=adapter,
            loads=ctx.adapter_loads,
        )

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(plan.completion_ids)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # one choice failed: the others are not wanted either
            task.cancel()


async def respond(ctx: ServerContext, state: SessionState, plan: Plan, renderer: Renderer) -> dict:
    """The whole answer at once, once every choice is recorded."""
    completions = await sample_all(ctx, state, plan)
    served = [
        renderer.served(cid, completion)
        for cid, completion in zip(plan.completion_ids, completions, strict=True)
    ]
    count_malformed_calls(ctx, plan, completions)
    await record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
    return renderer.response(served, outputs.usage(len(plan.prompt.ids), completions))


def count_malformed_calls(ctx: ServerContext, plan: Plan, completions: list[Completion]) -> None:
    """Count the ``<tool_call>`` blocks that stayed text (``proxrl_malformed_tool_calls``)."""
    if plan.tool_names is None:
        return
    malformed = sum(
        malformed_blocks(
            plan.forced + outputs.final_text(ctx.tokenizer, completion), plan.tool_names
        )
        for completion in completions
    )
    if malformed:
        ctx.metrics.malformed_tool_calls.labels(plan.log.surface).inc(malformed)


def frame(renderer: Renderer, events: Sequence[Event]) -> str:
    """``events`` as SSE text, one ``data:`` block each (named by its type where the surface
    names its events)."""
    if not renderer.named_events:
        return "".join(sse(event) for event in events)
    return "".join(
        sse(event, event["type"] if isinstance(event, dict) else None) for event in events
    )


async def stream(
    ctx: ServerContext, state: SessionState, plan: Plan, renderer: Renderer
) -> GuardedStream:
    """Start sampling; once the first tokens came (or sampling failed: raised here, so the
    client gets a status code), the events."""
    reasoning = plan.log.surface != "completions"  # text completions answer raw text
    choices = [
        outputs.ChoiceText(
            ctx.tokenizer, plan.sampling.stop, plan.tool_names, reasoning, plan.forced
        )
        for _ in plan.completion_ids
    ]
    inbox = Inbox()  # (index, piece) pairs
    produced = asyncio.Event()

    def on_piece(index: int, piece: Piece) -> None:
        produced.set()
        inbox.put((index, piece))  # rendered by the stream, many pieces at once

    sampling = asyncio.create_task(sample_all(ctx, state, plan, True, on_piece))
    await first_output(sampling, produced)
    closing = frame(renderer, renderer.closing())
    events = _events(ctx, state, plan, renderer, choices, sampling, inbox, closing)
    return GuardedStream(
        events,
        sampling,
        on_error=lambda error: frame(renderer, renderer.error(error)),
        closing=closing,
    )


async def _events(
    ctx: ServerContext,
    state: SessionState,
    plan: Plan,
    renderer: Renderer,
    choices: list[outputs.ChoiceText],
    sampling: asyncio.Task[list[Completion]],
    inbox: Inbox,
    closing: str,
) -> AsyncIterator[str]:
    """The stream: start, the deltas as they come (the first at once, then whatever came within
    the server's ``stream_interval_ms`` in one write, each choice's tokens in one delta), then,
    once every choice is recorded, their finishes, the end and ``closing`` (one write, ``Final``;
    with the last deltas too where the record is done before they are due). The start goes out
    with the first deltas: the first tokens are there when the stream starts
    (``first_output``). An answer of no token at all has no deltas: its start goes out with the
    end, or, when the stream fails first, before the error event (``guarded``)."""
    unsent = frame(renderer, renderer.start())
    due = 0.0  # when ``unsent``'s deltas must be out, by the loop's clock
    try:
        async for batch, deadline in drain(sampling, inbox, ctx.settings.stream_interval_ms / 1000):
            pieces: dict[int, list[Piece]] = {}
            for index, piece in batch:
                pieces.setdefault(index, []).append(piece)
            out = [unsent]
            for index, waiting in pieces.items():
                piece = joined(waiting)
                out.append(
                    frame(renderer, renderer.delta(index, choices[index].push(piece.ids), piece))
                )
            unsent, due = "".join(out), deadline
            if unsent and not sampling.done():  # the last deltas may wait for the end
                yield unsent
                unsent = ""
        completions = sampling.result()
        served: list[Served] = []
        tail: list[Event] = []
        for index, (cid, completion) in enumerate(
            zip(plan.completion_ids, completions, strict=True)
        ):
            served.append(renderer.served(cid, completion))
            choice = choices[index]
            deltas = choice.finish(completion)
            reason = outputs.finish_reason(completion, choice.called)
            tail += renderer.finish(index, deltas, reason)
        count_malformed_calls(ctx, plan, completions)
        recording = asyncio.ensure_future(
            record(ctx.writer, ctx.tokenizer, state, plan.prompt, served, plan.log)
        )
        try:
            if unsent and not await _done_by(recording, due):
                yield unsent  # not kept past their bound for the record's sake
                unsent = ""
            await recording
        finally:
            recording.cancel()  # the client left: as when the record was awaited here
        last = frame(
            renderer, [*tail, *renderer.end(outputs.usage(len(plan.prompt.ids), completions))]
        )
    except Exception:
        if unsent:  # the error event that follows needs the start before it
            yield unsent
        raise
    yield Final(unsent + last + closing)


async def _done_by(task: asyncio.Future, deadline: float) -> bool:
    """Whether ``task`` is done by ``deadline`` (the loop's clock), waiting for it until then."""
    left = deadline - asyncio.get_running_loop().time()
    if not task.done() and left > 0:
        await asyncio.wait({task}, timeout=left)
    return task.done()
