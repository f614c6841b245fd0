"""What one generation request asks for, whatever its surface: the ``Plan``.

A surface's module (``chat``, ``completions``) parses its request into a plan: the prompt's
token ids (and the turn they continue), the sampling settings, one completion id per choice,
what the turn records of the request, and the few things its answer needs (logprobs, tool
names to parse, echoed text). ``answer`` then samples, records and answers any plan the same
way. This module knows nothing of any surface's request or answer shapes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.context import ServerContext
from server.errors import (
    ContextLengthUnknown,
    InvalidRequest,
    ModelNotFound,
    PromptTooLong,
    RunNotFound,
)
from server.proxy import prompts, versions
from server.proxy.generation import SamplingRequest
from server.proxy.prompts import Prompt
from server.proxy.recording import RequestLog
from server.proxy.session_cache import SessionState
from server.store.run_config import RunConfig
from server.text.tokenization import PromptText, TemplateError, TooManyTokens


@dataclass(frozen=True)
class Plan:
    """A validated generation request, ready to sample: ``n`` choices of one prompt."""

    request_id: str
    prompt: Prompt
    sampling: SamplingRequest
    completion_ids: list[str]  # one per choice
    log: RequestLog  # what each turn records of the request
    logprobs: bool  # the answer carries the sampled tokens' logprobs
    tool_names: set[str] | None = None  # None: the text is not parsed for tool calls
    echo: str = ""  # text repeated before each choice's text (text completions' ``echo``)
    # A forced call's start (``forced_calls``): the prompt ends with it, each choice's text
    # begins with it.
    forced: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # HTTP headers the answer carries
    created: int = field(default_factory=lambda: int(time.time()))
    # The version of the session's run it pins (``versions``; None: none), and where it did.
    version: int | None = None
    version_param: str = "model"


def new_plan(  # noqa: PLR0913  # keyword-only: one per field a plan records
    prefix: str,
    prompt: Prompt,
    sampling: SamplingRequest,
    n: int,
    *,
    surface: str,
    model: str | None,
    messages: list[Any] | None = None,
    tools: list[Any] | None = None,
    logprobs: bool = False,
    tool_names: set[str] | None = None,
    echo: str = "",
    forced: str = "",
    headers: dict[str, str] | None = None,
    version: int | None = None,
) -> Plan:
    """A plan with a fresh request id (``prefix-<hex>``) and its choices' completion ids (the
    request id itself when ``n`` is 1, else ``<request id>-<i>``)."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
    log = RequestLog(
        request_id=request_id,
        surface=surface,
        model=model,
        messages=messages,
        tools=tools,
        sampling={
            "temperature": sampling.temperature,
            "max_tokens": sampling.max_tokens,
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "n": n,
        },
    )
    return Plan(
        request_id,
        prompt,
        sampling,
        ids,
        log,
        logprobs,
        tool_names,
        echo,
        forced,
        headers or {},
        version=version,
    )


async def check_model(ctx: ServerContext, state: SessionState, model: str) -> int | None:
    """The version of the session's run the model name pins (``versions.pin_of``), or None.
    Any model name is served (the turn records it), unless the session's run has
    ``strict_model_names``: then only the served model's name and the run's ``model_aliases``
    (or a pin)."""
    config = await run_config(ctx, state)
    names = [ctx.model_name, *config.model_aliases]
    version = versions.pin_of(model, state.run_id, names)
    if (
        version is None
        and config.strict_model_names
        and not answers_to(config, ctx.model_name, model)
    ):
        raise ModelNotFound(model, names)
    return version


def answers_to(config: RunConfig, served: str, model: str) -> bool:
    return model == served or model in config.model_aliases


async def build_prompt(
    ctx: ServerContext, state: SessionState, render: Callable[[], PromptText | str], param: str
) -> Prompt:
    """The prompt ``render`` writes, tokenized and continuing the session's last turn when it
    can (``prompts.splice``), all on a prompt thread (``prompts.off_loop``): a long prompt
    holds no other request. A text too long for the context is refused before it is
    tokenized (``refuse_oversize``)."""
    last = list(state.last)

    def work() -> Prompt:
        text = render()
        refuse_oversize(ctx, len(text if isinstance(text, str) else text.text), param)
        return spliced(ctx, text, last, param)

    return await prompts.off_loop(work)


def rendered(
    ctx: ServerContext, messages: list[dict], tools: list[dict] | None, client: str, param: str
) -> PromptText:
    """The conversation as the chat template renders it for an answer, the client's added
    tokens' texts kept as text unless ``client`` (the run's ``client_special_tokens``) is
    "parse"; the template's refusal is a 400 at ``param``."""
    try:
        return ctx.tokenizer.render_prompt(messages, tools, True, client)
    except TemplateError as exc:
        raise InvalidRequest(f"The chat template refused the {param}: {exc}", param) from exc


def spliced(ctx: ServerContext, text: PromptText | str, last: list[Any], param: str) -> Prompt:
    """``prompts.splice`` of ``text``, refused when it has more tokens than the context."""
    context = ctx.context_length
    try:
        return prompts.splice(ctx.tokenizer, text, last, context)
    except TooManyTokens as exc:
        raise PromptTooLong(
            f"The prompt has {exc.tokens} tokens; the model's context is {context}.", param=param
        ) from None


def refuse_oversize(ctx: ServerContext, characters: int, param: str) -> None:
    """Refuse a prompt of more ``characters`` than the context's tokens can hold: no token of
    the vocabulary stands for more than ``max_chars_per_token`` characters, so such a text is
    over the context however it tokenizes. (Tokenizing megabytes takes seconds and memory.)"""
    context = ctx.context_length
    if context is None:
        return  # sampling_request refuses it
    most = ctx.tokenizer.max_chars_per_token
    if characters > context * most:
        raise PromptTooLong(
            f"The prompt has {characters:,} characters; the model's context is {context:,} "
            f"tokens, which hold at most {context * most:,} ({most} a token at most).",
            param=param,
        )


def sampling_request(
    ctx: ServerContext,
    prompt_ids: list[int],
    limit: int | None,
    body: Any,
    top_logprobs: int,
    config: RunConfig,
) -> SamplingRequest:
    """Sampling settings, with max tokens cut to the run's ``max_completion_tokens`` and then
    checked against the context length (the engines' smallest; the pool routes only to engines
    that reported theirs); a request that gives no temperature is sampled at the run's."""
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
    if config.max_completion_tokens is not None:
        max_tokens = min(max_tokens, config.max_completion_tokens)
    if max_tokens > room:
        raise PromptTooLong(
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt_ids)} and {max_tokens} were asked for the completion.",
            param="max_tokens",
        )
    temperature = config.temperature if body.temperature is None else body.temperature
    return SamplingRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(temperature),
        stop=body.stops,
        seed=body.seed,
        top_logprobs=top_logprobs,
    )


# The header of an answer to a request for structured output that was sampled unconstrained.
RESPONSE_FORMAT_HEADER = "X-Proxrl-Response-Format"
STRUCTURED = ("json_object", "json_schema")


async def structured_output(
    ctx: ServerContext, state: SessionState, kind: Any, param: str
) -> dict[str, str]:
    """The headers of an answer to a request for output of ``kind`` (``text``: none; Chat
    Completions' ``response_format.type``, Responses' ``text.format.type``), by its run's
    ``response_format`` policy: refused, or sampled unconstrained and said so. proxrl never
    constrains decoding, so the logprobs it stores are always the policy's."""
    if kind == "text":
        return {}
    if kind not in STRUCTURED:
        raise InvalidRequest(
            f"{param} type {kind!r} is not supported; use text, json_object or json_schema.", param
        )
    if (await run_config(ctx, state)).response_format == "refuse":
        raise InvalidRequest(
            f"{param} {kind!r} (structured output) would need constrained decoding, which proxrl "
            "does not do; this run refuses it. A run with response_format 'unconstrained' "
            "serves it sampled as any answer (PATCH /rl/runs/{id} config).",
            param=param,
        )
    return {RESPONSE_FORMAT_HEADER: "unconstrained"}


async def run_config(ctx: ServerContext, state: SessionState) -> RunConfig:
    """The config of the session's run (kept in memory for a moment: ``ctx.run_configs``)."""
    config = await ctx.run_configs.get(state.run_id)
    if config is None:  # the run of a live session is never deleted
        raise RunNotFound(state.run_id)
    return config
