"""``tool_choice`` "required" and a named function on Chat Completions and the Responses API,
in-process, through the real ``openai`` SDK: the call is started in the prompt (the forced start
is prompt tokens, stored with the prompt), the turn's completion tokens and logprobs are exactly
what was sampled, the answer is read for tool calls from the forced start on (a call that
parses is served as a call, anything else as text, forced start included), streamed or not;
refusals are 400s in OpenAI's shape with nothing stored. The reading itself, however a sampled
continuation is chunked, is held to the parse (hypothesis)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from server.engine_client.client import Piece
from server.proxy.anthropic import MessagesRenderer
from server.proxy.anthropic_schemas import MessagesRequest
from server.proxy.chat import ChatRenderer
from server.proxy.forced_calls import forced_start
from server.proxy.generation import Completion, SamplingRequest
from server.proxy.outputs import ChoiceText, finish_reason
from server.proxy.plan import Plan, new_plan
from server.proxy.prompts import Prompt
from server.proxy.responses_render import ResponsesRenderer
from server.proxy.responses_schema import ResponseRequest
from server.proxy.tool_calls import ContentDelta, ParsedOutput, ToolCallDelta, parse_tool_calls
from server.text.tokenization import Tokenizer
from tests.api.api_support import Api, assert_error, streamed_chat

MODEL = "gpt-5.6-luna"
CALC = "calculator"
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": CALC,
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
]
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
GENERATION_PROMPT = "<|im_start|>assistant\n"
ANY_START = "<tool_call>\n"
NAMED_START = '<tool_call>\n{"name": "calculator", "arguments":'


@pytest.fixture(scope="module")
def tokenizer(api: Api) -> Tokenizer:
    return Tokenizer.from_pretrained(api.model_dir)


def forced_turn(
    api: Api, tokenizer: Tokenizer, session: dict, start: str, usage: tuple[int, int]
) -> tuple[dict, ParsedOutput]:
    """The session's one turn, checked: the stored prompt ends with the generation prompt, then
    the forced start; every sampled token has its logprob; ``usage`` (prompt, completion tokens
    served) counts them. With the parse of the forced start + the sampled text, which is what
    the answer must read as."""
    (turn,) = api.session(session["session_id"])["turns"]
    assert tokenizer.decode(turn["prompt_ids"], False).endswith(GENERATION_PROMPT + start)
    assert len(turn["logprobs"]) == len(turn["completion_ids"]) > 0
    assert usage == (len(turn["prompt_ids"]), len(turn["completion_ids"]))
    sampled = tokenizer.decode(turn["completion_ids"])
    return turn, parse_tool_calls(start + sampled, {CALC, "clock"})


# ----- Chat Completions ---------------------------------------------------------------------


CHAT_CHOICES = {
    "required": ("required", ANY_START),
    "named": ({"type": "function", "function": {"name": CALC}}, NAMED_START),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(CHAT_CHOICES))
def test_a_forced_chat_call_starts_in_the_prompt_and_stores_what_was_sampled(
    api: Api, tokenizer: Tokenizer, case: str, stream: bool
):
    choice, start = CHAT_CHOICES[case]
    session = api.new_session(task_id=f"chat-forced-{case}")
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "tools": CHAT_TOOLS,
        "tool_choice": choice,
        "max_tokens": 24,
        "logprobs": True,
        "seed": 7,
    }
    sdk = api.openai(session["api_key"])
    if stream:
        chunks = list(
            sdk.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
        content, logprobs = streamed_chat(chunks)
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        served = [(call.function.name, call.function.arguments) for call in calls]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        answer = sdk.chat.completions.create(**request)
        usage, message = answer.usage, answer.choices[0].message
        content = message.content or ""
        served = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        logprobs = [entry.logprob for entry in answer.choices[0].logprobs.content or []]
        finish = answer.choices[0].finish_reason

    turn, parsed = forced_turn(
        api, tokenizer, session, start, (usage.prompt_tokens, usage.completion_tokens)
    )
    assert logprobs == turn["logprobs"]  # only the sampled tokens, each with its logprob
    # What the client got is what the turn records, and the parse of the forced start + the
    # sampled text.
    stored = turn["response"]
    assert (stored.get("content") or "") == content
    stored_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in stored.get("tool_calls", [])
    ]
    assert stored_calls == served
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == served
    assert content == (parsed.content or "")
    for name, arguments in served:
        assert name in {CALC, "clock"} and isinstance(json.loads(arguments), dict)
    if case == "named" and served:
        assert {name for name, _ in served} == {CALC}
    assert finish == ("tool_calls" if served else turn["finish_reason"])


def test_a_forced_chat_call_that_parses_is_served_as_a_call(api: Api, tokenizer: Tokenizer):
    """A named function's start + a sampled ``{}}</tool_call>``: n choices of a long enough
    answer, the forced start is never sampled; any choice whose text closes the call is a call
    of the named tool (arguments a JSON object), and the rest is text that begins with the
    forced start."""
    session = api.new_session(task_id="chat-forced-n")
    answer = api.openai(session["api_key"]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Use the calculator."}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": CALC}},
        max_tokens=8,
        n=3,
    )
    turns = api.session(session["session_id"])["turns"]
    assert len(turns) == 3
    for choice in answer.choices:
        message = choice.message
        if message.tool_calls:
            assert {c.function.name for c in message.tool_calls} == {CALC}
            assert choice.finish_reason == "tool_calls"
        else:
            assert (message.content or "").startswith(NAMED_START.strip())


# ----- the Responses API --------------------------------------------------------------------


RESPONSE_CHOICES = {
    "required": ("required", ANY_START),
    "named": ({"type": "function", "name": CALC}, NAMED_START),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(RESPONSE_CHOICES))
def test_a_forced_response_call_starts_in_the_prompt_and_stores_what_was_sampled(
    api: Api, tokenizer: Tokenizer, case: str, stream: bool
):
    choice, start = RESPONSE_CHOICES[case]
    session = api.new_session(task_id=f"responses-forced-{case}")
    request = {
        "model": MODEL,
        "input": "What is 2 + 3?",
        "tools": RESPONSE_TOOLS,
        "tool_choice": choice,
        "max_output_tokens": 24,
    }
    sdk = api.openai(session["api_key"])
    if stream:
        events = list(sdk.responses.create(**request, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        response = events[-1].response
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [item.model_dump() for item in done] == [
            item.model_dump() for item in response.output
        ]
    else:
        response = sdk.responses.create(**request)
    usage = (response.usage.input_tokens, response.usage.output_tokens)
    turn, parsed = forced_turn(api, tokenizer, session, start, usage)
    assert turn["response"] == response.to_dict()  # what the client got
    assert turn["response"]["tool_choice"] == choice
    calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    assert calls == [(c.name, c.arguments) for c in parsed.tool_calls]
    text = "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )
    assert text == (parsed.content or "")
    if not calls:
        assert text.startswith(start.strip())


# ----- refusals -----------------------------------------------------------------------------


CHAT_REFUSALS = {
    "required without tools": {"tool_choice": "required"},
    "a function not among the tools": {
        "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    },
    "allowed_tools": {
        "tools": CHAT_TOOLS,
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required"}},
    },
    "a custom tool choice": {
        "tools": CHAT_TOOLS,
        "tool_choice": {"type": "custom", "custom": {"name": CALC}},
    },
}


@pytest.mark.parametrize("case", sorted(CHAT_REFUSALS))
def test_a_chat_tool_choice_that_cannot_be_honoured_is_a_400_naming_it(api: Api, case: str):
    session = api.new_session(task_id="chat-forced-refused")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = api.call(
        "POST", "/v1/chat/completions", key=session["api_key"], json=body | CHAT_REFUSALS[case]
    )
    error = assert_error(reply, 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", "tool_choice")
    assert api.session(session["session_id"])["turns"] == []


RESPONSE_REFUSALS = {
    "required without tools": {"tool_choice": "required"},
    "required with only hosted tools": {
        "tools": [{"type": "web_search"}],
        "tool_choice": "required",
    },
    "a function not among the tools": {
        "tools": RESPONSE_TOOLS,
        "tool_choice": {"type": "function", "name": "nope"},
    },
    "a hosted tool": {"tools": RESPONSE_TOOLS, "tool_choice": {"type": "web_search_preview"}},
    "a custom choice naming a function tool": {
        "tools": RESPONSE_TOOLS,
        "tool_choice": {"type": "custom", "name": CALC},
    },
    "a function choice naming a custom tool": {
        "tools": [*RESPONSE_TOOLS, {"type": "custom", "name": "apply_patch"}],
        "tool_choice": {"type": "function", "name": "apply_patch"},
    },
    "a function choice without a name": {
        "tools": RESPONSE_TOOLS,
        "tool_choice": {"type": "function"},
    },
}


@pytest.mark.parametrize("case", sorted(RESPONSE_REFUSALS))
def test_a_response_tool_choice_that_cannot_be_honoured_is_a_400_naming_it(api: Api, case: str):
    session = api.new_session(task_id="responses-forced-refused")
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2} | RESPONSE_REFUSALS[case]
    with pytest.raises(openai.BadRequestError) as caught:
        api.openai(session["api_key"]).responses.create(**body)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "tool_choice"
    assert "None" not in error["message"], error
    assert api.session(session["session_id"])["turns"] == []


def test_a_template_without_tool_call_markup_refuses_a_forced_call(tokenizer: Tokenizer):
    """The forced start is ``<tool_call>``: a model whose template writes calls otherwise (or
    none) cannot be forced, and the refusal names the parameter."""
    from server.errors import InvalidRequest

    class NoToolMarkup:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    with pytest.raises(InvalidRequest) as caught:
        forced_start(NoToolMarkup(), None, "required", "tool_choice")  # type: ignore[arg-type]
    assert caught.value.param == "tool_choice"
    assert forced_start(tokenizer, None, "required", "tool_choice") == ANY_START
    assert forced_start(tokenizer, CALC, "function", "tool_choice") == NAMED_START


# ----- the reading, however the sampled text comes ----------------------------------------


NAMES = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda name: "</tool_call>" not in name)
ARGUMENTS = st.dictionaries(
    st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8), st.booleans()), max_size=3
)


@settings(max_examples=60, deadline=None)
@given(
    name=NAMES,
    arguments=ARGUMENTS,
    named=st.booleans(),
    after=st.sampled_from(["", " done", "\n<tool_call>\nnot json</tool_call>"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_a_forced_start_and_any_chunking_of_the_rest_read_as_the_parse(
    tokenizer: Tokenizer, name: str, arguments: dict, named: bool, after: str, cuts: list[int]
):
    """The forced start (any tool's, or ``name``'s, JSON-escaped) + a continuation the model
    could sample: streamed in any chunks through ``ChoiceText`` it gives the calls and content
    of the parse of the whole text, and a well-formed continuation is one call of ``name``
    with ``arguments``."""
    start = forced_start(tokenizer, name if named else None, "required", "tool_choice")
    body = json.dumps(arguments, ensure_ascii=False)
    if named:
        rest = f" {body}}}\n</tool_call>{after}"
    else:
        rest = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        rest += f"\n</tool_call>{after}"
    parsed = parse_tool_calls(start + rest, {name})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(name, arguments)]

    ids = tokenizer.encode(rest)
    bounds = sorted({min(cut, len(ids)) for cut in cuts} | {0, len(ids)})
    stream = ChoiceText(tokenizer, (), {name}, reasoning=True, forced=start)
    events = []
    for low, high in itertools.pairwise(bounds):
        events += stream.push(ids[low:high])
    completion = Completion(prompt_ids=[], ids=ids, finish_reason={"type": "stop"})
    events += stream.finish(completion)
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallDelta)]
    assert calls == [(c.name, c.arguments) for c in parsed.tool_calls]
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == (parsed.content or "") and stream.called


# ----- a forced call the model completes, on every surface's renderer ------------------------


def _plan(surface: str, names: set[str], forced: str) -> Plan:
    sampling = SamplingRequest(prompt_ids=[1, 2, 3], max_tokens=64)
    return new_plan(
        "x",
        Prompt([1, 2, 3], None),
        sampling,
        1,
        surface=surface,
        model="m",
        tool_names=names,
        forced=forced,
    )


def _drive(renderer, plan: Plan, tokenizer: Tokenizer, rest: str, stream: bool) -> tuple:
    """What ``answer`` does with a completion of ``rest``: token by token through the stream
    events (ChoiceText, as ``answer.stream`` builds it), or at once; the served response."""
    ids = tokenizer.encode(rest)
    completion = Completion([1, 2, 3], ids, [-0.5] * len(ids), [], [0] * len(ids), {"type": "stop"})
    if not stream:
        return renderer.served(plan.request_id, completion), []
    choice = ChoiceText(tokenizer, (), plan.tool_names, True, plan.forced)
    events = list(renderer.start())
    for token in ids:
        piece = Piece(ids=[token], logprobs=[-0.5], top=[], versions=["0"])
        events += renderer.delta(0, choice.push([token]), piece)
    served = renderer.served(plan.request_id, completion)
    deltas = choice.finish(completion)
    events += renderer.finish(0, deltas, finish_reason(completion, choice.called))
    return served, events


@pytest.mark.parametrize("stream", [False, True])
def test_a_completed_forced_call_is_served_as_a_call_on_every_surface(
    tokenizer: Tokenizer, stream: bool
):
    """The forced start + what a model that completes the call samples: Chat Completions serves
    a ``tool_calls`` entry, the Responses API a ``custom_tool_call`` item for a custom tool (raw
    input) and Anthropic a ``tool_use`` block; streamed or not, the same call, parsed from the
    start + the sampled text alone (the start was never sampled)."""
    ctx = SimpleNamespace(tokenizer=tokenizer, model_name="tiny", metrics=None, context_length=2048)
    named = forced_start(tokenizer, CALC, "function", "tool_choice")

    chat_plan = _plan("chat", {CALC, "clock"}, named)
    served, events = _drive(
        ChatRenderer(ctx, chat_plan, False),  # type: ignore[arg-type]
        chat_plan,
        tokenizer,
        ' {"expression": "2+3"}}\n</tool_call>',
        stream,
    )
    (call,) = served.response["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        CALC,
        {"expression": "2+3"},
    )
    assert served.finish_reason == "tool_calls"
    if stream:
        streamed = [
            t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls", [])
        ]
        assert [t["function"] for t in streamed] == [call["function"]]
        assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "tool_calls"

    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files."}
    body = ResponseRequest.model_validate(
        {
            "model": "m",
            "input": "hi",
            "tools": [patch],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
        }
    )
    start = forced_start(tokenizer, *body.forced_tool(), "tool_choice")  # type: ignore[misc]
    responses_plan = _plan("responses", body.tool_names(), start)
    renderer = ResponsesRenderer(ctx, responses_plan, body)  # type: ignore[arg-type]
    served, events = _drive(
        renderer,
        responses_plan,
        tokenizer,
        ' {"input": "*** Begin Patch\\n*** End Patch"}}\n</tool_call>',
        stream,
    )
    (item,) = Response.model_validate(served.response).output
    assert (item.type, item.name, item.input) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch\n*** End Patch",
    )
    if stream:
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == served.response["output"]

    any_start = forced_start(tokenizer, None, "any", "tool_choice")
    message = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": CALC, "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stream": stream,
        }
    )
    messages_plan = _plan("messages", {CALC}, any_start)
    renderer = MessagesRenderer(ctx, messages_plan, message)  # type: ignore[arg-type]
    served, events = _drive(
        renderer,
        messages_plan,
        tokenizer,
        '{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>',
        stream,
    )
    (block,) = served.response["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", CALC, {"expression": "1"})
    assert served.response["stop_reason"] == "tool_use"
