"""What the proxy keeps of a session's conversations is derivable from the store: a registry
that reads the session afresh (a restart, another replica) holds, after every request, what the
live one holds (each conversation's latest request's turns, the answers of the attempts it
retried, the turn it continued, the rows' tails), so the next request is placed the same way:
a retry sent after a restart is a retry, not a break."""

from __future__ import annotations

from server.proxy.session_cache import SessionRegistry, SessionState
from tests.api.api_support import Api

MAIN = "You are a coding agent. Work in small steps."
TITLE = "Write a five-word title for the user's request."
TASK = "Fix the failing test."


def kept(state: SessionState) -> dict:
    return {
        "next": (state.next_turn, state.next_row, state.next_conversation),
        "conversations": [
            (c.index, c.opening, [(t.completion_id, t.row_index) for t in c.last])
            for c in state.conversations.values()
        ],
        "tails": state.row_tails,
    }


def test_a_fresh_registry_holds_what_the_live_one_does_after_each_request(api: Api):
    session = api.new_session(task_id="session-reload")
    ctx = api.http.app.state.ctx  # type: ignore[attr-defined]
    client = api.openai(session["api_key"])  # not closed: it is the app's TestClient

    def ask(messages: list[dict], n: int = 1) -> str:
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, n=n)
        live = api.http.portal.call(ctx.sessions.get, session["session_id"])  # type: ignore[union-attr]
        fresh = SessionRegistry(ctx.sessionmaker, ctx.tokenizer)
        loaded = api.http.portal.call(fresh.get, session["session_id"])  # type: ignore[union-attr]
        assert kept(loaded) == kept(live)
        return answer.choices[0].message.content or ""

    main = [{"role": "system", "content": MAIN}, {"role": "user", "content": TASK}]
    first = ask(main)
    went_on = [*main, {"role": "assistant", "content": first}, {"role": "user", "content": "Go."}]
    ask(went_on)  # continues the row
    ask(went_on, n=2)  # a retry, two choices
    ask([{"role": "system", "content": TITLE}, {"role": "user", "content": TASK}])
    ask(went_on)  # a retry again, after a side conversation
    live = api.http.portal.call(ctx.sessions.get, session["session_id"])  # type: ignore[union-attr]
    assert len(live.conversations[0].last) == 1 + 3 + 1  # itself, 3 retried answers, continued

    ctx.sessions.forget(session["session_id"])  # as after a restart
    ask(went_on)  # asks with the very same prompt ids: a retry
    view = api.session(session["session_id"])
    assert [t["conversation"] for t in view["turns"]] == [0, 0, 0, 0, 1, 0, 0]
    assert (view["conversations"], view["breaks"]) == (2, 0)
    assert view["retries"] == 3
    assert len({tuple(t["prompt_ids"]) for t in view["turns"][1:] if t["conversation"] == 0}) == 1


def test_a_registry_past_its_byte_budget_drops_sessions_that_reload_where_they_were(api: Api):
    """Sessions dropped for the budget go on in the same row once reloaded; a dropped state a
    request still holds stays the session's one state."""
    ctx = api.http.app.state.ctx  # type: ignore[attr-defined]
    call = api.http.portal.call  # type: ignore[union-attr]
    sessions = [api.new_session(task_id=f"budget-{i}") for i in range(6)]
    said: dict[str, list[dict]] = {}
    for session in sessions:
        messages = [{"role": "user", "content": f"Count from {session['session_id'][-4:]}."}]
        answer = api.chat(session, max_tokens=6, messages=messages)
        said[session["session_id"]] = [*messages, answer["choices"][0]["message"]]
    # Room for a few states, and for the largest alone once its second turn has doubled it
    # (the budget keeps one state past it: with room for 2.5 of the first session's, a larger
    # session's state went past the budget alone, by chance of what was sampled).
    one = max(call(ctx.sessions.get, s["session_id"]).nbytes for s in sessions)
    small = SessionRegistry(ctx.sessionmaker, ctx.tokenizer, budget_bytes=int(3 * one))
    held = call(small.get, sessions[0]["session_id"])
    live, ctx.sessions = ctx.sessions, small
    try:
        for session in sessions:
            messages = [*said[session["session_id"]], {"role": "user", "content": "Go on."}]
            api.chat(session, max_tokens=6, messages=messages)
            assert small.nbytes <= small._states.budget_bytes
        assert len(small) < len(sessions)
        assert call(small.get, sessions[0]["session_id"]) is held  # held here: not reloaded
        for session in sessions:
            first, second = api.session(session["session_id"])["turns"]
            assert second["extends_previous"] and second["row_index"] == first["row_index"]
    finally:
        ctx.sessions = live
