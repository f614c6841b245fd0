"""Evaluation sessions, as scenarios any REST client of ours can drive: the in-process API tier
(``tests/api/test_api_eval_sessions.py``, SQLite) and a real ``proxrl serve`` on SQLite and
PostgreSQL (``tests/integration/test_eval_sessions_backends.py``).

The client needs ``ok(method, path, status=200, key=..., json=...)``, ``call(...)`` and
``new_run(**config)`` (``tests.api.api_support.Api`` and ``tests.support.RestClient`` both
have them). Every scenario makes a run of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TOLERANCE = 1e-12  # the server sums in float64 (math.fsum): only rounding may differ


def new_session(client: Any, run_id: str, **fields: Any) -> dict:
    return client.ok("POST", "/rl/sessions", 201, json={"run_id": run_id, **fields})


def chat(client: Any, session: dict, text: str = "hi") -> dict:
    """One chat turn with the session's key; the completion."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    return client.ok("POST", "/v1/chat/completions", key=session["api_key"], json=body)


def reward(client: Any, session_id: str, value: float, completion_id: str | None = None) -> dict:
    body: dict = {"reward": value}
    if completion_id is not None:
        body["completion_id"] = completion_id
    return client.ok("POST", f"/rl/sessions/{session_id}/reward", json=body)


def end(client: Any, session_id: str) -> str:
    return client.ok("POST", f"/rl/sessions/{session_id}/end")["status"]


def finished(client: Any, run_id: str, value: float, **fields: Any) -> dict:
    """A session with one turn, rewarded and ended."""
    session = new_session(client, run_id, **fields)
    chat(client, session)
    reward(client, session["session_id"], value)
    end(client, session["session_id"])
    return session


def publish(client: Any, run_id: str, model_dir: Path) -> int:
    """The same weights again, as the run's next policy version; that version."""
    body = {"model_path": str(model_dir), "run_id": run_id}
    return client.ok("POST", "/admin/weights", json=body)["policy_version"]


# ----- scenarios -------------------------------------------------------------------------------


def eval_sessions_are_never_claimed(client: Any) -> None:
    """A claim with eval and training sessions ready takes only the training ones; the eval
    sessions end evaluated, flagged, and stay so after the claim is confirmed."""
    run = client.new_run()
    training = {finished(client, run["id"], 1.0)["session_id"] for _ in range(2)}
    evals = {finished(client, run["id"], 0.5, eval=True)["session_id"] for _ in range(2)}
    for session_id in training:
        shown = client.ok("GET", f"/rl/sessions/{session_id}")
        assert (shown["status"], shown["eval"]) == ("trainable", False)
    for session_id in evals:
        shown = client.ok("GET", f"/rl/sessions/{session_id}")
        assert (shown["status"], shown["eval"]) == ("evaluated", True)
        assert shown["reward"] == 0.5 and len(shown["turns"]) == 1
    claim = client.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 100})
    assert {s["session_id"] for s in claim["sessions"]} == training
    client.ok("POST", f"/rl/claims/{claim['claim_id']}/confirm")
    again = client.ok("POST", f"/rl/runs/{run['id']}/claims", json={"max_sessions": 100})
    assert again["sessions"] == []
    counts = client.ok("GET", f"/rl/runs/{run['id']}")["sessions"]
    assert counts == {"consumed": 2, "evaluated": 2}
    listed = client.ok("GET", "/rl/sessions", params={"run_id": run["id"], "status": "evaluated"})
    assert {s["session_id"] for s in listed} == evals and all(s["eval"] for s in listed)


def eval_sessions_are_admitted_at_the_bound(client: Any) -> None:
    """With the staleness bound full, an eval session is created at once and a training one is
    refused (429); eval sessions do not fill the bound either."""
    run = client.new_run(batch_size=1, max_staleness=0, admission_wait_s=0.2)
    for _ in range(3):  # eval sessions first: they take no place
        assert new_session(client, run["id"], eval=True)["status"] == "open"
    new_session(client, run["id"])  # the one place: (0 + 0 + 1) * 1
    refused = client.call("POST", "/rl/sessions", json={"run_id": run["id"]})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "staleness_bound"
    assert new_session(client, run["id"], eval=True)["status"] == "open"


def a_group_is_all_eval_or_none(client: Any) -> None:
    run = client.new_run()
    new_session(client, run["id"], group_id="g-train")
    new_session(client, run["id"], group_id="g-eval", eval=True)
    for group_id, flag in [("g-train", True), ("g-eval", False)]:
        body = {"run_id": run["id"], "group_id": group_id, "eval": flag}
        reply = client.call("POST", "/rl/sessions", json=body)
        assert reply.status_code == 409, reply.text
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("group_mixes_eval", "group_id")
        assert group_id in error["message"]
    new_session(client, run["id"], group_id="g-eval", eval=True)  # the same kind joins
    new_session(client, run["id"], group_id="g-train")
    other = client.new_run()  # group ids belong to their run
    new_session(client, other["id"], group_id="g-train", eval=True)


def eval_rewards_by_version_and_task(client: Any, model_dir: Path) -> None:
    """GET /rl/runs/{id}'s eval figures against a float64 reference: per version (that of the
    first sampled token) and task, and per version over every task."""
    run = client.new_run()
    run_id = run["id"]
    expected: list[tuple[int, str | None, float]] = []  # (version, task, score)
    rng = np.random.default_rng(17)

    def first_version(session: dict) -> int:
        return client.ok("GET", f"/rl/sessions/{session['session_id']}")["turns"][0]["versions"][0]

    def scored(version: int, task: str | None) -> None:
        value = float(np.round(rng.uniform(-1, 1), 6))
        fields = {"task_id": task} if task else {}
        session = finished(client, run_id, value, eval=True, **fields)
        assert first_version(session) == version
        expected.append((version, task, value))

    # the engine may serve a version another run published: this run's versions follow it
    start = first_version(finished(client, run_id, 5.0))

    # counted nowhere: a training session (above), an unrewarded eval session, one without a
    # turn
    chat(client, new_session(client, run_id, eval=True, task_id="a"))
    reward(client, new_session(client, run_id, eval=True, task_id="a")["session_id"], 9.0)

    for task in ["a", "a", "a", "b", None]:
        scored(start, task)
    # two turns rewarded, no session reward: the mean of its turn rewards; the second turn is
    # answered by the next version, yet it counts under the first (its first token's)
    spanning = new_session(client, run_id, eval=True, task_id="b")
    first = chat(client, spanning)["id"]
    assert publish(client, run_id, model_dir) == 1
    second = chat(client, spanning, "again")["id"]
    reward(client, spanning["session_id"], 0.25, first)
    reward(client, spanning["session_id"], -0.75, second)
    end(client, spanning["session_id"])
    expected.append((start, "b", -0.25))
    turns = client.ok("GET", f"/rl/sessions/{spanning['session_id']}")["turns"]
    assert [set(turn["versions"]) for turn in turns] == [{start}, {1}]

    for task in ["a", "b", "b"]:
        scored(1, task)
    assert publish(client, run_id, model_dir) == 2
    for task in ["a", None, None, "b"]:
        scored(2, task)

    figures = client.ok("GET", f"/rl/runs/{run_id}")["eval"]
    want_tasks = reference(expected, by_task=True)
    want_versions = reference(expected, by_task=False)
    assert [(f["version"], f["task_id"]) for f in figures["tasks"]] == list(want_tasks)
    assert [(f["version"], f["task_id"]) for f in figures["versions"]] == list(want_versions)
    for got, want in [
        *zip(figures["tasks"], want_tasks.values(), strict=True),
        *zip(figures["versions"], want_versions.values(), strict=True),
    ]:
        assert got["count"] == want["count"]
        for name in ("mean", "std", "min", "max"):
            assert abs(got[name] - want[name]) <= TOLERANCE, (got, want, name)
    # eval rewards stay out of the run's training figures
    summary = client.ok("GET", f"/admin/api/runs/{run_id}")
    assert summary["rewarded_sessions"] == 1 and summary["reward_mean"] == 5.0


def reference(
    scores: list[tuple[int, str | None, float]], by_task: bool
) -> dict[tuple[int, str | None], dict[str, float]]:
    """Figures with numpy in float64, in the server's order: version, then no task, then tasks
    by name."""
    groups: dict[tuple[int, str | None], list[float]] = {}
    for version, task, value in scores:
        groups.setdefault((version, task if by_task else None), []).append(value)
    out = {}
    for key in sorted(groups, key=lambda k: (k[0], k[1] is not None, k[1] or "")):
        values = np.asarray(groups[key], dtype=np.float64)
        out[key] = {
            "count": len(values),
            "mean": float(values.mean()),
            "std": float(values.std(ddof=0)),
            "min": float(values.min()),
            "max": float(values.max()),
        }
    return out
