"""Conversations within a session, through the real SDKs over the in-process app: an agent's
side request (a title under its own system prompt, a sub-agent) is a conversation of its own,
its own row and no break; the main conversation goes on in its row; an edit of the main
conversation's history is a break. What the proxy keeps of a session is what it reloads from
the store (another replica, a restart)."""

from __future__ import annotations

from server.proxy.session_cache import SessionRegistry, SessionState
from tests.api.api_support import Api

MAIN = "You are a coding agent. Work in small steps."
TITLE = "Write a five-word title for the user's request."
TASK = "Fix the failing test."


def assert_shape(api: Api, session: dict, conversations: list[int], breaks: int) -> dict:
    """The session's turns are in ``conversations``; rows are its conversations plus breaks
    (no retries, one choice each); the session list shows the same counts."""
    view = api.session(session["session_id"])
    assert [turn["conversation"] for turn in view["turns"]] == conversations
    assert view["conversations"] == len(set(conversations))
    assert view["breaks"] == breaks
    assert view["row_count"] == len(view["rows"]) == view["conversations"] + breaks
    summary = api.ok("GET", "/rl/sessions", params={"task_id": view["task_id"]})
    assert [(s["conversations"], s["breaks"]) for s in summary] == [
        (len(set(conversations)), breaks)
    ]
    return view


def test_chat_completions_a_title_request_is_a_conversation_and_an_edit_a_break(api: Api):
    session = api.new_session(task_id="conversations-chat")
    main = [{"role": "system", "content": MAIN}, {"role": "user", "content": TASK}]
    client = api.openai(session["api_key"])  # not closed: it is the app's TestClient
    first = client.chat.completions.create(model="tiny", messages=main, max_tokens=6)
    title = [{"role": "system", "content": TITLE}, {"role": "user", "content": TASK}]
    client.chat.completions.create(model="tiny", messages=title, max_tokens=6)
    answer = {"role": "assistant", "content": first.choices[0].message.content or ""}
    went_on = [*main, answer, {"role": "user", "content": "Run the tests."}]
    client.chat.completions.create(model="tiny", messages=went_on, max_tokens=6)
    view = assert_shape(api, session, [0, 1, 0], breaks=0)
    assert [t["extends_previous"] for t in view["turns"]] == [False, False, True]

    edited = [*main, {"role": "assistant", "content": "I never said this."}]
    edited.append({"role": "user", "content": "Run the tests."})
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=6)
    view = assert_shape(api, session, [0, 1, 0, 0], breaks=1)
    assert view["turns"][3]["row_index"] not in {t["row_index"] for t in view["turns"][:3]}

    page = api.call("GET", f"/admin/sessions/{session['session_id']}").text  # the transcript
    assert '<div class="value" id="conversations">2</div>' in page
    assert '<div class="value" id="breaks">1</div>' in page
    assert page.count("starts the conversation: a new row") == 2
    assert page.count("(continues the row)") == 1
    assert page.count("break: the conversation&#39;s history changed") == 1
    run = api.call("GET", f"/admin/runs/{view['run_id']}").text
    totals = api.ok("GET", f"/rl/runs/{view['run_id']}")["totals"]
    assert f'<div class="value" id="rows">{totals["rows"]}</div>' in run
    assert f"{totals['conversations']} conversations" in run


def test_messages_a_sub_agent_is_a_conversation_of_its_own(api: Api):
    session = api.new_session(task_id="conversations-messages")
    task = {"role": "user", "content": TASK}
    client = api.anthropic(session["api_key"])  # not closed: it is the app's TestClient
    first = client.messages.create(
        model="claude-sonnet-4-6", max_tokens=6, system=MAIN, messages=[task]
    )
    client.messages.create(
        model="claude-haiku-4-5",
        max_tokens=6,
        system="You are a search sub-agent.",
        messages=[{"role": "user", "content": "Find the test file."}],
    )
    text = "".join(block.text for block in first.content if block.type == "text")
    history = [
        task,
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": "The sub-agent found it."},
    ]
    client.messages.create(model="claude-sonnet-4-6", max_tokens=6, system=MAIN, messages=history)
    view = assert_shape(api, session, [0, 1, 0], breaks=0)
    assert view["turns"][2]["extends_previous"]


def test_responses_a_summary_request_is_a_conversation_of_its_own(api: Api):
    session = api.new_session(task_id="conversations-responses")
    task = {"role": "user", "content": TASK}
    client = api.openai(session["api_key"])  # not closed: it is the app's TestClient
    first = client.responses.create(
        model="gpt-4o-mini", instructions=MAIN, input=[task], max_output_tokens=6
    )
    client.responses.create(
        model="gpt-4o-mini",
        instructions="Summarize the conversation so far.",
        input=[task],
        max_output_tokens=6,
    )
    history = [
        task,
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "Go on."},
    ]
    client.responses.create(
        model="gpt-4o-mini", instructions=MAIN, input=history, max_output_tokens=6
    )
    view = assert_shape(api, session, [0, 1, 0], breaks=0)
    assert view["turns"][2]["extends_previous"]


def summary_of(state: SessionState) -> dict:
    return {
        "next": (state.next_turn, state.next_row, state.next_conversation),
        "conversations": [
            (c.index, c.opening, [t.completion_id for t in c.last])
            for c in state.conversations.values()
        ],
        "tails": state.row_tails,
    }


def test_what_the_proxy_keeps_of_a_session_is_what_it_reloads_from_the_store(api: Api):
    """Another replica (or a restart) reads the session's conversations from the store and
    places the next requests as the replica that served the first ones would have."""
    session = api.new_session(task_id="conversations-reload")
    main = [{"role": "system", "content": MAIN}, {"role": "user", "content": TASK}]
    title = [{"role": "system", "content": TITLE}, {"role": "user", "content": TASK}]
    ctx = api.http.app.state.ctx  # type: ignore[attr-defined]
    client = api.openai(session["api_key"])  # not closed: it is the app's TestClient
    first = client.chat.completions.create(model="tiny", messages=main, max_tokens=6)
    client.chat.completions.create(model="tiny", messages=title, max_tokens=6)
    live = api.http.portal.call(ctx.sessions.get, session["session_id"])  # type: ignore[union-attr]
    fresh = SessionRegistry(ctx.sessionmaker, ctx.tokenizer)
    loaded = api.http.portal.call(fresh.get, session["session_id"])  # type: ignore[union-attr]
    assert summary_of(loaded) == summary_of(live)

    ctx.sessions.forget(session["session_id"])
    answer = {"role": "assistant", "content": first.choices[0].message.content or ""}
    went_on = [*main, answer, {"role": "user", "content": "Run the tests."}]
    client.chat.completions.create(model="tiny", messages=went_on, max_tokens=6)
    client.chat.completions.create(model="tiny", messages=title, max_tokens=6)  # a retry
    view = api.session(session["session_id"])
    assert [t["conversation"] for t in view["turns"]] == [0, 1, 0, 1]
    assert view["turns"][2]["extends_previous"]
    assert (view["conversations"], view["breaks"], view["retries"]) == (2, 0, 1)
