"""The tool agent's parts without a server: the calculator, how replies of any shape are read,
the shaped rewards, and whole episodes through a real ``openai.OpenAI`` whose HTTP transport
answers from a script (so the SDK parses real JSON, malformed tool calls included)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support import example_agent_module

agent = example_agent_module("tool_agent")


def call(arguments, name="calculator", call_id="call_1"):
    """A tool call in OpenAI's shape; ``arguments`` as given (JSON text or anything else)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def expression_call(expression, **kwargs):
    return call(json.dumps({"expression": expression}), **kwargs)


# --------------------------------------------------------------------------------------------
# the calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17 + 25", 42),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("74 * 99 - 10", 7316),
        ("-5 + +3", -2),
        ("-" * 199 + "1", -1),  # odd number of minus signs, 200 characters
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        ("  12  ", 12),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, expected):
    value = agent.calculate(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('echo owned')", "unsupported"),
        ("x + 1", "unsupported"),
        ("abs(-1)", "unsupported"),
        ("(1).real", "unsupported"),
        ("'1' + '2'", "not a number"),
        ("True + 1", "not a number"),
        ("[1, 2]", "unsupported"),
        ("1 < 2", "unsupported"),
        ("1 << 2", "unsupported"),
        ("lambda: 1", "unsupported"),
        ("1 if 1 else 2", "unsupported"),
        ("1j", "not a number"),
        ("1 +", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("10 ** 100", "exponents above"),
        ("9 ** 60", "magnitude"),
        ("99999999 * 99999999", "magnitude"),
        ("1e400", "not finite"),
        ("100000000000000.0 ** 64", "too large"),  # float overflow
        ("(-8) ** 0.5", "not a real number"),
        ("1 + " * 60 + "1", "longer than"),
    ],
)
def test_the_calculator_refuses_everything_else_with_a_reason(expression, reason):
    with pytest.raises(agent.CalculatorError, match=reason):
        agent.calculate(expression)


@pytest.mark.parametrize("expression", [None, 42, 4.2, {"expression": "1"}, ["1"]])
def test_the_calculator_takes_only_strings(expression):
    with pytest.raises(agent.CalculatorError, match="must be a string"):
        agent.calculate(expression)


def test_results_are_written_without_a_needless_decimal_point():
    assert agent.format_number(6.0) == "6"
    assert agent.format_number(-3) == "-3"
    assert agent.format_number(3.5) == "3.5"
    assert agent.format_number(1 / 3) == "0.3333333333"


def test_questions_are_seeded_and_have_integer_answers():
    questions = agent.make_questions(20, seed=3)
    assert questions == agent.make_questions(20, seed=3)
    assert questions != agent.make_questions(20, seed=4)
    for question in questions:
        assert question.answer == agent.calculate(question.expression)
        assert question.task_id == "calc-" + question.expression.replace(" ", "")
        assert question.text == f"What is {question.expression}?"


@pytest.mark.parametrize(
    ("text", "answer"),
    [("42", 42), ("The answer is 7316.", 7316), ("-12", -12), ("1 then 2", 2), ("none", None)],
)
def test_the_final_answer_is_the_last_integer(text, answer):
    assert agent.final_answer(text) == answer
    assert agent.final_answer(None) is None


# --------------------------------------------------------------------------------------------
# reading a reply


def test_a_plain_reply_is_the_final_answer():
    step = agent.read_reply("42", None)
    assert step.final and step.calls == 0 and step.malformed == 0 and step.follow_up == []
    assert step.assistant == {"role": "assistant", "content": "42"}
    assert agent.read_reply(None, []).final


def test_a_well_formed_call_is_run_and_its_result_goes_back_under_its_id():
    step = agent.read_reply(None, [expression_call("(17 + 25) * 2", call_id="call_a")])
    assert not step.final and step.calls == 1 and step.malformed == 0 and step.tool_round_trip
    assert step.follow_up == [{"role": "tool", "tool_call_id": "call_a", "content": "84"}]
    assert step.assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [expression_call("(17 + 25) * 2", call_id="call_a")],
    }


@pytest.mark.parametrize(
    ("tool_call", "error"),
    [
        (call("{not json"), "the arguments are not JSON"),
        (call("[1, 2]"), 'must be {"expression"'),
        (call("{}"), 'must be {"expression"'),
        (call('{"expression": "1+1", "extra": 1}'), 'must be {"expression"'),
        (call('{"expr": "1+1"}'), 'must be {"expression"'),
        (call('{"expression": 5}'), "must be a string"),
        (call('{"expression": "os.system(1)"}'), "unsupported"),
        (call('{"expression": "1/0"}'), "division by zero"),
        (expression_call("1+1", name="search"), "unknown tool 'search'"),
        (call(None, name=None), "unknown tool None"),
        ({"id": "call_1", "type": "custom", "custom": {"name": "x"}}, "unknown tool None"),
        ({"id": "call_1", "function": "calculator"}, "unknown tool None"),
    ],
)
def test_a_malformed_call_gets_an_error_message_and_counts_as_malformed(tool_call, error):
    step = agent.read_reply("thinking", [tool_call])
    assert not step.final and step.calls == 1 and step.malformed == 1
    (message,) = step.follow_up
    assert message["role"] == "tool" and message["tool_call_id"] == "call_1"
    assert message["content"].startswith("error: ") and error in message["content"]
    (sent,) = step.assistant["tool_calls"]  # what goes back is always valid OpenAI shape
    assert sent["id"] == "call_1" and sent["type"] == "function"
    assert isinstance(sent["function"]["name"], str)
    assert isinstance(sent["function"]["arguments"], str)


def test_arguments_given_as_an_object_are_accepted_and_sent_back_as_json():
    step = agent.read_reply(None, [call({"expression": "6*7"})])
    assert step.malformed == 0 and step.follow_up[0]["content"] == "42"
    assert step.assistant["tool_calls"][0]["function"]["arguments"] == '{"expression": "6*7"}'


def test_every_call_of_a_reply_is_answered_in_order_even_without_ids():
    good, bad = expression_call("2*3"), call("{}", name="calculator")
    del good["id"], bad["id"]
    step = agent.read_reply(None, [good, bad])
    assert step.calls == 2 and step.malformed == 1
    assert [m["tool_call_id"] for m in step.follow_up] == ["call_0", "call_1"]
    assert [c["id"] for c in step.assistant["tool_calls"]] == ["call_0", "call_1"]
    assert step.follow_up[0]["content"] == "6"


def test_a_call_that_is_not_an_object_is_answered_as_malformed():
    step = agent.read_reply(None, ["calculator(1+1)", None])
    assert step.calls == step.malformed == 2
    assert [m["tool_call_id"] for m in step.follow_up] == ["call_0", "call_1"]
    assert all(
        m["content"] == "error: unknown tool None: the only tool is 'calculator'"
        for m in step.follow_up
    )


def test_tool_call_markup_the_proxy_could_not_parse_gets_a_hint():
    text = 'sure <tool_call>\n{"name": "calculator", "arguments": {"expression": 1+}\n</tool_call>'
    step = agent.read_reply(text, None)
    assert not step.final and step.calls == 0 and step.malformed == 1
    assert not step.tool_round_trip
    assert step.assistant == {"role": "assistant", "content": text}
    assert step.follow_up == [{"role": "user", "content": agent.RETRY_HINT}]


@pytest.mark.parametrize(
    ("calls", "malformed", "read", "reward"),
    [
        (0, 0, False, 0.0),
        (1, 0, True, 0.1),
        (1, 0, False, 0.0),
        (2, 1, True, -0.1),
        (0, 1, True, -0.1),
    ],
)
def test_the_shaped_reward(calls, malformed, read, reward):
    step = agent.Step({}, [], calls=calls, malformed=malformed, final=calls == malformed == 0)
    assert agent.shaped_reward(step, results_read=read) == reward


def test_discounted_returns_match_the_closed_form():
    rewards, session, discount = [0.1, -0.1, 0.0], 1.0, 0.9
    folded = [0.1, -0.1, 1.0]
    expected = [sum(discount ** (k - t) * folded[k] for k in range(t, 3)) for t in range(3)]
    assert agent.discounted_returns(rewards, session, discount) == pytest.approx(
        expected, abs=1e-12
    )
    assert agent.discounted_returns([], 1.0, 0.9) == []


# --------------------------------------------------------------------------------------------
# whole episodes against scripted replies


class ScriptedServer:
    """Answers /chat/completions with the next scripted assistant message (or an HTTP error
    status), and keeps the request bodies."""

    def __init__(self, replies: list[dict | int]) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        reply = self.replies.pop(0)
        if isinstance(reply, int):
            error = {"message": "refused", "type": "invalid_request_error", "code": "x"}
            return httpx.Response(reply, json={"error": error})
        index = len(self.requests)
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        return httpx.Response(
            200,
            json={
                "id": f"chatcmpl-{index}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "message": {"role": "assistant", "content": None, **reply},
                    }
                ],
            },
        )

    def client(self) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.MockTransport(self))
        return openai.OpenAI(base_url="http://agent.test/v1", api_key="k", http_client=http)


QUESTION = agent.Question("17 + 25", 42, "calc-17+25")


def test_an_episode_survives_malformed_calls_and_rewards_each_turn():
    server = ScriptedServer(
        [
            {"tool_calls": [call('{"expr": "17+25"}', call_id="call_x")]},
            {"content": "<tool_call>\n{oops}\n</tool_call>"},
            {"tool_calls": [expression_call("17 + 25", call_id="call_y")]},
            {"content": "The answer is 42"},
        ]
    )
    with server.client() as model:
        episode = agent.run_episode(model, "tiny", QUESTION, max_turns=6)
    assert episode.stopped == "answered" and episode.answer == 42 and episode.reward == 1.0
    assert episode.turn_rewards == {
        "chatcmpl-1": -0.1,
        "chatcmpl-2": -0.1,
        "chatcmpl-3": 0.1,
        "chatcmpl-4": 0.0,
    }
    assert episode.tool_calls == 2 and episode.malformed == 2 and episode.tool_round_trips == 2

    second, third, fourth = server.requests[1:]
    assert second["tools"] == [agent.CALCULATOR_TOOL] and second["tool_choice"] == "auto"
    assert second["messages"][-1]["tool_call_id"] == "call_x"
    assert second["messages"][-1]["content"].startswith("error: ")
    assert third["messages"][-1] == {"role": "user", "content": agent.RETRY_HINT}
    assert fourth["messages"][-2]["tool_calls"][0]["id"] == "call_y"
    assert fourth["messages"][-1] == {"role": "tool", "tool_call_id": "call_y", "content": "42"}


def test_an_episode_stops_at_max_turns_and_unread_results_earn_nothing():
    server = ScriptedServer([{"tool_calls": [expression_call("1+1")]}] * 2)
    with server.client() as model:
        episode = agent.run_episode(model, "tiny", QUESTION, max_turns=2)
    assert episode.stopped == "max_turns" and episode.answer is None and episode.reward == 0.0
    assert list(episode.turn_rewards.values()) == [0.1, 0.0]
    assert episode.tool_round_trips == 1


def test_a_refused_request_ends_the_episode_without_an_error():
    server = ScriptedServer([{"tool_calls": [expression_call("1+1")]}, 400])
    with server.client() as model:
        episode = agent.run_episode(model, "tiny", QUESTION, max_turns=4)
    assert episode.stopped == "refused" and len(episode.turns) == 1 and episode.reward == 0.0
    assert list(episode.turn_rewards.values()) == [0.0]
