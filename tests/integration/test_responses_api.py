"""The Responses API against a live ``proxrl serve`` with the real clients, unchanged: the openai
SDK's ``responses.create`` (sync, async, streamed), function tools on a model fine-tuned to call
a calculator, ``previous_response_id`` across a restart of the proxy, the OpenAI Agents SDK with
its default model, and a weight swap in the middle of streams. Each time the store holds, per
turn, exactly the tokens and text the client was served."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from agents import Agent, FunctionTool, Runner, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI, NotFoundError, OpenAI
from transformers import AutoTokenizer

from tests.integration.test_proxy_openai import CALCULATOR, QUESTION, fine_tune_tool_caller
from tests.support import ProxyProcess

MODEL = "gpt-4.1-mini"  # any name: agents are not written against the model they train
STREAMS = 8
FUNCTION = {"type": "function", **CALCULATOR["function"]}  # the Responses API's form


def client_for(session: dict) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def near_greedy_session(proxy: ProxyProcess) -> dict:
    """A session of a run sampled at temperature 0.01 (an agent that sets none gets the run's)."""
    admin = {"Authorization": f"Bearer {proxy.ADMIN_KEY}"}
    body = {"name": "greedy", "config": {"temperature": 0.01}}
    run = httpx.post(f"{proxy.url}/rl/runs", json=body, headers=admin, timeout=60)
    assert run.status_code == 201, run.text
    return proxy.session(run_id=run.json()["id"], task_id="agent")


def turns_of(proxy: ProxyProcess, session: dict) -> list[dict]:
    return proxy.get_session(session["session_id"])["turns"]


def assert_served_exactly(tokenizer, turn: dict, response: dict) -> None:
    """The turn holds the tokens the client was served: their count, and their text."""
    assert turn["response"]["output"] == response["output"]
    assert response["usage"]["output_tokens"] == len(turn["completion_ids"])
    assert response["usage"]["input_tokens"] == len(turn["prompt_ids"])
    assert len(turn["logprobs"]) == len(turn["versions"]) == len(turn["completion_ids"])
    text = "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    generated = tokenizer.decode(turn["completion_ids"], skip_special_tokens=True)
    assert text and generated.startswith(text)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("responses-proxy")) as process:
        yield process


@pytest.fixture(scope="module")
def tool_proxy(tiny_model_dir, tmp_path_factory):
    """The proxy on a copy of the tiny model fine-tuned to call the calculator."""
    model_dir = fine_tune_tool_caller(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny")
    with ProxyProcess(model_dir, tmp_path_factory.mktemp("responses-tools")) as process:
        yield process


def test_sync_create_retrieve_and_delete(proxy, tokenizer):
    session = proxy.session(task_id="sync")
    with client_for(session) as client:
        response = client.responses.create(
            model=MODEL,
            input="Tell me about numbers.",
            instructions="Be brief.",
            max_output_tokens=12,
            metadata={"task": "sync"},
        )
        assert response.id.startswith("resp_") and response.model == "tiny"
        assert response.output_text
        assert client.responses.retrieve(response.id).output_text == response.output_text
        client.responses.delete(response.id)
        with pytest.raises(NotFoundError):
            client.responses.retrieve(response.id)
    (turn,) = turns_of(proxy, session)
    assert turn["surface"] == "responses" and turn["model"] == MODEL
    assert_served_exactly(tokenizer, turn, response.model_dump(mode="json", exclude_none=True))


def test_async_and_streamed_responses_are_what_is_stored(proxy, tokenizer):
    session = proxy.session(task_id="async")

    async def run() -> tuple:
        client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        first = await client.responses.create(model=MODEL, input="Hello.", max_output_tokens=8)
        stream = await client.responses.create(
            model=MODEL,
            input="Tell me a story.",
            max_output_tokens=30,
            stream=True,
            previous_response_id=first.id,
        )
        events = [event async for event in stream]
        await client.close()
        return first, events

    first, events = asyncio.run(run())
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    final = events[-1].response
    assert "".join(deltas) == final.output_text
    one, two = turns_of(proxy, session)
    assert two["row_index"] == one["row_index"] and two["extends_previous"]
    assert_served_exactly(tokenizer, one, first.model_dump(mode="json", exclude_none=True))
    assert_served_exactly(tokenizer, two, final.model_dump(mode="json", exclude_none=True))


@pytest.mark.slow  # the calculator fine-tune takes about a minute
def test_function_tools_call_and_chain_on_one_row(tool_proxy):
    session = near_greedy_session(tool_proxy)
    with client_for(session) as client:
        asked = client.responses.create(
            model=MODEL, input=QUESTION, tools=[FUNCTION], max_output_tokens=40
        )
        (call,) = asked.output
        assert call.type == "function_call" and call.name == "calculator"
        assert json.loads(call.arguments) == {"expression": "2+2"}
        with client.responses.stream(
            model=MODEL,
            tools=[FUNCTION],
            max_output_tokens=40,
            previous_response_id=asked.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "4"}],
        ) as stream:
            kinds = [event.type for event in stream]
            answered = stream.get_final_response()
    assert answered.output_text == "The answer is 4."
    assert "response.output_text.delta" in kinds
    one, two = turns_of(tool_proxy, session)
    assert one["finish_reason"] == "tool_calls" and two["extends_previous"]
    assert two["row_index"] == one["row_index"]

    client = client_for(session)  # a streamed call: its arguments as events
    with client.responses.stream(
        model=MODEL, input=QUESTION, tools=[FUNCTION], max_output_tokens=40
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    client.close()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (call,) = streamed.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "2+2"}
    assert turns_of(tool_proxy, session)[-1]["response"]["output"][0]["call_id"] == call.call_id


@pytest.mark.slow  # the calculator fine-tune takes about a minute
def test_the_agents_sdk_with_its_default_model_runs_a_tool(tool_proxy):
    session = near_greedy_session(tool_proxy)
    called: list[str] = []

    async def calculate(context, arguments: str) -> str:
        called.append(arguments)
        return "4"

    calculator = FunctionTool(
        name="calculator",
        description=CALCULATOR["function"]["description"],
        params_json_schema=CALCULATOR["function"]["parameters"],
        on_invoke_tool=calculate,
        strict_json_schema=False,
    )
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="calculator agent", tools=[calculator])
    result = asyncio.run(Runner.run(agent, QUESTION))
    assert [json.loads(arguments) for arguments in called] == [{"expression": "2+2"}]
    assert result.final_output == "The answer is 4."
    turns = turns_of(tool_proxy, session)
    assert [t["surface"] for t in turns] == ["responses", "responses"]
    assert turns[0]["model"] not in (None, "tiny")  # the SDK's default name, recorded
    assert (
        turns[1]["extends_previous"]
        and tool_proxy.get_session(session["session_id"])["breaks"] == 0
    )


def test_previous_response_id_survives_a_restart(tiny_model_dir, tmp_path, tokenizer):
    with ProxyProcess(tiny_model_dir, tmp_path) as first_proxy:
        session = first_proxy.session(task_id="restart")
        with client_for(session) as client:
            before = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=8)
    with ProxyProcess(tiny_model_dir, tmp_path) as second_proxy:
        session = {
            **session,
            "base_url": session["base_url"].replace(first_proxy.url, second_proxy.url),
        }
        with client_for(session) as client:
            after = client.responses.create(
                model=MODEL,
                input="And then?",
                previous_response_id=before.id,
                max_output_tokens=8,
            )
            assert client.responses.retrieve(before.id).id == before.id
        one, two = turns_of(second_proxy, session)
    assert after.previous_response_id == before.id
    assert two["extends_previous"] and two["row_index"] == one["row_index"]
    assert two["prompt_ids"][: len(one["prompt_ids"]) + len(one["completion_ids"])] == (
        one["prompt_ids"] + one["completion_ids"]
    )


async def _stream(session: dict, progress: dict, index: int) -> list:
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    stream = await client.responses.create(
        model=MODEL, input=f"Count with me, number {index}.", max_output_tokens=150, stream=True
    )
    events = []
    async for event in stream:
        events.append(event)
        progress[index] = progress.get(index, 0) + 1
    await client.close()
    return events


def test_weight_swap_mid_stream(tiny_model_dir, tmp_path):
    """Streams that live through a weight swap are each one complete, well-formed event stream
    (what they streamed is what was stored); stored version spans show both versions."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(tmp_path / "v1")
    (tmp_path / "data").mkdir()
    with ProxyProcess(tiny_model_dir, tmp_path / "data") as proxy:
        sessions = [proxy.session(task_id="swap") for _ in range(STREAMS)]

        async def run():
            progress: dict[int, int] = {}
            streams = [asyncio.create_task(_stream(s, progress, i)) for i, s in enumerate(sessions)]
            deadline = time.monotonic() + 60
            while len(progress) < STREAMS or min(progress.values()) < 5:
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(timeout=120) as http:
                swap = await http.post(
                    f"{proxy.url}/admin/weights",
                    json={"model_path": str(tmp_path / "v1")},
                    headers=proxy.admin,
                )
            return swap, await asyncio.gather(*streams)

        swap, results = asyncio.run(run())
        assert swap.status_code == 200, swap.text
        stored = [turns_of(proxy, session) for session in sessions]
    spanning = 0
    for events, (turn,) in zip(results, stored, strict=True):
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        final = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text
        assert (
            turn["response"]["output"] == final.model_dump(mode="json", exclude_none=True)["output"]
        )
        versions = turn["versions"]
        assert len(versions) == final.usage.output_tokens == len(turn["completion_ids"])
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        spanning += set(versions) == {0, 1}
    assert spanning >= STREAMS // 2, f"only {spanning} streams lived through the swap"
