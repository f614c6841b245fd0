"""A claim's rows say why each turn's answer ended (``finish_reason``), as the answer said: the
trainer's overlong filter (DAPO) masks the turns the length limit cut by it."""

from __future__ import annotations

from tests.api.api_support import Api


def test_a_claimed_turn_carries_the_finish_reason_its_answer_had(api: Api):
    run = api.new_run()
    session = api.new_session(run["id"])
    # greedy: the same tokens every run (the first is no end of answer, so 1 token is cut)
    answers = [api.chat(session, max_tokens=n, temperature=0.0) for n in (1, 16)]
    api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    claim = api.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 4})
    (claimed,) = claim["sessions"]
    turns = sorted(
        (t for row in claimed["rows"] for t in row["turns"]), key=lambda t: t["turn_index"]
    )
    assert [t["finish_reason"] for t in turns] == [
        a["choices"][0]["finish_reason"] for a in answers
    ]
    assert turns[0]["finish_reason"] == "length"  # one token asked: the limit cut it
    # the session's own view shows the same rows
    shown = api.session(session["session_id"])
    assert [t["finish_reason"] for row in shown["rows"] for t in row["turns"]] == [
        t["finish_reason"] for row in claimed["rows"] for t in row["turns"]
    ]
