"""Retries in-process: an agent that sends the same request again (a timeout, an error, a
framework's retry) leaves both turns stored, the attempt the session did not go on from marked
as an alternative in the rows, counted in ``retries`` and not as a break; the trainer's claim
trains the retry's row only."""

from __future__ import annotations

from tests.api.api_support import Api
from trainer.config import AlgorithmConfig
from trainer.rollouts import ALTERNATIVE, Rules, build_batch

MODEL = "tiny"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def chat(api: Api, session: dict, messages: list[dict], **body) -> dict:
    request = {"model": MODEL, "messages": messages, "max_tokens": 4, "seed": 3, **body}
    return api.ok("POST", "/v1/chat/completions", key=session["api_key"], json=request)


def flags(detail: dict) -> dict[str, tuple[int, bool]]:
    """Each turn's (row, alternative) as the rows show them."""
    return {
        turn["completion_id"]: (row["row_index"], turn["alternative"])
        for row in detail["rows"]
        for turn in row["turns"]
    }


def test_a_retried_chat_keeps_both_turns_and_trains_the_retry_only(api: Api):
    run = api.new_run()
    session = api.new_session(run["id"], task_id="retried")
    first = chat(api, session, [user("What is 2+2?")])
    again = chat(api, session, [user("What is 2+2?")])  # the client timed out and sent it again

    detail = api.session(session["session_id"])
    turns = detail["turns"]
    assert [t["completion_id"] for t in turns] == [first["id"], again["id"]]
    assert turns[0]["prompt_ids"] == turns[1]["prompt_ids"]
    assert flags(detail) == {first["id"]: (0, True), again["id"]: (1, False)}
    assert (detail["retries"], detail["breaks"]) == (1, 0)

    api.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": 1.0})
    api.ok("POST", f"/rl/sessions/{session['session_id']}/end")
    (claimed,) = api.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 4})[
        "sessions"
    ]
    rules = Rules(
        algorithm=AlgorithmConfig(temperature=1.0, off_temperature="mask", advantage="grpo"),
        policy_version=0,
        max_staleness=1,
    )
    batch = build_batch([claimed], rules, None)
    (sample,) = batch.samples
    assert sample.input_ids == turns[1]["prompt_ids"] + turns[1]["completion_ids"]
    assert sample.loss_tokens == len(turns[1]["completion_ids"])
    assert batch.masked[ALTERNATIVE] == len(turns[0]["completion_ids"])


def test_a_retry_mid_conversation_asks_with_the_same_tokens_and_the_agent_goes_on(api: Api):
    session = api.new_session(task_id="retried-mid")
    first = chat(api, session, [user("Count with me.")])
    history = [user("Count with me."), first["choices"][0]["message"], user("Next?")]
    second = chat(api, session, history)
    retried = chat(api, session, history)
    going_on = [*history, retried["choices"][0]["message"], user("And then?")]
    third = chat(api, session, going_on)

    detail = api.session(session["session_id"])
    turns = {t["completion_id"]: t for t in detail["turns"]}
    # The retry is spliced onto the first turn's exact tokens, as the attempt it repeats was.
    assert turns[retried["id"]]["prompt_ids"] == turns[second["id"]]["prompt_ids"]
    assert flags(detail) == {
        first["id"]: (0, False),
        second["id"]: (0, True),
        retried["id"]: (1, False),
        third["id"]: (1, False),
    }
    assert turns[third["id"]]["extends_previous"]
    assert (detail["retries"], detail["breaks"]) == (1, 0)


def test_an_answer_that_came_late_may_be_the_one_the_agent_goes_on_from(api: Api):
    session = api.new_session(task_id="late-answer")
    late = chat(api, session, [user("Hello")])
    retry = chat(api, session, [user("Hello")], seed=4)  # the same prompt, another answer
    assert retry["choices"][0]["message"] != late["choices"][0]["message"]
    going_on = [user("Hello"), late["choices"][0]["message"], user("Go on.")]
    after = chat(api, session, going_on)

    detail = api.session(session["session_id"])
    assert flags(detail) == {
        late["id"]: (0, False),
        retry["id"]: (1, True),
        after["id"]: (0, False),
    }
    assert (detail["retries"], detail["breaks"]) == (1, 0)


def test_the_same_prompt_through_another_surface_is_a_retry_too(api: Api):
    session = api.new_session(task_id="retried-across")
    first = chat(api, session, [user("Hi")])
    (turn,) = api.session(session["session_id"])["turns"]
    body = {"model": MODEL, "prompt": turn["prompt_ids"], "max_tokens": 3}
    again = api.ok("POST", "/v1/completions", key=session["api_key"], json=body)

    detail = api.session(session["session_id"])
    assert flags(detail) == {first["id"]: (0, True), again["id"]: (1, False)}
    assert (detail["retries"], detail["breaks"]) == (1, 0)


def test_asking_again_after_going_on_is_a_break_and_no_retry(api: Api):
    session = api.new_session(task_id="started-over")
    first = chat(api, session, [user("Hi")])
    chat(api, session, [user("Hi"), first["choices"][0]["message"], user("More.")])
    chat(api, session, [user("Hi")])  # the agent started over

    detail = api.session(session["session_id"])
    assert not any(alternative for _, alternative in flags(detail).values())
    assert (detail["retries"], detail["breaks"]) == (0, 1)
