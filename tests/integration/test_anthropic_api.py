"""Anthropic's Messages API through the real ``anthropic`` SDK (and LangChain's ``ChatAnthropic``,
unchanged) against a live ``proxrl serve``: ``messages.create`` and ``messages.stream``, sync and
async, tools with a copy of the tiny model fine-tuned to call a calculator, and a weight swap in
the middle of streams. Each time the store holds exactly the tokens the client was served (count
and text), with a logprob and a policy version per token."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import pytest
from anthropic import Anthropic, AsyncAnthropic
from transformers import AutoTokenizer

from tests.integration.test_proxy_openai import CALCULATOR, QUESTION, fine_tune_tool_caller
from tests.support import ProxyProcess

MODEL = "claude-haiku-4-5"  # the agent's own model name: any name is served and recorded
# This SDK's messages.create takes no temperature; the API does (the proxy samples at the run's
# temperature without one).
GREEDY = {"temperature": 0}
TOOL = {
    "name": CALCULATOR["function"]["name"],
    "description": CALCULATOR["function"]["description"],
    "input_schema": CALCULATOR["function"]["parameters"],
}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("anthropic-proxy")) as process:
        yield process


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tool_proxy(tiny_model_dir, tmp_path_factory):
    model_dir = fine_tune_tool_caller(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny")
    with ProxyProcess(model_dir, tmp_path_factory.mktemp("anthropic-tools")) as process:
        yield process


def client(proxy: ProxyProcess, session: dict) -> Anthropic:
    """The SDK as an agent configures it: the proxy's address, the session key as api_key."""
    return Anthropic(base_url=proxy.url, api_key=session["api_key"], max_retries=0)


def stored(proxy: ProxyProcess, session: dict) -> list[dict]:
    return proxy.get_session(session["session_id"])["turns"]


def assert_served_is_stored(turn: dict, message, tokenizer) -> None:
    """The message the client got is the stored turn: its id, its text decoded from exactly the
    stored tokens, token counts, and a logprob and a version per token."""
    ids = turn["completion_ids"]
    assert message.id == turn["completion_id"] and turn["surface"] == "messages"
    assert message.usage.output_tokens == len(ids) > 0
    assert message.usage.input_tokens == len(turn["prompt_ids"])
    assert len(turn["logprobs"]) == len(turn["versions"]) == len(ids)
    text = "".join(block.text for block in message.content if block.type == "text")
    if message.stop_reason != "tool_use":
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert [b.model_dump(exclude_none=True) for b in message.content] == turn["response"]["content"]
    assert message.stop_reason == turn["response"]["stop_reason"]


def test_create_and_stream_sync(proxy, tokenizer):
    session = proxy.session(task_id="anthropic-sync")
    with client(proxy, session) as sdk:
        created = sdk.messages.create(
            model=MODEL,
            max_tokens=24,
            system="You count.",
            messages=[{"role": "user", "content": "Count with me."}],
        )
        with sdk.messages.stream(
            model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Tell me a story."}]
        ) as stream:
            streamed_text = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = sdk.messages.count_tokens(
            model=MODEL,
            system="You count.",
            messages=[{"role": "user", "content": "Count with me."}],
        )
    first, second = stored(proxy, session)
    assert_served_is_stored(first, created, tokenizer)
    assert_served_is_stored(second, final, tokenizer)
    assert streamed_text == "".join(b.text for b in final.content if b.type == "text")
    assert counted.input_tokens == len(first["prompt_ids"])
    assert (first["model"], first["messages"][0]) == (
        MODEL,
        {"role": "system", "content": "You count."},
    )


def test_create_and_stream_async_on_the_session_path(proxy, tokenizer):
    session = proxy.session(task_id="anthropic-async")

    async def run():
        # The path form: the session in the base URL, and the agent's own fixed key.
        base = f"{proxy.url}/sessions/{session['session_id']}"
        async with AsyncAnthropic(base_url=base, api_key="sk-ant-agent", max_retries=0) as sdk:
            created = await sdk.messages.create(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hello."}]
            )
            async with sdk.messages.stream(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Bye."}]
            ) as stream:
                events = [event.type async for event in stream]
                final = await stream.get_final_message()
        return created, events, final

    created, events, final = asyncio.run(run())
    first, second = stored(proxy, session)
    assert_served_is_stored(first, created, tokenizer)
    assert_served_is_stored(second, final, tokenizer)
    assert events[0] == "message_start" and events[-1] == "message_stop"


def test_a_bad_request_is_the_sdks_bad_request_error(proxy):
    session = proxy.session(task_id="anthropic-bad")
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with client(proxy, session) as sdk, pytest.raises(anthropic.BadRequestError) as refused:
        sdk.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "'image'" in refused.value.body["error"]["message"]
    stranger = Anthropic(base_url=proxy.url, api_key="sk-ant-nothing", max_retries=0)
    with stranger, pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert stored(proxy, session) == []


def test_langchain_chat_anthropic_unchanged(proxy, tokenizer):
    from langchain_anthropic import ChatAnthropic

    session = proxy.session(task_id="anthropic-langchain")
    llm = ChatAnthropic(
        model="claude-sonnet-4-6",
        base_url=proxy.url,
        api_key=session["api_key"],
        max_tokens=16,
        max_retries=0,
    )
    reply = llm.invoke("What is 2+2?")
    chunks = list(llm.stream("And 3+3?"))
    first, second = stored(proxy, session)
    assert reply.content == tokenizer.decode(first["completion_ids"], skip_special_tokens=True)
    assert reply.usage_metadata["output_tokens"] == len(first["completion_ids"])
    streamed = "".join(chunk.text for chunk in chunks)
    assert streamed == tokenizer.decode(second["completion_ids"], skip_special_tokens=True)
    assert first["model"] == "claude-sonnet-4-6"


def test_tool_use_and_its_result_on_one_row(tool_proxy, tokenizer):
    """The fine-tuned model calls the calculator: a tool_use block (streamed as input_json_delta);
    the tool_result goes back and the answer continues the call's row."""
    session = tool_proxy.session(task_id="anthropic-tools")
    asked = [{"role": "user", "content": QUESTION}]
    with client(tool_proxy, session) as sdk:
        called = sdk.messages.create(
            model=MODEL, max_tokens=40, tools=[TOOL], extra_body=GREEDY, messages=asked
        )
        with sdk.messages.stream(
            model=MODEL, max_tokens=40, tools=[TOOL], extra_body=GREEDY, messages=asked
        ) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            streamed = stream.get_final_message()
        (use,) = [block for block in called.content if block.type == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "4"}
        answer = sdk.messages.create(
            model=MODEL,
            max_tokens=40,
            tools=[TOOL],
            extra_body=GREEDY,
            messages=[*asked, called.to_param(), {"role": "user", "content": [result]}],
        )
    assert called.stop_reason == "tool_use" and use.name == "calculator"
    assert use.input == {"expression": "2+2"}
    assert streamed.stop_reason == "tool_use" and "input_json_delta" in deltas
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "The answer is 4."
    one, two, three = stored(tool_proxy, session)
    for turn, message in ((one, called), (two, streamed), (three, answer)):
        assert_served_is_stored(turn, message, tokenizer)
    # The streamed request resent the first one's prompt: the answer goes on from the latest.
    assert three["extends_previous"] and three["row_index"] == two["row_index"]
    assert one["tools"] == [TOOL]


STREAMS = 12


@pytest.mark.slow
def test_weight_swap_mid_stream(tiny_model_dir, tmp_path, tokenizer):
    """Streams live through a weight swap: each client gets one complete, well-formed event
    stream; the stored version spans show both versions."""
    import torch
    from transformers import AutoModelForCausalLM

    v2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in v2.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    v2.save_pretrained(tmp_path / "tiny-v2")

    with ProxyProcess(tiny_model_dir, tmp_path / "proxy") as proxy:
        sessions = [proxy.session(task_id="anthropic-swap") for _ in range(STREAMS)]
        results = asyncio.run(_swap_during_streams(proxy, sessions, tmp_path / "tiny-v2"))
        spanning = 0
        for session, (events, final) in zip(sessions, results, strict=True):
            (turn,) = stored(proxy, session)
            assert events[0] == "message_start" and events[-1] == "message_stop"
            assert events.count("message_delta") == 1 and "error" not in events
            assert_served_is_stored(turn, final, tokenizer)
            versions = turn["versions"]
            assert versions == sorted(versions) and set(versions) <= {0, 1}
            spanning += set(versions) == {0, 1}
        assert spanning >= STREAMS // 2, f"only {spanning} streams lived through the swap"


async def _swap_during_streams(proxy, sessions, v2_dir) -> list:
    progress: dict[int, int] = {}

    async def one(index: int, session: dict):
        async with (
            AsyncAnthropic(base_url=proxy.url, api_key=session["api_key"], max_retries=0) as sdk,
            sdk.messages.stream(
                model=MODEL,
                max_tokens=150,
                messages=[{"role": "user", "content": f"Count with me, number {index}."}],
            ) as stream,
        ):
            events = []
            async for event in stream:
                events.append(event.type)
                progress[index] = progress.get(index, 0) + 1
            return events, await stream.get_final_message()

    streams = [asyncio.create_task(one(i, s)) for i, s in enumerate(sessions)]
    deadline = time.monotonic() + 60
    while len(progress) < len(sessions) or min(progress.values()) < 5:
        assert time.monotonic() < deadline, progress
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(timeout=120) as http:
        swap = await http.post(
            f"{proxy.url}/admin/weights", json={"model_path": str(v2_dir)}, headers=proxy.admin
        )
    assert swap.status_code == 200, swap.text
    return await asyncio.gather(*streams)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "calculator"}])
def test_a_forced_tool_choice_is_honoured(tool_proxy, tokenizer, choice):
    """tool_choice any or a named tool: the answer starts inside a call (its start is in the
    prompt), the model writes the rest; sampled tokens are exactly the stored completion."""
    session = tool_proxy.session(task_id="anthropic-forced")
    with client(tool_proxy, session) as sdk:
        forced = sdk.messages.create(
            model=MODEL,
            max_tokens=40,
            tools=[TOOL],
            tool_choice=choice,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body=GREEDY,
        )
    (turn,) = stored(tool_proxy, session)
    assert forced.stop_reason == "tool_use", (
        forced.content,
        tokenizer.decode(turn["completion_ids"]),
    )
    assert [(b.name, b.input) for b in forced.content] == [("calculator", {"expression": "2+2"})]
    assert tokenizer.decode(turn["prompt_ids"]).endswith(
        "<tool_call>\n" if len(choice) == 1 else '"arguments":'
    )
    assert forced.usage.output_tokens == len(turn["completion_ids"])
    assert turn["response"]["content"] == [b.model_dump(exclude_none=True) for b in forced.content]
