"""``/v1/responses`` (OpenAI's Responses API): a request into a plan; stored responses.

A response is a turn: its ``completion_id`` is the response id (``resp_...``), its ``messages``
the request's input items as received, its ``response`` the Response object the client got
(output items, usage, ``previous_response_id``, ``store``). So a stored response lives as long
as the trajectory store, across restarts of the proxy, and ``previous_response_id`` rebuilds the
conversation from the chain of turns (each one's input items then its output items, oldest
first) before the request's own items; rendered with the chat template, that prompt extends
the previous turn token for token, so the chain is one training row.

Hosted tools (``web_search``, ``tool_search``, ...: OpenAI runs them, the engine cannot) follow
the run's ``hosted_tools``: ``omit`` leaves them out of the prompt and records their types on
the turn (``sampling.omitted_tools``); once the answer is served they are counted
(``proxrl_hosted_tools_omitted``: a request refused or failed on the way counts nothing).
``refuse`` answers 400 naming the first.

A response created with ``store: false``, or deleted, is not retrievable or chainable (404); its
turn stays in the store for training. Sampling, recording and streaming are ``answer``'s; what
the answer and its events look like is ``responses_render``'s.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from server.context import ServerContext
from server.errors import InvalidRequest, ResponseNotFound
from server.proxy import forced_calls, prompts
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
from server.proxy.responses_schema import ResponseRequest, to_messages
from server.proxy.session_cache import SessionState
from server.store import turns as store_turns
from server.store.tables import Turn
from server.text.tokenization import PromptText

MAX_CHAIN = 10_000  # responses one previous_response_id chain may reach back through


async def plan_response(ctx: ServerContext, state: SessionState, body: ResponseRequest) -> Plan:
    config = await run_config(ctx, state)
    version = await check_model(ctx, state, body.model)
    body.refuse_unsupported()
    headers = await structured_output(ctx, state, body.format_type, "text.format")
    forced = body.forced_tool()
    omitted = await _hosted_tools(ctx, state, body)
    items = body.items()
    history = await _chain(ctx, state, body.previous_response_id)
    if history:  # the prompt holds the stored chain too: its size is not the body's
        prompts.REQUEST_BYTES.set(None)
    messages = to_messages([*history, *items])
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    tools = body.template_tools()
    start = forced_calls.forced_start(ctx.tokenizer, *forced, "tool_choice") if forced else ""
    client = config.client_special_tokens

    def render() -> PromptText:
        text = rendered(ctx, messages, tools, client, "input")
        return ctx.tokenizer.client_text(text, start, client)

    prompt = await build_prompt(ctx, state, render, "input")
    limit = body.max_output_tokens
    sampling = sampling_request(ctx, prompt.ids, limit, body, 0, config)
    parse_tools = tools is not None and body.tool_choice != "none"
    plan = new_plan(
        "resp",
        prompt,
        sampling,
        1,
        surface="responses",
        model=body.model,
        version=version,
        messages=items,
        tools=tools,
        forced=start,
        headers=headers,
        tool_names=body.tool_names() if parse_tools else None,
    )
    response_id = f"resp_{uuid.uuid4().hex}"  # OpenAI's form of id
    log = replace(plan.log, request_id=response_id)
    if omitted:  # counted once the answer is served (responses_render)
        log = replace(log, sampling={**log.sampling, "omitted_tools": omitted})
    return replace(plan, request_id=response_id, completion_ids=[response_id], log=log)


async def _hosted_tools(
    ctx: ServerContext, state: SessionState, body: ResponseRequest
) -> list[str]:
    """Apply the run's ``hosted_tools`` policy: refuse the request, or the types of the hosted
    tools to leave out of the prompt."""
    hosted = body.hosted_tools()
    if not hosted:
        return []
    if (await run_config(ctx, state)).hosted_tools == "refuse":
        param, kind = hosted[0]
        raise InvalidRequest(
            f"Tools of type {kind!r} are hosted tools, which proxrl's engine cannot run, and "
            "this run refuses them (hosted_tools: refuse); leave them out, or set the run's "
            "hosted_tools to omit.",
            param=param,
        )
    return [kind for _, kind in hosted]


async def _chain(
    ctx: ServerContext, state: SessionState, response_id: str | None
) -> list[dict[str, Any]]:
    """The items of the conversation ``response_id`` ends: every response's input items and
    output items along its chain, oldest first."""
    links: list[list[dict[str, Any]]] = []  # newest first
    seen = 0
    async with ctx.sessionmaker() as db:
        while response_id is not None:
            turn = await store_turns.session_turn(db, state.id, response_id)
            stored = _retrievable(turn)
            if stored is None or seen >= MAX_CHAIN:
                raise ResponseNotFound(response_id, param="previous_response_id")
            assert turn is not None
            links.append([*(turn.messages or []), *stored.get("output", [])])
            response_id = stored.get("previous_response_id")
            seen += 1
    return [item for link in reversed(links) for item in link]


def _retrievable(turn: Turn | None) -> dict[str, Any] | None:
    """The stored Response of a responses turn that was stored and not deleted."""
    if turn is None or turn.surface != "responses":
        return None
    response = turn.response or {}
    if response.get("store") is False or response.get("deleted"):
        return None
    return response


async def stored_response(ctx: ServerContext, state: SessionState, response_id: str) -> dict:
    """The Response object as the client got it (``GET /v1/responses/{id}``)."""
    async with ctx.sessionmaker() as db:
        stored = _retrievable(await store_turns.session_turn(db, state.id, response_id))
    if stored is None:
        raise ResponseNotFound(response_id)
    return stored


async def delete_response(ctx: ServerContext, state: SessionState, response_id: str) -> dict:
    """Make a response unretrievable and unchainable; its turn and tokens stay for training
    (the turn's ``response`` gains ``"deleted": true``)."""
    async with ctx.sessionmaker() as db:
        turn = await store_turns.session_turn(db, state.id, response_id)
        stored = _retrievable(turn)
        if stored is None or turn is None:
            raise ResponseNotFound(response_id)
        await store_turns.replace_response(db, turn.id, {**stored, "deleted": True})
        await db.commit()
    return {"id": response_id, "object": "response", "deleted": True}
