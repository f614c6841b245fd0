"""The Responses API as the Codex CLI (0.169.0) speaks it, in-process: request bodies shaped like
the ones it was captured sending (its long instructions replaced by placeholders), its headers;
``custom`` tools (free-form input) in the prompt, in input items and out as
``custom_tool_call`` items, streamed as their own events (validated with the openai SDK's
types); ``namespace`` tools flattened; hosted tools (``web_search``, ``tool_search``) left out and
counted, or refused, per the run's ``hosted_tools``; every refusal in OpenAI's shape with
nothing stored. The parse of free-form calls, however chunked, is held to the text (hypothesis).
"""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from server.engine_client.client import Piece
from server.proxy.generation import Completion, SamplingRequest
from server.proxy.outputs import ChoiceText, finish_reason, usage
from server.proxy.plan import new_plan
from server.proxy.prompts import Prompt
from server.proxy.responses_render import ResponsesRenderer
from server.proxy.responses_schema import ResponseRequest
from server.proxy.tool_calls import (
    ToolCallDelta,
    ToolCallStream,
    ToolNames,
    free_form_arguments,
    free_form_input,
    malformed_blocks,
    parse_tool_calls,
)
from tests.api.api_support import NO_KEY, Api, assert_error

EVENTS = {
    get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in get_args(get_args(ResponseStreamEvent)[0])
}
GRAMMAR = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n%import common.LF\n'
)
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string", "description": "Shell command to execute."}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
TOOL_SEARCH = {
    "type": "tool_search",
    "execution": "client",
    "description": "Searches over deferred tool metadata.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}
WEB_SEARCH = {"type": "web_search", "external_web_access": True, "search_content_types": ["text"]}
# What Codex offers with a model it has no metadata for ("tiny"): its sub-agent tools in a
# namespace, and no apply_patch.
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        }
    ],
}
PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+hi "there" \\ ünï\n*** End Patch\n'
HEADERS = {  # what Codex sends besides its key (ids shortened)
    "originator": "codex_exec",
    "user-agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)",
    "session-id": "01a2162c-5240",
    "thread-id": "01a2162c-5240",
    "x-client-request-id": "01a2162c-5240",
    "x-codex-window-id": "01a2162c-5240:0",
    "x-codex-beta-features": "remote_compaction_v2",
    "x-codex-turn-metadata": '{"request_kind":"turn","turn_trigger":"exec"}',
    "accept": "text/event-stream",
}


def message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


OPENING = [
    message("developer", "<Codex's instructions: a placeholder>"),
    message("developer", "<skills_instructions>a placeholder</skills_instructions>"),
    message("user", "<environment_context>\n  <cwd>/tmp/work</cwd>\n</environment_context>"),
    message("user", "Run ls"),
]


def codex_body(**overrides: Any) -> dict[str, Any]:
    """A request as Codex's default path sends it (with a known model name: apply_patch,
    tool_search and web_search among its tools); bounded output, which Codex does not send."""
    return {
        "model": "gpt-5.5",
        "stream": True,
        "input": OPENING,
        "tools": [EXEC, APPLY_PATCH, TOOL_SEARCH, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2162c-5240",
        "text": {"verbosity": "low"},
        "client_metadata": {"x-codex-turn-metadata": "{}", "session_id": "01a2162c-5240"},
        "max_output_tokens": 8,
        **overrides,
    }


def post(api: Api, session: dict, body: dict) -> Any:
    return api.call("POST", "/v1/responses", key=session["api_key"], headers=HEADERS, json=body)


def named_events(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            EVENTS[event["type"]].model_validate(event)
            events.append(event)
    return events


def omitted_count(api: Api, kind: str) -> float:
    text = api.call("GET", "/metrics", key=NO_KEY).text
    found = re.search(rf'^proxrl_hosted_tools_omitted_total\{{type="{kind}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def turns(api: Api, session: dict) -> list[dict]:
    return api.session(session["session_id"])["turns"]


def prompt_text(api: Api, turn: dict) -> str:
    return api.http.app.state.ctx.tokenizer.decode(turn["prompt_ids"])


# ----- Codex's requests, end to end ------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_codexs_first_request_is_answered_with_hosted_tools_left_out_and_counted(
    api: Api, stream: bool
):
    session = api.new_session(task_id="codex")
    before = {kind: omitted_count(api, kind) for kind in ("web_search", "tool_search")}
    reply = post(api, session, codex_body(stream=stream))
    assert reply.status_code == 200, reply.text
    if stream:
        events = named_events(reply.text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created"
        final = events[-1]["response"]
    else:
        final = reply.json()
    response = Response.model_validate(final)
    assert response.store is False and response.status in ("completed", "incomplete")
    assert [tool["type"] for tool in final["tools"]] == [
        "function",
        "custom",
        "tool_search",
        "web_search",
    ]  # the tools as sent

    (turn,) = turns(api, session)
    assert turn["response"] == final and turn["model"] == "gpt-5.5"
    assert turn["sampling"]["omitted_tools"] == ["tool_search", "web_search"]
    apply_patch = {
        "type": "function",
        "function": {
            "name": "apply_patch",
            "description": APPLY_PATCH["description"],
            "parameters": {
                "type": "object",
                "properties": {
                    "input": {
                        "type": "string",
                        "description": "The raw text of the call, following this lark "
                        f"grammar:\n{GRAMMAR}",
                    }
                },
                "required": ["input"],
                "additionalProperties": False,
            },
        },
    }
    exec_command = {
        "type": "function",
        "function": {k: EXEC[k] for k in ("name", "description", "parameters")},
    }
    assert turn["tools"] == [exec_command, apply_patch]  # what the model saw
    prompt = prompt_text(api, turn)
    assert '"name": "apply_patch"' in prompt and "web_search" not in prompt
    assert "tool_search" not in prompt
    for kind in ("web_search", "tool_search"):
        assert omitted_count(api, kind) == before[kind] + 1
    # store: false: not retrievable, still recorded for training.
    assert_error(api.call("GET", f"/v1/responses/{final['id']}", key=session["api_key"]), 404)


def test_codexs_namespace_tools_are_flattened_into_the_prompt(api: Api):
    session = api.new_session(task_id="codex-namespace")
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "close_agent",
        "namespace": "multi_agent_v1",
        "arguments": '{"target": "a1"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "closed"}
    body = codex_body(model="tiny", tools=[EXEC, NAMESPACE, WEB_SEARCH])
    reply = post(api, session, {**body, "input": [*OPENING, call, output]})
    assert reply.status_code == 200, reply.text
    (turn,) = turns(api, session)
    assert [tool["function"]["name"] for tool in turn["tools"]] == ["exec_command", "close_agent"]
    assert turn["sampling"]["omitted_tools"] == ["web_search"]
    prompt = prompt_text(api, turn)
    assert '{"name": "close_agent", "arguments": {"target": "a1"}}' in prompt


def test_a_forced_custom_tool_is_served_as_custom_calls_only(api: Api):
    """tool_choice naming a custom tool starts its call in the prompt (forced_calls); whatever
    the model then samples, a call it completes is a custom_tool_call, never a function_call."""
    session = api.new_session(task_id="codex-forced-custom")
    choice = {"type": "custom", "name": "apply_patch"}
    reply = post(api, session, codex_body(tool_choice=choice, max_output_tokens=24))
    assert reply.status_code == 200, reply.text
    final = named_events(reply.text)[-1]["response"]
    Response.model_validate(final)
    assert not [item for item in final["output"] if item["type"] == "function_call"]
    for item in final["output"]:
        assert item["type"] in ("message", "custom_tool_call")
    (turn,) = turns(api, session)
    assert prompt_text(api, turn).endswith('<tool_call>\n{"name": "apply_patch", "arguments":')


def test_codex_resending_the_whole_history_with_tool_items_extends_the_row(api: Api):
    """store: false, so Codex sends every item again: the answer it got (as an assistant
    message), its calls and their outputs, function and custom; the prompt renders a custom
    call as the one ``input`` argument the model passes, and each request extends the last."""
    session = api.new_session(task_id="codex-history")
    first = post(api, session, codex_body(stream=False)).json()
    answered = [
        {**item, "content": [{**part, "annotations": []} for part in item["content"]]}
        for item in first["output"]
        if item["type"] == "message"
    ]
    history = [
        *OPENING,
        *answered,
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {
            "type": "function_call",
            "id": "fc_1",
            "status": "completed",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd": "ls"}',  # as proxrl served it
        },
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "a.txt\n"},
        {
            "type": "custom_tool_call",
            "id": "ctc_1",
            "status": "completed",
            "call_id": "call_2",
            "name": "apply_patch",
            "input": PATCH,
        },
        {
            "type": "custom_tool_call_output",
            "id": "ctco_1",
            "call_id": "call_2",
            "output": "Exit code: 0\nSuccess. Updated the following files:\nA hello.txt\n",
        },
    ]
    second = post(api, session, codex_body(stream=False, input=history))
    assert second.status_code == 200, second.text
    one, two = turns(api, session)
    prompt = prompt_text(api, two)
    call = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}, ensure_ascii=False)
    assert f"<tool_call>\n{call}\n</tool_call>" in prompt
    assert "Success. Updated the following files" in prompt
    assert '{"name": "exec_command", "arguments": {"cmd": "ls"}}' in prompt
    assert two["messages"] == history
    assert two["prompt_ids"][: len(one["prompt_ids"])] == one["prompt_ids"]
    view = api.session(session["session_id"])
    assert (view["row_count"], view["breaks"]) == (1, 0)
    assert two["prompt_ids"][: len(one["prompt_ids"]) + len(one["completion_ids"])] == (
        one["prompt_ids"] + one["completion_ids"]
    )


# ----- the hosted-tools policy -----------------------------------------------------------------


def test_a_run_that_refuses_hosted_tools_answers_400_naming_the_tool(api: Api):
    session = api.session_of_run({"hosted_tools": "refuse"}, patch=False, task_id="codex-refuse")
    error = assert_error(post(api, session, codex_body()), 400)
    assert error["param"] == "tools.2.type" and "'tool_search'" in error["message"]
    assert "hosted_tools" in error["message"]
    assert turns(api, session) == []
    # Without hosted tools the same run serves it, custom tool and all.
    reply = post(api, session, codex_body(stream=False, tools=[EXEC, APPLY_PATCH]))
    assert reply.status_code == 200, reply.text
    (turn,) = turns(api, session)
    assert "omitted_tools" not in turn["sampling"]


def test_hosted_tools_is_a_checked_run_setting(api: Api):
    run = api.new_run()
    assert run["config"]["hosted_tools"] == "omit"  # the default
    reply = api.call("PATCH", f"/rl/runs/{run['id']}", json={"config": {"hosted_tools": "run"}})
    assert 400 <= reply.status_code < 500 and "hosted_tools" in reply.text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "custom"}]}, "tools.0.name"),
        ({"tools": [{"type": "namespace", "tools": []}]}, "tools.0.name"),
        (
            {"tools": [{**NAMESPACE, "tools": [WEB_SEARCH]}]},
            "tools.0.tools.0.type",
        ),
        ({"tools": [EXEC, {**APPLY_PATCH, "name": "exec_command"}]}, "tools.1.name"),
        (
            {"tools": [EXEC, {**NAMESPACE, "tools": [{**EXEC, "strict": True}]}]},
            "tools.1.tools.0.name",
        ),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]},
            "input.0",
        ),
        ({"input": [{"type": "custom_tool_call_output", "output": "ok"}]}, "input.0.call_id"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ],
)
def test_malformed_codex_shapes_are_refused_in_openais_shape(api: Api, change: dict, param: str):
    session = api.new_session(task_id="codex-bad")
    before = omitted_count(api, "web_search")
    error = assert_error(post(api, session, codex_body(**change)), 400)
    assert error["param"] == param, error
    assert turns(api, session) == []
    assert omitted_count(api, "web_search") == before  # a refused request left nothing out


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_that_fails_after_it_is_planned_counts_no_hosted_tools(
    api: Api, stream: bool, monkeypatch: pytest.MonkeyPatch
):
    """Planned (hosted tools left out of its prompt) but not served: no engine in rotation, so
    sampling fails with a 503 before any byte goes out; the metric counts served requests only."""
    pool = api.http.app.state.ctx.pool

    async def down(engine: Any) -> bool:  # a probe finds the engine still down
        return False

    monkeypatch.setattr(pool, "check", down)
    for engine in pool.engines:
        monkeypatch.setattr(engine, "healthy", False)
    session = api.new_session(task_id="codex-no-engine")
    before = omitted_count(api, "web_search")
    error = assert_error(post(api, session, codex_body(stream=stream)), 503)
    assert error["type"], error
    assert turns(api, session) == []
    assert omitted_count(api, "web_search") == before  # nothing was served


# ----- the model's calls out, streamed and not -------------------------------------------------


def replay(api: Api, body: dict, text: str) -> tuple[list[dict], dict]:
    """What the answer of a plan for ``body`` would stream and serve if the model sampled
    ``text``: the real renderer and stream reader fed its tokens one by one, as ``answer``
    feeds them."""
    ctx = api.http.app.state.ctx
    request = ResponseRequest.model_validate(body)
    prompt_ids = ctx.tokenizer.encode("prompt")
    plan = new_plan(
        "resp",
        Prompt(prompt_ids, None),
        SamplingRequest(prompt_ids, 1000),
        1,
        surface="responses",
        model=request.model,
        tool_names=request.tool_names(),
    )
    renderer = ResponsesRenderer(ctx, plan, request)
    ids = ctx.tokenizer.encode(text)
    completion = Completion(prompt_ids, ids, finish_reason={"type": "stop"})
    choice = ChoiceText(ctx.tokenizer, (), plan.tool_names, True)
    events = list(renderer.start())
    for token in ids:
        events += renderer.delta(0, choice.push([token]), Piece(ids=[token]))
    served = renderer.served(plan.request_id, completion)
    deltas = choice.finish(completion)
    events += renderer.finish(0, deltas, finish_reason(completion, choice.called))
    events += renderer.end(usage(len(prompt_ids), [completion]))
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    return events, served.response


def block(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_call_to_a_custom_tool_is_a_custom_tool_call_item_with_its_own_events(api: Api):
    text = (
        "Patching.\n"
        + block("apply_patch", {"input": PATCH})
        + "\n"
        + block("exec_command", {"cmd": "cat hello.txt"})
    )
    events, response = replay(api, codex_body(), text)
    Response.model_validate(response)
    message, custom, function = response["output"]
    assert message["content"][0]["text"] == "Patching."
    assert custom == {
        "id": custom["id"],
        "type": "custom_tool_call",
        "call_id": custom["call_id"],
        "name": "apply_patch",
        "input": PATCH,
    }
    assert (function["type"], function["name"]) == ("function_call", "exec_command")
    assert json.loads(function["arguments"]) == {"cmd": "cat hello.txt"}
    kinds = [event["type"] for event in events]
    at = kinds.index("response.custom_tool_call_input.delta")
    assert kinds[at - 1 : at + 3] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    added, delta, done, finished = events[at - 1 : at + 3]
    assert added["item"] == {**custom, "input": ""}
    assert delta["delta"] == done["input"] == PATCH and delta["item_id"] == custom["id"]
    assert finished["item"] == custom and finished["output_index"] == 1
    assert "response.function_call_arguments.done" in kinds
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == response


def test_a_call_to_a_namespaced_tool_carries_its_namespace(api: Api):
    body = codex_body(model="tiny", tools=[EXEC, NAMESPACE])
    _, response = replay(api, body, block("close_agent", {"target": "a1"}))
    (call,) = response["output"]
    assert (call["type"], call["name"], call["namespace"]) == (
        "function_call",
        "close_agent",
        "multi_agent_v1",
    )


@pytest.mark.parametrize(
    "arguments",
    [{"patch": PATCH}, {"input": PATCH, "extra": 1}, {"input": 7}, {}],
)
def test_a_custom_call_without_exactly_one_string_input_stays_text(api: Api, arguments: dict):
    text = block("apply_patch", arguments)
    events, response = replay(api, codex_body(), text)
    (item,) = response["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == text
    assert not any("custom_tool_call" in event["type"] for event in events)


# ----- the parse of free-form calls ------------------------------------------------------------

NAMES = ToolNames(["apply_patch", "exec_command"], free_form=["apply_patch"])


@settings(max_examples=200, deadline=None)
@given(
    raw=st.text(),
    before=st.text(alphabet=st.characters(blacklist_characters="<")),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_a_free_form_call_parses_back_to_its_raw_text_however_chunked(raw, before, cuts):
    arguments = free_form_arguments(raw)  # what the model writes for raw text
    text = f'{before}<tool_call>\n{{"name": "apply_patch", "arguments": {arguments}}}\n</tool_call>'
    parsed = parse_tool_calls(text, NAMES)
    if "</tool_call>" in raw:  # a literal close marker cuts the block short (tool_calls' rules)
        assert parsed.tool_calls == []
        return
    (call,) = parsed.tool_calls
    assert free_form_input(call) == raw and call.name == "apply_patch"
    stream = ToolCallStream(NAMES)
    pieces, last = [], 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    (streamed,) = [event.call for event in events if isinstance(event, ToolCallDelta)]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


@given(arguments=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)))
def test_a_free_form_tool_takes_only_one_string_input(arguments):
    text = block("apply_patch", arguments)
    calls = parse_tool_calls(text, NAMES).tool_calls
    one_string = list(arguments) == ["input"] and isinstance(arguments["input"], str)
    assert len(calls) == (1 if one_string else 0)
    assert malformed_blocks(text, NAMES) == (0 if one_string else 1)  # counted when not a call
    # The same arguments to a function tool are a call whatever they hold.
    assert len(parse_tool_calls(block("exec_command", arguments), NAMES).tool_calls) == 1
