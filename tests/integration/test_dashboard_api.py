"""Trainer steps, /metrics, the dashboard's JSON under /admin/api and its pages' access rules,
against a real ``proxrl serve`` process on SQLite and on PostgreSQL.

One module-scoped server per backend. The seeded run gets its sessions from the openai SDK,
its rewards and ends over REST, and its trainer steps from POST /rl/runs/{id}/steps (no trainer
runs here). Tests that need a run of their own create one.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.common import StubEngine
from tests.support import DASHBOARD_API_ROUTES, ProxyProcess, RestClient

ADMIN_KEY = ProxyProcess.ADMIN_KEY
REWARDS = [0.0, 0.25, 0.5, 0.75, 1.0]


@dataclass
class Proxy(RestClient):
    process: ProxyProcess
    http: httpx.Client
    model_dir: Path

    def post_step(self, run_id: str, step: int, version: int, **metrics) -> httpx.Response:
        body = {"step": step, "version": version, "metrics": metrics}
        return self.call("POST", f"/rl/runs/{run_id}/steps", json=body)


@dataclass
class Seeded:
    run: dict
    session_ids: list[str] = field(default_factory=list)  # oldest first
    open_session: str = ""
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    finished: datetime = field(default_factory=lambda: datetime.now(UTC))


def chat(session: dict, messages: list[dict]) -> str:
    with OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0) as client:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    return reply.choices[0].message.content or ""


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def scrape(proxy: Proxy) -> dict[str, dict[tuple, float]]:
    """/metrics parsed: {sample name: {sorted label items: value}}."""
    reply = proxy.http.get("/metrics")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


# --------------------------------------------------------------------------------------------
# the server under test


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def proxy(request, tiny_model_dir, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"dashboard-{request.param}")
    extra = []
    if request.param == "postgres":
        extra += ["--db", request.getfixturevalue("postgres").new_database()]
    with (
        ProxyProcess(tiny_model_dir, data_dir, *extra) as process,
        httpx.Client(base_url=process.url, timeout=60) as http,
    ):
        yield Proxy(process, http, tiny_model_dir)


@pytest.fixture(scope="module")
def seeded(proxy) -> Seeded:
    """A run with five rewarded, ended sessions (two turns each, the second of one session a
    prefix break), one open session, and three trainer steps."""
    seeded = Seeded(run=proxy.new_run())
    run_id = seeded.run["id"]
    time.sleep(0.01)
    for index, reward in enumerate(REWARDS):
        session = proxy.new_session(run_id, task_id=f"task-{index % 2}", group_id="g")
        first = [{"role": "user", "content": f"{index}+{index}?"}]
        answer = chat(session, first)
        if index == 0:  # the agent rewrites its history (an answer it never got): a break
            second = [*first, {"role": "assistant", "content": f"not {answer}"}]
        else:
            second = [*first, {"role": "assistant", "content": answer}]
        second.append({"role": "user", "content": "sure?"})
        chat(session, second)
        sid = session["session_id"]
        proxy.ok("POST", f"/rl/sessions/{sid}/reward", json={"reward": reward})
        proxy.ok("POST", f"/rl/sessions/{sid}/end")
        seeded.session_ids.append(sid)
    seeded.open_session = proxy.new_session(run_id, task_id="task-open")["session_id"]
    time.sleep(0.01)
    seeded.finished = datetime.now(UTC)
    for step in (1, 2, 3):
        reply = proxy.post_step(
            run_id,
            step,
            step,
            reward_mean=0.1 * step,
            trained_tokens=100 * step,
            staleness_histogram=[5, step],
            time=time.time(),
            session_ids=seeded.session_ids,
        )
        assert reply.status_code == 201, reply.text
    return seeded


def series(proxy: Proxy, run_id: str, **params) -> dict:
    return proxy.ok("GET", f"/admin/api/runs/{run_id}/series", params=params)


# --------------------------------------------------------------------------------------------
# trainer steps


def test_a_step_is_recorded_and_a_repost_replaces_it(proxy):
    """POST /rl/runs/{id}/steps answers 201 with the run and step; posting the same step
    again replaces its figures (replaced: true) rather than adding a second point."""
    run_id = proxy.new_run()["id"]
    first = proxy.post_step(run_id, 1, 1, reward_mean=0.5, loss=2.0)
    assert first.status_code == 201
    assert first.json() == {"run_id": run_id, "step": 1, "version": 1, "replaced": False}
    again = proxy.post_step(run_id, 1, 2, reward_mean=0.75)
    assert again.status_code == 201 and again.json()["replaced"] is True
    (point,) = series(proxy, run_id)["steps"]
    assert (point["step"], point["version"]) == (1, 2)
    assert point["metrics"] == {"reward_mean": 0.75}


def test_steps_store_non_finite_numbers_as_null(proxy):
    """JSON from Python may carry NaN and Infinity; they are stored as null (inside lists
    too), so every backend's JSON column takes them."""
    run_id = proxy.new_run()["id"]
    body = '{"step": 1, "version": 0, "metrics": {"loss": NaN, "h": [1, Infinity], "s": "ok"}}'
    reply = proxy.call(
        "POST",
        f"/rl/runs/{run_id}/steps",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == 201, reply.text
    (point,) = series(proxy, run_id)["steps"]
    assert point["metrics"] == {"loss": None, "h": [1, None], "s": "ok"}


def test_session_ids_give_the_batch_reward_spread_and_are_not_stored(proxy, seeded):
    """The batch's session_ids are replaced by the spread of those sessions' rewards."""
    steps = series(proxy, seeded.run["id"])["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    metrics = steps[0]["metrics"]
    assert "session_ids" not in metrics
    mean = sum(REWARDS) / len(REWARDS)
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / len(REWARDS))
    assert metrics["reward_std"] == pytest.approx(std, abs=1e-9)
    assert (metrics["reward_min"], metrics["reward_max"]) == (0.0, 1.0)
    assert metrics["staleness_histogram"] == [5, 1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"step": 0, "version": 0}, "step"),
        ({"step": 1, "version": -1}, "version"),
        ({"step": 1, "version": 0, "metrics": {"flag": True}}, "metrics.flag"),
        # counts by name are a figure (masked tokens by cause); deeper or non-integer ones not
        ({"step": 1, "version": 0, "metrics": {"nested": {"a": {"b": 1}}}}, "metrics.nested"),
        ({"step": 1, "version": 0, "metrics": {"nested": {"a": 0.5}}}, "metrics.nested"),
        ({"step": 1, "version": 0, "extra": 1}, "extra"),
    ],
)
def test_bad_steps_are_refused_with_422(proxy, body, param):
    run_id = proxy.new_run()["id"]
    error = error_of(proxy.call("POST", f"/rl/runs/{run_id}/steps", json=body), 422)
    assert error["param"].startswith(param)


def test_steps_need_a_run_and_the_admin_key(proxy):
    run = proxy.new_run()
    assert error_of(proxy.post_step("run-nope", 1, 1), 404)["code"] == "run_not_found"
    path = f"/rl/runs/{run['id']}/steps"
    body = {"step": 1, "version": 1}
    assert error_of(proxy.call("POST", path, key=None, json=body), 401)
    assert error_of(proxy.call("POST", path, key=run["api_key"], json=body), 403)


# --------------------------------------------------------------------------------------------
# /metrics


def test_metrics_count_requests_by_route_template_and_tokens(proxy, seeded):
    """Requests are labelled by route template (never raw ids), with their status; tokens,
    turns, store writes and sessions by status are there."""
    samples = scrape(proxy)
    requests = samples["proxrl_http_requests_total"]
    reward_route = (
        ("method", "POST"),
        ("route", "/rl/sessions/{session_id}/reward"),
        ("status", "200"),
    )
    assert requests[reward_route] >= len(REWARDS)
    assert not any(seeded.session_ids[0] in str(labels) for labels in requests)
    latency = samples["proxrl_http_request_duration_seconds_count"]
    assert latency[reward_route] == requests[reward_route]
    tokens = samples["proxrl_tokens_total"]
    assert tokens[(("kind", "completion"),)] >= 2 * len(REWARDS)
    assert tokens[(("kind", "prompt"),)] > tokens[(("kind", "completion"),)]
    assert samples["proxrl_turns_total"][()] >= 2 * len(REWARDS)
    assert samples["proxrl_store_write_seconds_count"][()] >= 1
    sessions = samples["proxrl_sessions"]
    run_id = seeded.run["id"]
    assert sessions[(("run_id", run_id), ("status", "trainable"))] == len(REWARDS)
    assert sessions[(("run_id", run_id), ("status", "open"))] == 1
    (healthy,) = samples["proxrl_engine_healthy"].values()
    assert healthy == 1.0


def test_metrics_count_admission_refusals_and_weight_swaps(proxy):
    """A 429 at the staleness bound counts as a refusal (and a 429 request); a weight swap
    counts once in the pause histogram."""
    run = proxy.new_run(batch_size=1, max_staleness=0, admission_wait_s=0)
    before = scrape(proxy)
    proxy.new_session(run["id"])
    refused = proxy.call("POST", "/rl/sessions", json={"run_id": run["id"]})
    assert refused.status_code == 429
    swapped = proxy.call(
        "POST", "/admin/weights", json={"model_path": str(proxy.model_dir), "run_id": run["id"]}
    )
    assert swapped.status_code == 200, swapped.text
    after = scrape(proxy)
    assert (
        after["proxrl_admission_refusals_total"][()]
        == before["proxrl_admission_refusals_total"][()] + 1
    )
    assert after["proxrl_admission_waits_total"][()] >= before["proxrl_admission_waits_total"][()]
    route_429 = (("method", "POST"), ("route", "/rl/sessions"), ("status", "429"))
    assert after["proxrl_http_requests_total"][route_429] >= 1
    swaps_before = before["proxrl_weight_swap_pause_seconds_count"][()]
    assert after["proxrl_weight_swap_pause_seconds_count"][()] == swaps_before + 1
    assert after["proxrl_policy_version"][(("run_id", run["id"]),)] == 1
    swaps = series(proxy, run["id"])["swaps"]
    assert [s["version"] for s in swaps] == [1] and swaps[0]["pause_seconds"] > 0


def test_metrics_need_the_admin_key_off_loopback(proxy, tiny_model_dir, tmp_path):
    """A server bound to a non-loopback address serves /metrics only with the admin key (a
    strong one: off loopback the test key is refused; the last --admin-key counts)."""
    key = secrets.token_hex(32)  # token_urlsafe may begin with "-", which argparse takes for a flag
    # An engine of its own: the module's belongs to the module's store (a server on another,
    # fresh store resets an engine serving a version it has no record of to the base model).
    with StubEngine(tiny_model_dir, tmp_path / "stub.log") as engine:
        extra = ("--host", "0.0.0.0", "--engines", engine.url, "--admin-key", key)
        with ProxyProcess(tiny_model_dir, tmp_path / "open", *extra) as public:
            _metrics_need_the_key(public, key)


def _metrics_need_the_key(public: ProxyProcess, key: str) -> None:
    assert error_of(httpx.get(f"{public.url}/metrics"), 401)
    assert error_of(httpx.get(f"{public.url}/metrics", headers=public.admin), 401)
    reply = httpx.get(f"{public.url}/metrics", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200 and "proxrl_sessions" in reply.text


# --------------------------------------------------------------------------------------------
# /admin/api: access


@pytest.mark.parametrize("route", DASHBOARD_API_ROUTES)
def test_dashboard_api_refuses_without_the_admin_key(proxy, seeded, route):
    """401 without a key, with a wrong one or a forged cookie; 403 for a run or session key;
    200 for the admin key."""
    path = route.format(run_id=seeded.run["id"], session_id=seeded.session_ids[0])
    for key in (None, "wrong-key"):
        assert error_of(proxy.call("GET", path, key=key), 401)["type"] == "authentication_error"
    forged = proxy.call("GET", path, key=None, headers={"Cookie": "proxrl_admin=test-admin-key"})
    assert error_of(forged, 401)
    other = proxy.new_run()  # not the seeded run: its counts stay as they are
    session = proxy.new_session(other["id"])
    for key in (seeded.run["api_key"], other["api_key"], session["api_key"]):
        assert error_of(proxy.call("GET", path, key=key), 403)
    assert proxy.call("GET", path).status_code == 200


def test_openapi_documents_the_dashboard_api_and_not_the_pages(proxy):
    paths = proxy.ok("GET", "/openapi.json", key=None)["paths"]
    for route in DASHBOARD_API_ROUTES:
        assert route in paths, route
    assert "/rl/runs/{run_id}/steps" in paths and "/metrics" in paths
    for page in ("/admin", "/admin/login", "/admin/runs", "/admin/sessions/{session_id}"):
        assert page not in paths


# --------------------------------------------------------------------------------------------
# /admin/api: figures


def test_runs_list_counts_sessions_and_the_reward_mean(proxy, seeded):
    page = proxy.ok("GET", "/admin/api/runs", params={"limit": 500})
    (run,) = [r for r in page["items"] if r["id"] == seeded.run["id"]]
    assert run["sessions"] == {"trainable": len(REWARDS), "open": 1}
    assert run["session_total"] == len(REWARDS) + 1
    assert run["reward_mean"] == pytest.approx(sum(REWARDS) / len(REWARDS))
    assert run["rewarded_sessions"] == len(REWARDS)
    assert (run["steps"], run["last_step"], run["trainer_active"]) == (3, 3, True)
    assert page["total"] >= len(page["items"]) >= 1
    first = proxy.ok("GET", "/admin/api/runs", params={"limit": 1, "offset": 0})
    assert len(first["items"]) == 1 and first["total"] == page["total"]


def test_run_series_buckets_rewards_and_sessions(proxy, seeded):
    """Rewards and sessions come summed in time buckets: their counts add up to the run's."""
    data = series(proxy, seeded.run["id"])
    assert data["step_count"] == 3 and data["bucket_seconds"] >= 1
    assert sum(b["count"] for b in data["rewards"]) == len(REWARDS)
    means = sum(b["mean"] * b["count"] for b in data["rewards"]) / len(REWARDS)
    assert means == pytest.approx(sum(REWARDS) / len(REWARDS))
    assert min(b["min"] for b in data["rewards"]) == 0.0
    assert max(b["max"] for b in data["rewards"]) == 1.0
    assert sum(b["created"] for b in data["sessions"]) == len(REWARDS) + 1
    assert sum(b["ended"] for b in data["sessions"]) == len(REWARDS)
    assert sum(b["turns"] for b in data["sessions"]) == 2 * len(REWARDS)
    assert sum(b["breaks"] for b in data["sessions"]) == 1
    started = seeded.started.timestamp() - data["bucket_seconds"]
    assert all(started <= b["time"] <= data["now"] for b in data["sessions"])


def test_run_series_polls_after_a_step_and_thins_long_runs(proxy):
    """after_step returns only newer steps; max_points keeps every n-th step and the last."""
    run_id = proxy.new_run()["id"]
    for step in range(1, 31):
        assert proxy.post_step(run_id, step, step, reward_mean=step / 30).status_code == 201
    assert [s["step"] for s in series(proxy, run_id, after_step=28)["steps"]] == [29, 30]
    thinned = series(proxy, run_id, max_points=10)
    steps = [s["step"] for s in thinned["steps"]]
    assert thinned["step_count"] == 30
    assert len(steps) <= 11 and steps[-1] == 30 and steps == sorted(steps)


def test_a_trainer_that_says_it_stopped_shows_stopped_at_once(proxy):
    """A clean stop reposts the last step with stopped_at (trainer.figures.Progress.stopped):
    the API and the page say "stopped" at once, not "training" until the timeout. The last
    step keeps the time it was trained at, not the stop's."""
    run_id = proxy.new_run()["id"]
    for step in (1, 2):
        assert proxy.post_step(run_id, step, step, reward_mean=0.5).status_code == 201
    detail = proxy.ok("GET", f"/admin/api/runs/{run_id}")
    assert (detail["trainer"], detail["trainer_active"]) == ("training", True)
    assert detail["trainer_quiet_since"] is None
    trained_at = detail["last_step_at"]
    reposted = proxy.post_step(run_id, 2, 2, reward_mean=0.5, stopped_at=time.time())
    assert reposted.json()["replaced"] is True
    detail = proxy.ok("GET", f"/admin/api/runs/{run_id}")
    assert (detail["trainer"], detail["trainer_active"], detail["steps"]) == ("stopped", False, 2)
    assert detail["last_step_at"] == trained_at
    cookies = {"proxrl_admin": login(proxy, ADMIN_KEY).cookies["proxrl_admin"]}
    proxy.http.cookies.clear()  # the login is this test's browser's, not the shared client's
    with httpx.Client(base_url=proxy.url, cookies=cookies) as browser:
        page = browser.get(f"/admin/runs/{run_id}").text
    assert '<div class="value" id="trainer">stopped</div>' in page


def test_a_run_without_data_has_clear_empty_answers(proxy):
    run_id = proxy.new_run()["id"]
    detail = proxy.ok("GET", f"/admin/api/runs/{run_id}")
    assert detail["sessions"] == {} and detail["session_total"] == 0
    assert detail["reward_mean"] is None and detail["steps"] == 0
    assert detail["last_step"] is None and detail["trainer_active"] is False
    data = series(proxy, run_id)
    assert (data["steps"], data["rewards"], data["sessions"], data["swaps"]) == ([], [], [], [])
    assert data["eval"] == {"tasks": [], "versions": []}
    found = proxy.ok("GET", "/admin/api/sessions", params={"run_id": run_id})
    assert found == {"items": [], "total": 0, "limit": 50, "offset": 0}
    assert error_of(proxy.call("GET", "/admin/api/runs/run-nope"), 404)
    assert error_of(proxy.call("GET", "/admin/api/runs/run-nope/series"), 404)


def test_sessions_search_pages_through_every_match_once(proxy, seeded):
    params = {"run_id": seeded.run["id"], "limit": 2}
    seen: list[str] = []
    for offset in range(0, 8, 2):
        page = proxy.ok("GET", "/admin/api/sessions", params={**params, "offset": offset})
        assert page["total"] == len(REWARDS) + 1
        seen += [s["session_id"] for s in page["items"]]
    assert sorted(seen) == sorted([*seeded.session_ids, seeded.open_session])
    assert seen[0] == seeded.open_session  # newest first
    newest_rewarded = proxy.ok("GET", "/admin/api/sessions", params={**params, "offset": 1})
    row = newest_rewarded["items"][0]
    assert row["reward"] == REWARDS[-1] and row["turn_count"] == 2 and row["completion_tokens"]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"status": "open"}, ["open"]),
        ({"status": "trainable"}, [0, 1, 2, 3, 4]),
        ({"task_id": "task-1"}, [1, 3]),
        ({"reward_min": 0.5}, [2, 3, 4]),
        ({"reward_min": 0.2, "reward_max": 0.6}, [1, 2]),
        ({"reward_max": -1}, []),
    ],
)
def test_sessions_search_filters(proxy, seeded, filters, expected):
    params = {"run_id": seeded.run["id"], **filters}
    found = proxy.ok("GET", "/admin/api/sessions", params=params)
    wanted = {seeded.open_session if i == "open" else seeded.session_ids[i] for i in expected}
    assert {s["session_id"] for s in found["items"]} == wanted
    assert found["total"] == len(wanted)


def test_sessions_search_by_time(proxy, seeded):
    run_id = seeded.run["id"]

    def count(**params) -> int:
        query = {"run_id": run_id, **{k: v.isoformat() for k, v in params.items()}}
        return proxy.ok("GET", "/admin/api/sessions", params=query)["total"]

    assert count(created_after=seeded.started) == len(REWARDS) + 1
    assert count(created_after=seeded.finished) == 0
    assert count(created_before=seeded.started) == 0
    naive = seeded.finished.replace(tzinfo=None)  # a time without a zone is UTC
    assert count(created_before=naive) == len(REWARDS) + 1
    bad = proxy.call("GET", "/admin/api/sessions", params={"status": "lost"})
    assert error_of(bad, 422)["param"] == "query.status"


def test_session_detail_has_the_same_tokens_as_the_rest_api(proxy, seeded):
    """The token viewer's rows are GET /rl/sessions/{id}'s rows, with texts and turn marks."""
    for session_id in (seeded.session_ids[0], seeded.session_ids[1]):
        rest = proxy.ok("GET", f"/rl/sessions/{session_id}")
        detail = proxy.ok("GET", f"/admin/api/sessions/{session_id}")
        assert detail["turns"] == rest["turns"] and detail["rows"] == rest["rows"]
        assert len(detail["token_rows"]) == len(rest["rows"])
        for viewed, row in zip(detail["token_rows"], rest["rows"], strict=True):
            assert viewed["ids"] == row["input_ids"]
            assert viewed["loss_mask"] == row["loss_mask"]
            assert viewed["logprobs"] == row["logprobs"]
            assert viewed["versions"] == row["versions"]
            assert len(viewed["pieces"]) == len(row["input_ids"])
            trained = [i for i, mask in enumerate(row["loss_mask"]) if mask]
            assert [i for i, turn in enumerate(viewed["turn"]) if turn >= 0] == trained
    assert len(proxy.ok("GET", f"/admin/api/sessions/{seeded.session_ids[0]}")["rows"]) == 2
    assert error_of(proxy.call("GET", "/admin/api/sessions/sess-nope"), 404)


def test_engines_show_health_load_and_version(proxy):
    (engine,) = proxy.ok("GET", "/admin/api/engines")
    assert engine["healthy"] is True
    assert engine["running"] == 0 and engine["queued"] == 0
    assert engine["served_tokens"] > 0 and engine["weight_version"] is not None
    assert engine["tokens_per_second"] >= 0


# --------------------------------------------------------------------------------------------
# pages: login, cookie, redirects


PAGES = [
    "/admin",
    "/admin/runs",
    "/admin/runs/{run_id}",
    "/admin/sessions",
    "/admin/sessions/{session_id}",
    "/admin/pool",
    "/admin/static/plotly.min.js",
    "/admin/static/dashboard.js",
]


def login(proxy: Proxy, key: str, **headers) -> httpx.Response:
    return proxy.http.post(
        "/admin/login",
        data={"key": key, "next": "/admin/sessions"},
        headers=headers,
        follow_redirects=False,
    )


@pytest.mark.parametrize("page", PAGES)
def test_pages_redirect_to_the_login_without_the_key(proxy, seeded, page):
    path = page.format(run_id=seeded.run["id"], session_id=seeded.session_ids[0])
    reply = proxy.http.get(path, follow_redirects=True, headers={"Cookie": "proxrl_admin=forged"})
    assert reply.status_code == 200
    assert reply.url.path == "/admin/login"
    assert 'name="key"' in reply.text
    for shown in ('id="charts"', "Token viewer", "data-session-id", "Plotly"):
        assert shown not in reply.text


def test_login_with_a_wrong_key_is_refused(proxy):
    reply = login(proxy, "not-the-key")
    assert reply.status_code == 401
    assert "not the admin key" in reply.text and "set-cookie" not in reply.headers


def test_login_sets_a_strict_http_only_cookie_that_opens_the_dashboard(proxy, seeded):
    reply = login(proxy, ADMIN_KEY)
    assert reply.status_code == 303 and reply.headers["location"] == "/admin/sessions"
    cookie = reply.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert "path=/admin" in cookie.lower() and "secure" not in cookie.lower()  # plain http
    assert ADMIN_KEY not in cookie
    value = reply.cookies["proxrl_admin"]
    with httpx.Client(base_url=proxy.url, cookies={"proxrl_admin": value}) as browser:
        for page in PAGES:
            path = page.format(run_id=seeded.run["id"], session_id=seeded.session_ids[0])
            shown = browser.get(path, follow_redirects=True)
            assert shown.status_code == 200 and shown.url.path != "/admin/login", path
        assert browser.get("/admin/api/runs").status_code == 200
        # the cookie opens the dashboard only, not the rest of the admin API
        assert browser.get("/rl/runs").status_code == 401
        out = browser.post("/admin/logout", follow_redirects=False)
        assert out.status_code == 303 and 'proxrl_admin=""' in out.headers["set-cookie"]
        assert "max-age=0" in out.headers["set-cookie"].lower()


def test_the_cookie_is_secure_over_https(proxy):
    """Behind a TLS-terminating proxy on loopback (X-Forwarded-Proto: https) the cookie is
    Secure."""
    reply = login(proxy, ADMIN_KEY, **{"X-Forwarded-Proto": "https"})
    assert reply.status_code == 303
    assert "secure" in reply.headers["set-cookie"].lower()


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/rl/runs"])
def test_login_never_redirects_off_the_dashboard(proxy, target):
    reply = proxy.http.post(
        "/admin/login", data={"key": ADMIN_KEY, "next": target}, follow_redirects=False
    )
    assert reply.status_code == 303 and reply.headers["location"] == "/admin/runs"


def test_pages_show_the_seeded_run_and_session(proxy, seeded):
    cookies = {"proxrl_admin": login(proxy, ADMIN_KEY).cookies["proxrl_admin"]}
    with httpx.Client(base_url=proxy.url, cookies=cookies) as browser:
        runs = browser.get("/admin/runs").text
        assert seeded.run["id"] in runs
        session_id = seeded.session_ids[1]
        page = browser.get(f"/admin/sessions/{session_id}")
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        rows = proxy.ok("GET", f"/rl/sessions/{session_id}")["rows"]
        shown = [int(x) for x in _attributes(page.text, 'data-id="')]
        assert shown == [i for row in rows for i in row["input_ids"]]
        listed = browser.get("/admin/sessions", params={"run_id": seeded.run["id"]}).text
        assert all(sid in listed for sid in seeded.session_ids)
        empty_run = proxy.new_run()["id"]
        assert "No trainer steps yet" in browser.get(f"/admin/runs/{empty_run}").text
        nothing = browser.get("/admin/sessions", params={"run_id": empty_run}).text
        assert "No session matches" in nothing
        bad = browser.get("/admin/sessions", params={"reward_min": "lots"}).text
        assert "reward_min: cannot read" in bad
        script = browser.get("/admin/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
        assert script.headers["content-encoding"] == "gzip" and len(script.content) > 1_000_000
        again = browser.get(
            "/admin/static/plotly.min.js", headers={"If-None-Match": script.headers["etag"]}
        )
        assert again.status_code == 304


def test_eval_figures_are_served_and_eval_sessions_marked(proxy):
    """The run's series carries the eval figures GET /rl/runs/{id} shows; its training reward
    buckets leave eval sessions out; the sessions list and page mark them; the run page has
    the held-out chart."""
    run_id = proxy.new_run()["id"]
    ids = []
    for value, task, flag in [(1.0, "heldout", True), (0.0, "heldout", True), (0.5, "t", False)]:
        session = proxy.new_session(run_id, task_id=task, eval=flag)
        chat(session, [{"role": "user", "content": "2+2?"}])
        proxy.ok("POST", f"/rl/sessions/{session['session_id']}/reward", json={"reward": value})
        proxy.ok("POST", f"/rl/sessions/{session['session_id']}/end")
        ids.append(session["session_id"])
    data = series(proxy, run_id)
    figures = proxy.ok("GET", f"/rl/runs/{run_id}")["eval"]
    assert data["eval"] == figures
    (per_task,) = figures["tasks"]
    assert (per_task["task_id"], per_task["count"], per_task["mean"]) == ("heldout", 2, 0.5)
    assert (per_task["std"], per_task["min"], per_task["max"]) == (0.5, 0.0, 1.0)
    assert [(b["count"], b["mean"]) for b in data["rewards"]] == [(1, 0.5)]
    found = proxy.ok("GET", "/admin/api/sessions", params={"run_id": run_id})["items"]
    assert {item["session_id"]: item["eval"] for item in found} == dict(
        zip(ids, [True, True, False], strict=True)
    )
    evaluated = proxy.ok("GET", "/admin/api/sessions", params={"status": "evaluated"})["items"]
    assert set(ids[:2]) <= {item["session_id"] for item in evaluated}
    cookies = {"proxrl_admin": login(proxy, ADMIN_KEY).cookies["proxrl_admin"]}
    with httpx.Client(base_url=proxy.url, cookies=cookies) as browser:
        assert 'data-chart="eval"' in browser.get(f"/admin/runs/{run_id}").text
        listed = browser.get("/admin/sessions", params={"run_id": run_id}).text
        assert listed.count('class="pill eval"') == 2
        assert 'class="pill eval"' in browser.get(f"/admin/sessions/{ids[0]}").text
        assert 'class="pill eval"' not in browser.get(f"/admin/sessions/{ids[2]}").text


def _attributes(html: str, prefix: str) -> list[str]:
    parts = html.split(prefix)[1:]
    return [part.split('"', 1)[0] for part in parts]


def test_step_body_round_trips_as_json(proxy):
    """What the trainer sends (floats, ints, strings, lists, nulls) comes back unchanged."""
    run_id = proxy.new_run()["id"]
    metrics = {"a": 1.5, "b": 3, "c": "text", "d": [0, 1.5, None, "x"], "e": None}
    assert proxy.post_step(run_id, 7, 3, **metrics).status_code == 201
    (point,) = series(proxy, run_id)["steps"]
    assert json.dumps(point["metrics"], sort_keys=True) == json.dumps(metrics, sort_keys=True)
