"""Anthropic's Messages API as Claude Code (2.1.332) speaks it, in-process: request bodies shaped
like the ones it sends on its default path (captured with ``tools/capture_agent_requests.py``;
its long texts replaced by short placeholders), each accepted, rendered and recorded:

- a ``role: "system"`` message among the messages (its environment, after the first user
  message): a system turn where it stands, with a template that renders one there; its text
  joined to the leading system text with one that does not;
- tools sent with ``defer_loading`` left out of the prompt until a ``tool_reference`` block (its
  ``ToolSearch`` result) names one, which renders as the tool's definition in the tool result;
- its beta headers, ``?beta=true``, ``thinking``, ``context_management``, ``output_config``,
  ``metadata`` and ``cache_control`` accepted and ignored; ``HEAD /`` answered 200;
- what such a message cannot hold refused with a 400 in Anthropic's error shape.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from anthropic.types import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from server.proxy.anthropic import conversation, system_in_place
from server.proxy.anthropic_schemas import Conversation
from server.text.tokenization import Tokenizer
from tests.api.api_support import NO_KEY, Api
from tests.api.test_api_anthropic import assert_anthropic_error, named_events

PATH = "/v1/messages?beta=true"
MODEL = "claude-sonnet-4-6"
# The headers Claude Code sends besides its key (x-api-key).
HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": (
        "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
        "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,"
        "advanced-tool-use-2025-11-20,effort-2025-11-24"
    ),
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "x-claude-code-session-id": "fed4d54b-8630-4a40-8bd7-063eaf61bfbc",
    "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
    "x-stainless-retry-count": "0",
    "x-stainless-timeout": "600",
}
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli;"},
    {"type": "text", "text": "You are an agent.", "cache_control": EPHEMERAL},
    {"type": "text", "text": "\nWork toward the user's goals.\n\n", "cache_control": EPHEMERAL},
]
REMINDER = "<system-reminder>\nAttribution for commits.\n</system-reminder>\n"
ENVIRONMENT = "# Environment\n - Primary working directory: /tmp/work\n - Platform: linux"


def schema(**properties: dict) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": properties,
        "required": list(properties)[:1],
        "additionalProperties": False,
    }


BASH = {
    "name": "Bash",
    "description": "Executes a bash command.",
    "input_schema": schema(command={"type": "string"}, description={"type": "string"}),
}
TOOL_SEARCH = {
    "name": "ToolSearch",
    "description": "Fetches deferred tools.",
    "input_schema": schema(query={"type": "string"}),
}
WEB_FETCH = {
    "name": "WebFetch",
    "description": "Fetches a URL.",
    "input_schema": schema(url={"type": "string"}),
    "defer_loading": True,
}
PLACEHOLDER = {
    "name": "DeferredToolPlaceholder",
    "description": "Reserved placeholder; never call this tool.",
    "input_schema": {"type": "object", "properties": {}},
    "defer_loading": True,
}
TOOLS = [BASH, TOOL_SEARCH, PLACEHOLDER]


def first_messages(task: str = "Create out.txt containing hello.") -> list[dict]:
    """The first request's messages: the user's task after a reminder, then the environment as
    a system message of text blocks (later requests send it as a string)."""
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": task}],
        },
        {
            "role": "system",
            "content": [{"type": "text", "text": ENVIRONMENT, "cache_control": EPHEMERAL}],
        },
    ]


def claude_code(messages: list[dict], tools: list[dict] = TOOLS, **body) -> dict:
    """A request body as Claude Code sends it (max_tokens lowered: the tiny model would fill its
    context)."""
    return {
        "model": MODEL,
        "messages": messages,
        "system": SYSTEM,
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "session_id": "s"})},
        "max_tokens": 8,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        **body,
    }


def post(api: Api, session: dict, body: dict, path: str = PATH):
    headers = {"x-api-key": session["api_key"], **HEADERS}
    return api.call("POST", path, key=NO_KEY, json=body, headers=headers)


def prompt_of(api: Api, turn: dict) -> str:
    return Tokenizer.from_pretrained(api.model_dir).decode(turn["prompt_ids"], False)


def view(api: Api, session: dict) -> dict:
    return api.session(session["session_id"])


def test_the_first_request_renders_the_system_message_where_it_stands(api: Api):
    session = api.new_session(task_id="claude-code-first")
    body = claude_code(first_messages())
    events = named_events(post(api, session, body))
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    assert events[-1] == {"type": "message_stop"}

    (turn,) = view(api, session)["turns"]
    assert turn["messages"] == [{"role": "system", "content": SYSTEM}, *first_messages()]
    assert turn["tools"] == TOOLS
    prompt = prompt_of(api, turn)
    task = "<|im_start|>user\n" + REMINDER + "Create out.txt containing hello.<|im_end|>\n"
    environment = "<|im_start|>system\n" + ENVIRONMENT + "<|im_end|>\n"
    assert prompt.endswith(task + environment + "<|im_start|>assistant\n"), prompt[-400:]
    assert prompt.startswith("<|im_start|>system\nx-anthropic-billing-header")
    # Tools sent with defer_loading are not in the prompt until a tool search finds one.
    assert '"name": "Bash"' in prompt and '"name": "ToolSearch"' in prompt
    assert "DeferredToolPlaceholder" not in prompt
    counted = post(api, session, {**body, "stream": False}, "/v1/messages/count_tokens?beta=true")
    assert counted.status_code == 200 and counted.json()["input_tokens"] == len(turn["prompt_ids"])


def test_the_conversation_goes_on_in_one_row(api: Api):
    """The next request: the history with the environment as a string and the answer as served,
    then the tool's result (cache_control, is_error false); the turn continues the row."""
    session = api.new_session(task_id="claude-code-row")
    first = claude_code(first_messages(), stream=False)
    answer = Message.model_validate(post(api, session, first).json())
    history = [
        *first_messages()[:1],
        {"role": "system", "content": ENVIRONMENT},
        {"role": "assistant", "content": [b.model_dump() for b in answer.content]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Go on.", "cache_control": EPHEMERAL}],
        },
    ]
    events = named_events(post(api, session, claude_code(history)))
    assert events[-1] == {"type": "message_stop"}
    stored = view(api, session)
    assert [t["row_index"] for t in stored["turns"]] == [0, 0] and stored["breaks"] == 0
    second = stored["turns"][1]
    assert second["messages"][2] == {"role": "system", "content": ENVIRONMENT}


def test_a_tool_round_trip_and_a_tool_search_keep_the_prompts_beginning(api: Api):
    """A Bash call's result and a ToolSearch result (a tool_reference to a deferred tool): the
    found tool's definition is in the tool result, not among the prompt's tools, so the prompt
    begins as the first one did."""
    session = api.new_session(task_id="claude-code-tools")
    post(api, session, claude_code(first_messages(), stream=False))
    bash = {"command": "echo hello > out.txt", "description": "write file"}
    history = [
        *first_messages()[:1],
        {"role": "system", "content": ENVIRONMENT},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": bash}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "(Bash completed with no output)",
                    "is_error": False,
                    "cache_control": EPHEMERAL,
                }
            ],
        },
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "ToolSearch",
                    "input": {"query": "select:WebFetch"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                    "cache_control": EPHEMERAL,
                }
            ],
        },
    ]
    tools = [BASH, TOOL_SEARCH, WEB_FETCH, PLACEHOLDER]
    reply = post(api, session, claude_code(history, tools=tools, stream=False))
    assert reply.status_code == 200, reply.text
    first, second = view(api, session)["turns"]
    assert second["tools"] == tools and second["messages"][1:] == history
    prompt = prompt_of(api, second)
    head = prompt_of(api, first).split("<|im_start|>user")[0]
    assert prompt.startswith(head) and "WebFetch" not in head
    call = '<tool_call>\n{"name": "Bash", "arguments": ' + json.dumps(bash) + "}\n</tool_call>"
    assert call in prompt
    assert "<tool_response>\n(Bash completed with no output)\n</tool_response>" in prompt
    found = {"type": "function", "function": {"name": "WebFetch", "description": "Fetches a URL."}}
    assert json.dumps(found)[:-2] in prompt  # the definition, its parameters after
    assert '"name": "WebFetch"' not in head


def tool_search_found(tool: str) -> list[dict]:
    """A ToolSearch call and its result: a tool_reference naming ``tool``."""
    return [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_s",
                    "name": "ToolSearch",
                    "input": {"query": tool},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_s",
                    "content": [{"type": "tool_reference", "tool_name": tool}],
                }
            ],
        },
    ]


FORCED_REFUSALS = {
    "a deferred tool no tool_reference loaded": (
        {"type": "tool", "name": "WebFetch"},
        [BASH, TOOL_SEARCH, WEB_FETCH],
        "defer_loading",
    ),
    "any with only deferred tools": (
        {"type": "any"},
        [WEB_FETCH, PLACEHOLDER],
        "defer_loading",
    ),
    "a tool choice without a name": ({"type": "tool"}, [BASH], "needs the name of a tool"),
}


@pytest.mark.parametrize("case", sorted(FORCED_REFUSALS))
def test_a_forced_call_to_a_tool_the_prompt_does_not_show_is_refused(api: Api, case: str):
    """A tool sent with defer_loading is not in the prompt until a tool_reference loads it: a
    call forced to it (or to any tool, when only such tools are sent) would start the model in
    a call to a tool it was never shown."""
    choice, tools, said = FORCED_REFUSALS[case]
    session = api.new_session(task_id="claude-code-forced-hidden")
    body = claude_code(first_messages(), tools=tools, tool_choice=choice, thinking=None)
    refused = assert_anthropic_error(post(api, session, body), 400, "invalid_request_error")
    assert "tool_choice" in refused and said in refused and "None" not in refused, refused
    assert view(api, session)["turns"] == []


def test_a_forced_call_to_a_deferred_tool_a_tool_reference_loaded_is_served(api: Api):
    """Once a tool_reference loaded it, the deferred tool's definition is in the prompt (in the
    tool result): a call to it may be forced, and the prompt ends with its start."""
    session = api.new_session(task_id="claude-code-forced-found")
    messages = [*first_messages(), *tool_search_found("WebFetch")]
    body = claude_code(
        messages,
        tools=[BASH, TOOL_SEARCH, WEB_FETCH],
        tool_choice={"type": "tool", "name": "WebFetch"},
        thinking=None,
        stream=False,
    )
    reply = post(api, session, body)
    assert reply.status_code == 200, reply.text
    (turn,) = view(api, session)["turns"]
    prompt = prompt_of(api, turn)
    assert prompt.endswith('<tool_call>\n{"name": "WebFetch", "arguments":')
    assert '{"type": "function", "function": {"name": "WebFetch"' in prompt  # shown, then forced


def test_head_and_get_of_the_root_answer_200_without_a_key(api: Api):
    head = api.call("HEAD", "/", key=NO_KEY)
    assert head.status_code == 200 and head.content == b""
    get = api.call("GET", "/", key=NO_KEY)
    assert get.status_code == 200 and get.json() == {"service": "proxrl", "status": "ok"}


@pytest.mark.parametrize(
    ("message", "where"),
    [
        (
            {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            "A system message cannot hold a tool_result block",
        ),
        (
            {"role": "system", "content": [{"type": "image", "source": {}}]},
            "Content blocks of type 'image' are not supported",
        ),
        ({"role": "developer", "content": "x"}, "messages.1.role"),
        (
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "image", "source": {}}],
                    }
                ],
            },
            "tool_result content of type 'image' is not supported",
        ),
    ],
)
def test_what_such_a_message_cannot_hold_is_refused(api: Api, message: dict, where: str):
    session = api.new_session(task_id="claude-code-refused")
    body = claude_code([first_messages()[0], message])
    refused = assert_anthropic_error(post(api, session, body), 400, "invalid_request_error")
    assert where in refused
    assert view(api, session)["turns"] == []


# ----- rendering without the server: in place, or merged -----------------------------------------

MERGING_TEMPLATE = (  # keeps only a leading system message, as many templates do
    "{%- if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('system only first') }}{%- endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def merging_tokenizer(tiny_model_dir: Path, tmp_path_factory) -> Tokenizer:
    """The tiny model's tokenizer with a template that refuses a system message after the first
    message."""
    model_dir = tmp_path_factory.mktemp("merging") / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(MERGING_TEMPLATE)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(model_dir)


def test_a_template_without_system_turns_in_place_gets_them_merged(
    tokenizer: Tokenizer, merging_tokenizer: Tokenizer
):
    assert system_in_place(tokenizer) and not system_in_place(merging_tokenizer)
    body = Conversation.model_validate(claude_code(first_messages()))
    messages, _, _ = conversation(body, system_in_place=False)
    leading = "".join(block["text"] for block in SYSTEM) + "\n\n" + ENVIRONMENT
    assert messages == [
        {"role": "system", "content": leading},
        {"role": "user", "content": REMINDER + "Create out.txt containing hello."},
    ]
    rendered = merging_tokenizer.render(messages, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n" + leading + "<|im_end|>")


TEXTS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
ROLES = st.sampled_from(["user", "assistant", "system"])


@settings(max_examples=200, deadline=None)
@given(
    system=st.none() | TEXTS,
    turns=st.lists(
        st.tuples(ROLES, TEXTS, st.booleans()).filter(lambda t: t[1] != ""), min_size=1, max_size=8
    ),
    in_place=st.booleans(),
)
def test_system_messages_keep_their_text_and_order(
    system: str | None, turns: list[tuple[str, str, bool]], in_place: bool
):
    """Any mix of user, assistant and system messages (content a string or text blocks): every
    text reaches the template once, in order; merged, the system texts come first, joined."""
    messages = [
        {"role": role, "content": [{"type": "text", "text": text}] if blocks else text}
        for role, text, blocks in turns
    ]
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "?"})
    body = Conversation.model_validate({"model": MODEL, "messages": messages, "system": system})
    rendered, _, prefill = conversation(body, system_in_place=in_place)
    assert prefill == ""
    sent = [
        (m["role"], m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
        for m in messages
    ]
    systems = [text for role, text in sent if role == "system"]
    leading = [system] if system else []
    if in_place:  # each message where it stands
        expected = [("system", system)] if system else []
        expected += sent
        assert [(m["role"], m["content"]) for m in rendered] == expected
    else:
        texts = [t for t in leading + systems if t]
        head = [("system", "\n\n".join(texts))] if texts else []
        rest = [(role, text) for role, text in sent if role != "system"]
        assert [(m["role"], m["content"]) for m in rendered] == head + rest


def test_a_tool_reference_renders_the_tools_definition_or_its_name():
    """Each part of a tool result on a line of its own once one is a tool_reference: a known
    tool's definition (as the template lists tools), an unknown one's bare name."""
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [
            {"type": "text", "text": "Found:"},
            {"type": "tool_reference", "tool_name": "WebFetch"},
            {"type": "tool_reference", "tool_name": "Gone"},
        ],
    }
    call = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "web"}}
    messages = [
        *first_messages(),
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    body = Conversation.model_validate(claude_code(messages, tools=[TOOL_SEARCH, WEB_FETCH]))
    rendered, tools, _ = conversation(body)
    definition = {
        "type": "function",
        "function": {
            "name": "WebFetch",
            "description": "Fetches a URL.",
            "parameters": WEB_FETCH["input_schema"],
        },
    }
    assert rendered[-1] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "Found:\n" + json.dumps(definition) + "\nGone",
    }
    assert [tool["function"]["name"] for tool in tools or []] == ["ToolSearch"]
