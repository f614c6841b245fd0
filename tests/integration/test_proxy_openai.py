"""The proxy through the real ``openai`` SDK: a real ``proxrl serve`` process (with its embedded
engine) on loopback, a real store (SQLite and PostgreSQL), and the tokens checked in the store.

What is checked: the stored tokens are the ones sampled (against the response's logprobs and a
teacher-forced forward pass), sync and async clients, streaming, ``n > 1``, multi-turn rows and
breaks, tool calls (with a copy of the tiny model fine-tuned here to call a calculator), text
completions, the model list, the three ways to name a session, and bad input answered with a
4xx in OpenAI's error shape while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support import ProxyProcess, parse_sse, teacher_forced_logprobs

MODEL = "tiny"  # the served name: the model directory's name
CONTEXT = 2048  # the tiny model's context length
PROMPT_VERSION = -1  # what a row records as the version of a prompt position
LOGPROB_TOLERANCE = 1e-4  # served logprobs vs a float64 teacher-forced pass
ECHO_TOLERANCE = 1e-6  # the logprobs in the response vs the ones in the store

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
QUESTION = "What is 2+2?"
TOOL_CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
)
FINAL_ANSWER = "The answer is 4."
END = "<|im_end|>"


# ---------------------------------------------------------------------------------------------
# Helpers


def client_for(session: dict) -> OpenAI:
    """An OpenAI client pointed at a session (no retries: every answer is checked as it is)."""
    return OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text the model's own chat template makes of ``messages``."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


def only_turn(proxy: ProxyProcess, session: dict) -> dict:
    stored = proxy.get_session(session["session_id"])
    (turn,) = stored["turns"]
    return turn


def assert_openai_error(body: object, *, param: str | None = None, code: str | None = None):
    """``body`` is OpenAI's error shape; ``param`` and ``code`` are checked when given."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def assert_sdk_error(exc: openai.APIStatusError, status: int, **expected) -> None:
    """An SDK exception carries the status and a body in OpenAI's error shape."""
    assert exc.status_code == status
    assert_openai_error(exc.response.json(), **expected)


def assert_still_serves(proxy: ProxyProcess) -> None:
    """A fresh session still gets a completion, and it is stored."""
    session = proxy.session(task_id="still-serving")
    with client_for(session) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[user("hi")], max_tokens=2, temperature=0
        )
    assert only_turn(proxy, session)["completion_id"] == reply.id


def text_of(tokenizer, ids: list[int], finish_reason: str) -> str:
    """What the client should read for ``ids``: the end-of-turn token cut, specials skipped."""
    if finish_reason == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# A tiny model that calls the calculator (the random tiny model never emits a tool call)

FINE_TUNE_MAX_STEPS = 400
FINE_TUNE_MIN_PROB = 0.9  # every trained token's probability, so greedy decoding is unambiguous


def tool_conversation(tokenizer, question: str, expression: str, result: str):
    """One agent episode as the proxy will tokenize it: (token ids, 1 where trained).

    Turn 1 is the prompt then the tool call; turn 2 continues it with the tool result and the
    answer, spliced as the proxy splices a continuing turn (the sampled ids, then the new text).
    """
    asked = [user(question)]
    arguments = json.dumps({"expression": expression})
    call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
    called = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", **call}]}
    answered = {"role": "tool", "tool_call_id": "call_0", "content": result}
    first = render(tokenizer, asked, [CALCULATOR])
    call_text = TOOL_CALL_TEXT.replace("2+2", expression) + END
    second = render(tokenizer, [*asked, called, answered], [CALCULATOR])
    assert second.startswith(first + call_text), "the template must extend turn 1 exactly"
    ids: list[int] = []
    trained: list[int] = []
    pieces = [
        (first, 0),
        (call_text, 1),
        (second[len(first + call_text) :], 0),
        (f"The answer is {result}.{END}", 1),
    ]
    for text, train in pieces:
        piece = encode(tokenizer, text)
        ids += piece
        trained += [train] * len(piece)
    return ids, trained


def _logits_of_suffixes(model, prefix: list[int], suffixes):
    """Logits over each suffix after the shared prefix, under the model's current weights.

    Every conversation starts with the same ~280 tokens (the tools block). They run once per
    step, not once per conversation, and without gradients: a stop-gradient through the prefix's
    keys and values that makes a step about three times cheaper on two CPU cores and still
    converges (in fewer steps, here). The logits themselves are exact, so the stopping rule
    checks exactly what greedy decoding will do.
    """
    import torch
    from transformers import DynamicCache

    from server.common.cache_argument import cache_keyword

    length = max(len(s) for s in suffixes)
    ids = torch.tensor([s + [0] * (length - len(s)) for s in suffixes])
    cache, keyword = DynamicCache(config=model.config), cache_keyword(model)
    with torch.no_grad():  # the stop-gradient
        model(torch.tensor([prefix]), **{keyword: cache}, use_cache=True)
    cache.batch_repeat_interleave(len(suffixes))
    positions = torch.arange(len(prefix), len(prefix) + length).expand(len(suffixes), -1)
    return model(ids, **{keyword: cache}, position_ids=positions).logits


def fine_tune_tool_caller(source: Path, out: Path) -> Path:
    """Overfit ``source`` on three calculator episodes (loss on assistant tokens only) until
    greedy decoding reproduces them; save the model with the source's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    episodes = [
        tool_conversation(tokenizer, QUESTION, "2+2", "4"),
        tool_conversation(tokenizer, "What is 3*5?", "3*5", "15"),
        tool_conversation(tokenizer, "What is 7-1?", "7-1", "6"),
    ]
    shared = 0  # length of the prefix all episodes share (the tools block, all prompt)
    while len({ids[shared] for ids, _ in episodes}) == 1:
        shared += 1
    assert all(1 not in trained[: shared + 1] for _, trained in episodes)
    prefix = episodes[0][0][:shared]
    suffixes = [ids[shared:] for ids, _ in episodes]
    # The logits at suffix position j predict episode token shared + j + 1.
    targets = torch.full((len(suffixes), max(map(len, suffixes))), -100)
    for row, (ids, trained) in enumerate(episodes):
        for j in range(len(ids) - shared - 1):
            if trained[shared + j + 1]:
                targets[row, j] = ids[shared + j + 1]
    chosen = targets != -100

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(FINE_TUNE_MAX_STEPS):
        logits = _logits_of_suffixes(model, prefix, suffixes)
        log_probs = torch.log_softmax(logits[chosen], dim=-1)
        target_log_probs = log_probs.gather(-1, targets[chosen].unsqueeze(-1)).squeeze(-1)
        if target_log_probs.min().exp() > FINE_TUNE_MIN_PROB:
            break
        optimizer.zero_grad()
        (-target_log_probs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    else:
        raise AssertionError(f"the tool-call fine-tune did not converge in {FINE_TUNE_MAX_STEPS}")

    model.save_pretrained(out)
    for path in source.iterdir():
        if path.is_file() and not (out / path.name).exists():
            shutil.copy(path, out / path.name)
    return out


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def proxy(request, tiny_model_dir, tmp_path_factory):
    """The proxy on the tiny model, once per store."""
    extra: list[str] = []
    if request.param == "postgres":
        extra = ["--db", request.getfixturevalue("postgres").new_database()]
    data_dir = tmp_path_factory.mktemp(f"proxy-{request.param}")
    with ProxyProcess(tiny_model_dir, data_dir, *extra) as process:
        yield process


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tool_proxy(tiny_model_dir, tmp_path_factory):
    """The proxy (SQLite) on a copy of the tiny model fine-tuned to call the calculator."""
    model_dir = fine_tune_tool_caller(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny")
    with ProxyProcess(model_dir, tmp_path_factory.mktemp("tool-proxy")) as process:
        yield process


# ---------------------------------------------------------------------------------------------
# 1. The stored tokens are the sampled ones


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stored_tokens_are_the_sampled_tokens(proxy, hf_tokenizer, hf_model, temperature):
    """The response's logprobs (tokens and values) line up one to one with the stored completion,
    every token has a version, the prompt is the chat template's, and the stored logprobs are a
    teacher-forced pass of the stored prompt + completion at the request's temperature."""
    session = proxy.session(task_id="exact")
    messages = [user("What is 12 + 30?")]
    with client_for(session) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=temperature,
            logprobs=True,
            top_logprobs=2,
        )
    turn = only_turn(proxy, session)
    choice = reply.choices[0]
    ids, logprobs = turn["completion_ids"], turn["logprobs"]

    assert turn["completion_id"] == reply.id
    assert turn["sampling"]["temperature"] == temperature
    assert turn["prompt_ids"] == encode(hf_tokenizer, render(hf_tokenizer, messages))
    assert reply.usage.prompt_tokens == len(turn["prompt_ids"])
    assert reply.usage.completion_tokens == len(ids) > 0
    assert len(turn["versions"]) == len(ids) and all(v >= 0 for v in turn["versions"])
    assert choice.finish_reason == turn["finish_reason"]
    assert choice.message.content == text_of(hf_tokenizer, ids, choice.finish_reason)

    content = choice.logprobs.content
    assert [entry.token for entry in content] == [hf_tokenizer.decode([i]) for i in ids]
    assert len(content) == len(logprobs)
    for entry, stored in zip(content, logprobs, strict=True):
        assert abs(entry.logprob - stored) <= ECHO_TOLERANCE
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + ECHO_TOLERANCE

    expected = teacher_forced_logprobs(hf_model, turn["prompt_ids"], ids, temperature)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < LOGPROB_TOLERANCE


def assert_capped_at(turn: dict, reply, limit: int, eos_token_id: int) -> None:
    """The stored turn records ``limit`` as its max_tokens and the completion keeps to it: it
    stops at the cap ("length") unless the model ended its turn first ("stop")."""
    ids = turn["completion_ids"]
    assert turn["sampling"]["max_tokens"] == limit
    assert reply.usage.completion_tokens == len(ids) <= limit
    hit_cap = len(ids) == limit and ids[-1] != eos_token_id
    assert (
        reply.choices[0].finish_reason == turn["finish_reason"] == ("length" if hit_cap else "stop")
    )


def test_max_completion_tokens_caps_the_completion(proxy, hf_tokenizer):
    session = proxy.session(task_id="max-completion-tokens")
    with client_for(session) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[user("Tell me a long story.")], max_completion_tokens=3
        )
    assert_capped_at(only_turn(proxy, session), reply, 3, hf_tokenizer.eos_token_id)


@pytest.mark.parametrize(("max_tokens", "max_completion_tokens"), [(20, 3), (3, 5)])
def test_max_completion_tokens_wins_over_max_tokens(
    proxy, hf_tokenizer, max_tokens, max_completion_tokens
):
    """Given both, the limit is max_completion_tokens whichever is smaller (openai_schemas)."""
    session = proxy.session(task_id=f"both-limits-{max_tokens}-{max_completion_tokens}")
    with client_for(session) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[user("Tell me a long story.")],
            max_tokens=max_tokens,
            max_completion_tokens=max_completion_tokens,
        )
    turn = only_turn(proxy, session)
    assert_capped_at(turn, reply, max_completion_tokens, hf_tokenizer.eos_token_id)


# ---------------------------------------------------------------------------------------------
# 2. Async, concurrent sessions


def test_async_clients_in_concurrent_sessions_are_all_stored(proxy):
    """Eight sessions served at once through AsyncOpenAI: each stores exactly its own turn."""
    sessions = [proxy.session(task_id=f"async-{i}") for i in range(8)]

    async def ask(session: dict):
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            return await client.chat.completions.create(
                model=MODEL, messages=[user(f"Count to {len(session['session_id'])}.")],
                max_tokens=12,
            )  # fmt: skip

    async def ask_all():
        return await asyncio.gather(*(ask(s) for s in sessions))

    replies = asyncio.run(ask_all())
    assert len({reply.id for reply in replies}) == len(sessions)
    for session, reply in zip(sessions, replies, strict=True):
        turn = only_turn(proxy, session)
        assert turn["completion_id"] == reply.id
        assert len(turn["completion_ids"]) == reply.usage.completion_tokens
        assert turn["response"]["content"] == reply.choices[0].message.content


# ---------------------------------------------------------------------------------------------
# 3. Streaming


def test_stream_deltas_match_the_stored_turn(proxy):
    """Streamed content arrives token by token and adds up to the stored response; the last
    chunk carries usage equal to the stored completion length, and no other chunk has usage."""
    session = proxy.session(task_id="stream")
    with client_for(session) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[user("Tell me a story.")],
            max_tokens=16,
            temperature=1.0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    turn = only_turn(proxy, session)

    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(chunk.usage is None for chunk in body)
    assert last.usage.completion_tokens == len(turn["completion_ids"])
    assert last.usage.prompt_tokens == len(turn["prompt_ids"])
    assert {chunk.id for chunk in chunks} == {turn["completion_id"]}

    deltas = [c.choices[0].delta.content for c in body if c.choices[0].delta.content]
    assert len(turn["completion_ids"]) >= 8
    assert len(deltas) > 1
    assert "".join(deltas) == turn["response"]["content"]
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == [turn["finish_reason"]]


def test_stream_ends_with_the_usage_chunk_then_done(proxy):
    """On the wire: the usage chunk is the last event before ``data: [DONE]``."""
    session = proxy.session(task_id="stream-wire")
    body = {
        "model": MODEL,
        "messages": [user("hello")],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {session['api_key']}"},
        timeout=120,
    )
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(reply.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    turn = only_turn(proxy, session)
    assert usage_chunk["usage"]["completion_tokens"] == len(turn["completion_ids"])


# ---------------------------------------------------------------------------------------------
# 4. n > 1


def test_n_choices_are_three_turns_in_three_rows(proxy):
    """n=3: three choices, three stored turns with distinct completion ids, one row each."""
    session = proxy.session(task_id="n3")
    with client_for(session) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[user("Pick a number.")], max_tokens=8, n=3
        )
    stored = proxy.get_session(session["session_id"])
    turns = stored["turns"]

    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    expected_ids = [f"{reply.id}-{i}" for i in range(3)]
    assert [choice.model_extra["completion_id"] for choice in reply.choices] == expected_ids
    assert [turn["completion_id"] for turn in turns] == expected_ids
    assert len({turn["row_index"] for turn in turns}) == 3
    assert len(stored["rows"]) == 3 and stored["breaks"] == 0
    assert reply.usage.completion_tokens == sum(len(t["completion_ids"]) for t in turns)
    for choice, turn in zip(reply.choices, turns, strict=True):
        assert choice.message.content == turn["response"]["content"]
        assert turn["prompt_ids"] == turns[0]["prompt_ids"]
        (row,) = [r for r in stored["rows"] if r["row_index"] == turn["row_index"]]
        assert row["input_ids"] == turn["prompt_ids"] + turn["completion_ids"]


# ---------------------------------------------------------------------------------------------
# 5. Multi-turn


def test_multi_turn_continues_the_row_and_an_edit_breaks_it(proxy, hf_tokenizer):
    """Sending the reply back with a new user message continues the row: its new prompt tokens
    get loss mask 0, both completions 1. Dropping the assistant message then counts a break."""
    session = proxy.session(task_id="multi-turn")
    first = [user("hi")]
    with client_for(session) as client:
        reply1 = client.chat.completions.create(
            model=MODEL, messages=first, max_tokens=8, temperature=0
        )
        second = [*first, reply1.choices[0].message.to_dict(), user("and then?")]
        client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
        stored = proxy.get_session(session["session_id"])

        t1, t2 = stored["turns"]
        assert t2["extends_previous"] is True
        assert t2["row_index"] == t1["row_index"] == 0
        assert stored["breaks"] == 0
        seen = t1["prompt_ids"] + t1["completion_ids"]
        assert t2["prompt_ids"][: len(seen)] == seen
        new_prompt = t2["prompt_ids"][len(seen) :]
        seen_text = hf_tokenizer.decode(seen, skip_special_tokens=False)
        assert new_prompt == encode(hf_tokenizer, render(hf_tokenizer, second)[len(seen_text) :])
        (row,) = stored["rows"]
        assert row["input_ids"] == seen + new_prompt + t2["completion_ids"]
        assert row["loss_mask"] == (
            [0] * len(t1["prompt_ids"])
            + [1] * len(t1["completion_ids"])
            + [0] * len(new_prompt)
            + [1] * len(t2["completion_ids"])
        )
        masked = [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if not m]
        assert set(masked) == {PROMPT_VERSION}
        assert [lp for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m] == (
            t1["logprobs"] + t2["logprobs"]
        )

        edited = [first[0], user("and then?")]  # the assistant's message dropped
        client.chat.completions.create(model=MODEL, messages=edited, max_tokens=4, temperature=0)
    stored = proxy.get_session(session["session_id"])
    t3 = stored["turns"][2]
    assert t3["extends_previous"] is False and t3["row_index"] == 1
    assert stored["breaks"] == 1 and len(stored["rows"]) == 2


# ---------------------------------------------------------------------------------------------
# 6. Tool calls (the fine-tuned model)


def ask_calculator(client: OpenAI, **options):
    return client.chat.completions.create(
        model=MODEL,
        messages=[user(QUESTION)],
        tools=[CALCULATOR],
        temperature=0,
        max_tokens=40,
        **options,
    )


def test_tool_call_is_parsed_from_the_completion(tool_proxy):
    """The model's ``<tool_call>`` block comes back as an OpenAI tool call, and the store keeps
    the exact text the model generated."""
    session = tool_proxy.session(task_id="tool")
    with client_for(session) as client:
        reply = ask_calculator(client)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+2"}

    turn = only_turn(tool_proxy, session)
    assert turn["finish_reason"] == "tool_calls"
    assert turn["tools"] == [CALCULATOR]
    assert turn["response"]["tool_calls"][0]["function"]["name"] == "calculator"


def test_tool_call_streams_as_a_tool_call_delta(tool_proxy):
    """Streamed, the call arrives as a ``delta.tool_calls`` chunk (no content), and the stream's
    finish_reason is tool_calls."""
    session = tool_proxy.session(task_id="tool-stream")
    with client_for(session) as client:
        chunks = list(ask_calculator(client, stream=True))
    calls = [
        call
        for chunk in chunks
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_")
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+2"}
    content = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert content == ""
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["tool_calls"]


def test_tool_result_turn_continues_the_row(tool_proxy, hf_tokenizer):
    """The agent loop: the assistant's tool call and a tool message with the result go back; the
    model answers, and that turn continues the tool call's row without a break."""
    session = tool_proxy.session(task_id="tool-loop")
    with client_for(session) as client:
        called = ask_calculator(client).choices[0].message
        (call,) = called.tool_calls
        messages = [
            user(QUESTION),
            called.to_dict(exclude_unset=True),
            {"role": "tool", "tool_call_id": call.id, "content": "4"},
        ]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, max_tokens=40
        )
    assert reply.choices[0].message.content == FINAL_ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls

    stored = tool_proxy.get_session(session["session_id"])
    t1, t2 = stored["turns"]
    assert hf_tokenizer.decode(t1["completion_ids"], skip_special_tokens=False) == (
        TOOL_CALL_TEXT + END
    )
    assert t2["extends_previous"] is True and t2["row_index"] == t1["row_index"]
    assert stored["breaks"] == 0 and len(stored["rows"]) == 1


def test_tool_choice_none_returns_the_raw_text(tool_proxy):
    """tool_choice="none": no parsing; the model's text comes back as content, finish stop."""
    session = tool_proxy.session(task_id="tool-none")
    with client_for(session) as client:
        reply = ask_calculator(client, tool_choice="none")
    choice = reply.choices[0]
    assert choice.message.content == TOOL_CALL_TEXT
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


FORCED = {"required": "<tool_call>\n", "calculator": '"arguments":'}


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_a_forced_tool_choice_is_a_sampled_call_whose_row_goes_on(tool_proxy, hf_tokenizer, forced):
    """tool_choice required or a named function: the call's start ends the prompt (prompt
    tokens, so masked in training), the model writes the rest (every completion token sampled,
    with its logprob), the call comes back parsed, and the tool result's turn continues the
    row without a break."""
    choice = (
        "required" if forced == "required" else {"type": "function", "function": {"name": forced}}
    )
    session = tool_proxy.session(task_id=f"tool-forced-{forced}")
    with client_for(session) as client:
        called = ask_calculator(client, tool_choice=choice, logprobs=True)
        (call,) = called.choices[0].message.tool_calls
        assert called.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "calculator",
            {"expression": "2+2"},
        )
        messages = [
            user(QUESTION),
            called.choices[0].message.to_dict(exclude_unset=True),
            {"role": "tool", "tool_call_id": call.id, "content": "4"},
        ]
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0, max_tokens=40
        )
    stored = tool_proxy.get_session(session["session_id"])
    t1, t2 = stored["turns"]
    prompt = hf_tokenizer.decode(t1["prompt_ids"], skip_special_tokens=False)
    sampled = hf_tokenizer.decode(t1["completion_ids"], skip_special_tokens=False)
    assert prompt.endswith(FORCED[forced])
    assert (prompt + sampled).endswith(TOOL_CALL_TEXT + END)  # the start + what was sampled
    assert [e.logprob for e in called.choices[0].logprobs.content] == t1["logprobs"]
    assert t2["extends_previous"] is True and t2["row_index"] == t1["row_index"]
    assert stored["breaks"] == 0 and len(stored["rows"]) == 1


# ---------------------------------------------------------------------------------------------
# 7. Text completions


def test_text_completion_stores_the_encoded_prompt(proxy, hf_tokenizer):
    """A text prompt is stored as its token ids; the text answered is the stored completion."""
    session = proxy.session(task_id="completion-text")
    prompt = "What is 2 + 3? The answer is"
    with client_for(session) as client:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    turn = only_turn(proxy, session)
    assert turn["completion_id"] == reply.id
    assert turn["prompt_ids"] == encode(hf_tokenizer, prompt)
    assert reply.usage.completion_tokens == len(turn["completion_ids"])
    choice = reply.choices[0]
    assert choice.text == text_of(hf_tokenizer, turn["completion_ids"], choice.finish_reason)


def test_token_id_completion_stores_the_ids_as_given(proxy, hf_tokenizer):
    """A prompt of token ids is stored exactly as sent."""
    session = proxy.session(task_id="completion-ids")
    prompt_ids = encode(hf_tokenizer, "one two three four")
    with client_for(session) as client:
        reply = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8)
    turn = only_turn(proxy, session)
    assert turn["completion_id"] == reply.id
    assert turn["prompt_ids"] == prompt_ids
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(turn["completion_ids"])


# ---------------------------------------------------------------------------------------------
# 8. Models


def test_models_list_names_the_served_model(proxy):
    session = proxy.session(task_id="models")
    with client_for(session) as client:
        assert [model.id for model in client.models.list()] == [MODEL]


def test_another_model_name_is_served_and_recorded(proxy):
    session = proxy.session(task_id="another-model")
    with client_for(session) as client:
        answer = client.chat.completions.create(model="gpt-4o", messages=[user("hi")], max_tokens=2)
    (turn,) = proxy.get_session(session["session_id"])["turns"]
    assert (turn["completion_id"], turn["model"], answer.model) == (answer.id, "gpt-4o", MODEL)


# ---------------------------------------------------------------------------------------------
# 9. Naming the session: key, path, header


def test_path_form_works_with_any_key(proxy):
    """``/sessions/{id}/v1`` names the session; the agent's fixed key is not ours."""
    session = proxy.session(task_id="path-form")
    base_url = f"{proxy.url}/sessions/{session['session_id']}/v1"
    with OpenAI(base_url=base_url, api_key="sk-anything", max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert only_turn(proxy, session)["completion_id"] == reply.id


def test_path_form_with_the_session_key(proxy):
    session = proxy.session(task_id="path-form-key")
    base_url = f"{proxy.url}/sessions/{session['session_id']}/v1"
    with OpenAI(base_url=base_url, api_key=session["api_key"], max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert only_turn(proxy, session)["completion_id"] == reply.id


def new_run(proxy: ProxyProcess, name: str) -> tuple[str, str]:
    """A run of its own (admin key): its id and key."""
    created = httpx.post(
        f"{proxy.url}/rl/runs", json={"name": name}, headers=proxy.admin, timeout=60
    )
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["api_key"]


def header_client(proxy: ProxyProcess, key: str, session_id: str) -> OpenAI:
    """A client with a fixed key that names its session with ``X-Session-Id``."""
    return OpenAI(
        base_url=f"{proxy.url}/v1",
        api_key=key,
        default_headers={"X-Session-Id": session_id},
        max_retries=0,
    )


def test_run_key_with_session_header(proxy):
    """A run's key and ``X-Session-Id`` reach a session of that run (made with the run key)."""
    run_id, run_key = new_run(proxy, "header-run")
    made = httpx.post(
        f"{proxy.url}/rl/sessions",
        json={"task_id": "run-header"},
        headers={"Authorization": f"Bearer {run_key}"},
        timeout=60,
    )
    assert made.status_code == 201, made.text
    session = made.json()
    assert session["run_id"] == run_id
    with header_client(proxy, run_key, session["session_id"]) as client:
        reply = client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert only_turn(proxy, session)["completion_id"] == reply.id


def test_run_key_cannot_reach_another_runs_session(proxy):
    """A run key naming a session of the default run: 403, nothing stored."""
    _, run_key = new_run(proxy, "other-run")
    other = proxy.session(task_id="default-run")
    with (
        header_client(proxy, run_key, other["session_id"]) as client,
        pytest.raises(openai.PermissionDeniedError) as caught,
    ):
        client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert_sdk_error(caught.value, 403)
    assert proxy.get_session(other["session_id"])["turns"] == []


def test_admin_key_with_session_header(proxy):
    """The admin key and ``X-Session-Id`` reach any session."""
    session = proxy.session(task_id="admin-header")
    with header_client(proxy, ProxyProcess.ADMIN_KEY, session["session_id"]) as client:
        reply = client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert only_turn(proxy, session)["completion_id"] == reply.id


def test_session_key_on_another_sessions_path_is_refused(proxy):
    mine, theirs = proxy.session(task_id="mine"), proxy.session(task_id="theirs")
    base_url = f"{proxy.url}/sessions/{theirs['session_id']}/v1"
    with (
        OpenAI(base_url=base_url, api_key=mine["api_key"], max_retries=0) as client,
        pytest.raises(openai.PermissionDeniedError) as caught,
    ):
        client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=4)
    assert_sdk_error(caught.value, 403)
    assert proxy.get_session(theirs["session_id"])["turns"] == []
    assert proxy.get_session(mine["session_id"])["turns"] == []


def test_no_key_is_a_401(proxy):
    """No Authorization header at all on /v1/chat/completions: 401 in OpenAI's shape."""
    no_key = {"Authorization": openai.Omit()}  # the SDK's way to send no key
    with (
        OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.chat.completions.create(
            model=MODEL, messages=[user("hi")], max_tokens=2, extra_headers=no_key
        )
    assert "authorization" not in caught.value.request.headers
    assert_sdk_error(caught.value, 401, code="invalid_api_key")


def test_unknown_key_is_a_401(proxy):
    """A key the proxy never issued, on /v1 (which has no session in its path): 401."""
    with (
        OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-unknown", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=2)
    assert_sdk_error(caught.value, 401, code="invalid_api_key")


# ---------------------------------------------------------------------------------------------
# 10. Bad input


RAW_BAD_BODIES = {
    "malformed-json": (b'{"model": "tiny", "messages": [', 400, None),
    "missing-messages": (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    "messages-as-string": (
        json.dumps({"model": MODEL, "messages": "hi"}).encode(),
        400,
        "messages",
    ),
    "temperature-as-word": (
        json.dumps({"model": MODEL, "messages": [user("hi")], "temperature": "hot"}).encode(),
        400,
        "temperature",
    ),
}


@pytest.mark.parametrize("case", sorted(RAW_BAD_BODIES))
def test_bad_body_is_a_4xx_in_openai_shape(proxy, case):
    """Raw HTTP bodies the SDK would not send: a 4xx naming what to fix; the server serves on."""
    content, status, param = RAW_BAD_BODIES[case]
    session = proxy.session(task_id=f"bad-{case}")
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        content=content,
        headers={
            "Authorization": f"Bearer {session['api_key']}",
            "Content-Type": "application/json",
        },
        timeout=60,
    )
    assert reply.status_code == status, reply.text
    assert_openai_error(reply.json(), param=param)
    assert proxy.get_session(session["session_id"])["turns"] == []
    assert_still_serves(proxy)


UNTRAINABLE = {
    "top_p": {"top_p": 0.5},
    "presence_penalty": {"presence_penalty": 1},
    "frequency_penalty": {"frequency_penalty": 1},
    "logit_bias": {"logit_bias": {"5": 10}},
}


@pytest.mark.parametrize("param", sorted(UNTRAINABLE))
def test_untrainable_sampling_is_refused_naming_the_parameter(proxy, param):
    """Parameters that would sample from a distribution the trainer cannot account for: 400."""
    session = proxy.session(task_id=f"untrainable-{param}")
    with client_for(session) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[user("hi")], max_tokens=2, **UNTRAINABLE[param]
        )
    assert_sdk_error(caught.value, 400, param=param)
    assert caught.value.param == param
    assert_still_serves(proxy)


def test_prompt_longer_than_the_context_is_refused(proxy, hf_tokenizer):
    """A prompt over the 2048-token context: 400 context_length_exceeded, nothing stored."""
    text = "one two three four five six seven eight nine ten " * 300
    assert len(encode(hf_tokenizer, text)) > CONTEXT
    session = proxy.session(task_id="too-long")
    with client_for(session) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[user(text)], max_tokens=4)
    assert_sdk_error(caught.value, 400, code="context_length_exceeded")
    assert proxy.get_session(session["session_id"])["turns"] == []
    assert_still_serves(proxy)


def test_bad_streamed_request_fails_before_the_stream(proxy):
    """With stream=True, a refused request is still a plain 400 (not an error inside a 200
    event stream), so the SDK raises at once."""
    session = proxy.session(task_id="bad-stream")
    with client_for(session) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[user("hi")], max_tokens=2, top_p=0.5, stream=True
        )
    assert_sdk_error(caught.value, 400, param="top_p")
    assert proxy.get_session(session["session_id"])["turns"] == []


def test_ended_session_takes_no_more_turns(proxy):
    """After POST /rl/sessions/{id}/end, a completion in that session is a 409."""
    session = proxy.session(task_id="ended")
    with client_for(session) as client:
        client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=2)
        ended = httpx.post(
            f"{proxy.url}/rl/sessions/{session['session_id']}/end", headers=proxy.admin, timeout=60
        )
        assert ended.status_code == 200, ended.text
        with pytest.raises(openai.ConflictError) as caught:
            client.chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=2)
    assert_sdk_error(caught.value, 409, code="session_closed")
    assert len(proxy.get_session(session["session_id"])["turns"]) == 1
    assert_still_serves(proxy)
