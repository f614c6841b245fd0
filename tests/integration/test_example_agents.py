"""The example agents against a real ``proxrl serve`` on the tiny model: every session they
run ends trainable, with the rewards the agent computed stored under the right targets.

The random tiny model almost never writes a tool call, so the tool loop through the proxy is
also driven by a scripted turn: a conversation that already holds an assistant tool call and
its tool result, built by the agent's own code and sent on by it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import httpx
import pytest
import tokenizers

from client_sdk import Client
from tests.support import ROOT, ProxyProcess

AGENTS = ROOT / "examples" / "agents"


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("example-agents")) as process:
        yield process


def import_agent(name: str):
    """An example script as a module, imported the way the scripts import each other."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(AGENTS))
        return importlib.import_module(name)


@pytest.fixture(scope="module")
def tool_agent():
    yield import_agent("tool_agent")
    sys.modules.pop("tool_agent", None)


@pytest.fixture(scope="module")
def framework_agent():
    pytest.importorskip("langchain_openai", reason="needs the examples extra")
    yield import_agent("framework_agent")
    for name in ("framework_agent", "arithmetic"):
        sys.modules.pop(name, None)


@pytest.fixture
def client(proxy):
    with Client(proxy.url, ProxyProcess.ADMIN_KEY) as client:
        yield client


def assert_stored(client, session_id, session_reward, turn_rewards):
    """The session ended trainable, with exactly these rewards, its turns in this order."""
    detail = client.get_session(session_id)
    assert detail["status"] == "trainable"
    assert detail["reward"] == session_reward
    assert detail["rewards"] == {"session": session_reward, **turn_rewards}
    assert [turn["completion_id"] for turn in detail["turns"]] == list(turn_rewards)
    assert [turn["reward"] for turn in detail["turns"]] == list(turn_rewards.values())
    return detail


def test_the_tool_agent_ends_every_session_trainable_with_its_rewards(tool_agent, client):
    run = client.create_run(name="tool-agent")
    episodes = tool_agent.run_tool_agent(
        client,
        sessions=4,
        group_size=2,
        concurrency=2,
        max_turns=3,
        seed=5,
        max_tokens=32,
        run_id=run["id"],
    )
    first, second = tool_agent.make_questions(2, seed=5)
    assert [e.question for e in episodes] == [first, first, second, second]
    for episode in episodes:
        assert episode.turns and episode.stopped in ("answered", "max_turns")
        detail = assert_stored(client, episode.session_id, episode.reward, episode.turn_rewards)
        assert detail["task_id"] == detail["group_id"] == episode.question.task_id
        for turn in detail["turns"]:
            assert turn["tools"] == [tool_agent.CALCULATOR_TOOL]
            assert turn["sampling"]["max_tokens"] == 32
    assert client.run_metrics(run["id"])["sessions"] == {"trainable": 4}


def test_a_scripted_tool_round_trip_reaches_the_prompt_and_the_agent_goes_on(
    tool_agent, client, tiny_model_dir
):
    """An assistant tool call and its tool result, made by the agent's own code, are accepted
    by the proxy and rendered into the prompt the model continues from."""
    (question,) = tool_agent.make_questions(1, seed=11)
    arguments = json.dumps({"expression": question.expression})
    scripted = tool_agent.read_reply(
        None,
        [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": arguments},
            }
        ],
    )
    assert scripted.follow_up == [
        {"role": "tool", "tool_call_id": "call_0", "content": str(question.answer)}
    ]
    conversation = [*tool_agent.initial_messages(question), scripted.assistant, *scripted.follow_up]

    with client.session(task_id=question.task_id) as session, session.openai() as model:
        episode = tool_agent.run_episode(
            model, "tiny", question, max_turns=2, max_tokens=16, messages=conversation
        )
        for turn in episode.turns:
            session.reward(turn.reward, completion_id=turn.completion_id)
        session.reward(episode.reward)
    detail = assert_stored(client, session.id, episode.reward, episode.turn_rewards)

    first = detail["turns"][0]
    assert first["messages"][2]["tool_calls"][0]["id"] == "call_0"
    assert first["messages"][3] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": str(question.answer),
    }
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompt = tokenizer.decode(first["prompt_ids"], skip_special_tokens=False)
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": ' + arguments + "}\n</tool_call>"
    ) in prompt
    assert f"<tool_response>\n{question.answer}\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_malformed_call_and_its_error_message_are_accepted_too(tool_agent, client):
    (question,) = tool_agent.make_questions(1, seed=12)
    bad_call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "search", "arguments": "{}"},
    }
    scripted = tool_agent.read_reply("let me look", [bad_call])
    assert scripted.malformed == 1
    conversation = [*tool_agent.initial_messages(question), scripted.assistant, *scripted.follow_up]
    with client.session() as session, session.openai() as model:
        episode = tool_agent.run_episode(
            model, "tiny", question, max_turns=1, max_tokens=8, messages=conversation
        )
        session.reward(episode.reward)
    (turn,) = client.get_session(session.id)["turns"]
    assert turn["completion_id"] == episode.turns[0].completion_id
    assert turn["messages"][-1]["content"].startswith("error: unknown tool 'search'")


def test_the_langchain_agent_ends_every_session_trainable(framework_agent, client):
    run = client.create_run(name="langchain")
    episodes = framework_agent.run_framework_agent(client, sessions=2, seed=3, run_id=run["id"])
    assert len(episodes) == 2
    for episode in episodes:
        detail = client.get_session(episode.session_id)
        assert detail["status"] == "trainable" and detail["reward"] == episode.reward
        assert detail["rewards"] == {"session": episode.reward}
        assert detail["task_id"] == episode.problem.task_id
        (turn,) = detail["turns"]
        assert turn["completion_id"] == episode.completion_id
        assert turn["messages"][-1] == {"role": "user", "content": episode.problem.question}
        assert turn["sampling"]["max_tokens"] == 8
    assert client.run_metrics(run["id"])["sessions"] == {"trainable": 2}


def test_langchain_asking_for_gpt_4o_mini_is_served_unchanged(framework_agent, client):
    """ChatOpenAI(model="gpt-4o-mini") as an agent ships: served, and the name recorded."""
    run = client.create_run(name="langchain-any-name")
    (episode,) = framework_agent.run_framework_agent(
        client, sessions=1, seed=4, run_id=run["id"], model="gpt-4o-mini"
    )
    detail = client.get_session(episode.session_id)
    assert detail["status"] == "trainable" and detail["reward"] == episode.reward
    (turn,) = detail["turns"]
    assert (turn["completion_id"], turn["model"]) == (episode.completion_id, "gpt-4o-mini")
    assert turn["surface"] == "chat" and len(turn["completion_ids"]) >= 1


def test_the_math_agent_runs_whole_grpo_groups_from_its_command_line(client, proxy):
    run = client.create_run(name="math-agent")
    command = [
        sys.executable, str(AGENTS / "math_agent.py"), "--base-url", proxy.url,
        "--admin-key", ProxyProcess.ADMIN_KEY, "--run-id", run["id"], "--sessions", "8",
        "--group-size", "4", "--concurrency", "8", "--seed", "2",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "8 sessions in groups of 4" in out.stdout
    arithmetic = import_agent("arithmetic")
    listed = httpx.get(
        f"{proxy.url}/rl/sessions",
        params={"run_id": run["id"]},
        headers={"Authorization": f"Bearer {ProxyProcess.ADMIN_KEY}"},
        timeout=30,
    )
    sessions = listed.json()
    assert len(sessions) == 8
    groups: dict[str, set[str]] = {}
    for listed in sessions:
        detail = client.get_session(listed["session_id"])
        assert detail["status"] == "trainable"
        groups.setdefault(detail["group_id"], set()).add(detail["task_id"])
        (turn,) = detail["turns"]
        question = turn["messages"][-1]["content"]
        terms = tuple(int(term) for term in question.rstrip("=").split("+"))
        problem = arithmetic.Problem(question, str(sum(terms)), detail["task_id"], terms)
        text = turn["response"]["content"]
        assert detail["rewards"] == {"session": arithmetic.reward(problem, text)}
    # two groups of four sessions, each asking one problem
    assert len(groups) == 2 and all(len(tasks) == 1 for tasks in groups.values())
    assert client.run_metrics(run["id"])["sessions"] == {"trainable": 8}
