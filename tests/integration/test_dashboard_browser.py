"""The dashboard in real headless Chromium (Debian's ``chromium``, driven by Playwright for
Python through ``executable_path``) against a live ``proxrl serve`` whose run has sessions from
the openai SDK, rewards, a weight swap and trainer steps posted over REST.

Screenshots go to artifacts/dashboard/ (git-ignored), or $PROXRL_TEST_ARTIFACTS/dashboard.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support import ROOT, ProxyProcess

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ADMIN_KEY = ProxyProcess.ADMIN_KEY
EXPECTED_REFUSAL = "status of 401"  # the browser logs the wrong-key login's 401 as an error
CHARTS_WITH_DATA = [
    "reward",
    "throughput",
    "sessions",
    "staleness",
    "staleness-histogram",
    "behaviour",
    "breaks",
    "swaps",
    "loss",
]


def step_metrics(step: int, session_ids: list[str]) -> dict:
    """Figures shaped like the trainer's (trainer/loop.py's Progress)."""
    return {
        "time": time.time(),
        "sessions": 2,
        "session_ids": session_ids,
        "dropped_sessions": 0,
        "reward_mean": 0.2 * step,
        "trained_tokens": 40 * step,
        "stale_tokens": 1,
        "staleness_mean": 0.25,
        "staleness_max": 1,
        "staleness_histogram": [30, 10],
        "loss": 1.0 / step,
        "clip_fraction": 0.05,
        "behaviour_masked_fraction": 0.01,
        "behaviour_weight_mean": 0.98,
        "grad_norm": 2.0,
        "train_seconds": 0.5,
        "publish_seconds": 0.1,
        "tokens_per_second": 70.0,
    }


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    """A server, its seeded run id, and the id of a two-turn session in it."""
    data_dir = tmp_path_factory.mktemp("dashboard-browser")
    with (
        ProxyProcess(tiny_model_dir, data_dir) as proxy,
        httpx.Client(base_url=proxy.url, headers=proxy.admin, timeout=60) as http,
    ):
        run = http.post("/rl/runs", json={"name": "browser-run"}).json()
        session_ids = []
        for index in range(3):
            session = http.post("/rl/sessions", json={"run_id": run["id"]}).json()
            with OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
                messages = [{"role": "user", "content": f"{index} + 1 = ?"}]
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6
                )
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "why?"},
                ]
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            sid = session["session_id"]
            http.post(f"/rl/sessions/{sid}/reward", json={"reward": index / 2})
            http.post(f"/rl/sessions/{sid}/end")
            session_ids.append(sid)
        swap = http.post(
            "/admin/weights", json={"model_path": str(tiny_model_dir), "run_id": run["id"]}
        )
        assert swap.status_code == 200, swap.text
        for step in (1, 2, 3):
            body = {"step": step, "version": step, "metrics": step_metrics(step, session_ids)}
            assert http.post(f"/rl/runs/{run['id']}/steps", json=body).status_code == 201
        yield proxy, http, run["id"], session_ids[0]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: apt-get install -y chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def shots() -> Path:
    folder = Path(os.environ.get("PROXRL_TEST_ARTIFACTS") or ROOT / "artifacts") / "dashboard"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {folder}")
    return folder


@pytest.fixture
def page(browser, live):
    """A fresh browser context (no cookie); fails the test on any script error."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    problems: list[str] = []
    opened.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    opened.on(
        "console",
        lambda message: (
            problems.append(f"console: {message.text}")
            if message.type == "error" and EXPECTED_REFUSAL not in message.text
            else None
        ),
    )
    yield opened
    context.close()
    assert not problems, problems


def log_in(page, url: str, key: str = ADMIN_KEY) -> None:
    page.goto(f"{url}/admin")
    assert "/admin/login" in page.url
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")


def test_log_in_and_see_the_run_with_its_charts(page, live, shots):
    proxy, _, run_id, _ = live
    log_in(page, proxy.url)
    page.wait_for_url("**/admin/runs")
    row = page.locator(f'tr[data-run-id="{run_id}"]')
    assert "browser-run" in row.inner_text()
    page.screenshot(path=shots / "runs.png", full_page=True)
    row.locator("a").first.click()
    page.wait_for_url(f"**/admin/runs/{run_id}")
    for chart in CHARTS_WITH_DATA:
        section = page.locator(f'[data-chart="{chart}"][data-drawn="yes"]')
        section.wait_for(timeout=20_000)
        assert section.locator("svg.main-svg").count() >= 1, chart
    mismatch = page.locator('[data-chart="mismatch"]')
    assert mismatch.get_attribute("data-drawn") == "empty"
    assert "does not report" in mismatch.inner_text()
    points = page.evaluate(
        "() => document.getElementById('chart-reward').data"
        ".find(t => t.name === 'trainer batch mean').x.length"
    )
    assert points == 3
    page.screenshot(path=shots / "run-by-time.png", full_page=True)
    page.check('input[name="axis"][value="version"]')
    versions = page.evaluate(
        "() => document.getElementById('chart-reward').data"
        ".find(t => t.name === 'trainer batch mean').x"
    )
    assert versions == [1, 2, 3]
    page.screenshot(path=shots / "run-by-version.png", full_page=True)


def test_charts_update_live_while_the_run_trains(page, live):
    proxy, http, run_id, _ = live
    log_in(page, proxy.url)
    page.wait_for_url("**/admin/runs")
    page.goto(f"{proxy.url}/admin/runs/{run_id}")
    page.locator('[data-chart="reward"][data-drawn="yes"]').wait_for(timeout=20_000)
    count = (
        "() => document.getElementById('chart-reward').data"
        ".find(t => t.name === 'trainer batch mean').x.length"
    )
    before = page.evaluate(count)
    steps = http.get(f"/admin/api/runs/{run_id}/series").json()["step_count"]
    body = {"step": steps + 1, "version": steps + 1, "metrics": step_metrics(steps + 1, [])}
    assert http.post(f"/rl/runs/{run_id}/steps", json=body).status_code == 201
    page.wait_for_function(f"() => ({count})() === {before + 1}", timeout=15_000)


def test_the_token_viewer_shows_the_rest_apis_token_ids(page, live, shots):
    proxy, http, run_id, session_id = live
    log_in(page, proxy.url)
    page.wait_for_url("**/admin/runs")
    page.goto(f"{proxy.url}/admin/sessions?run_id={run_id}")
    page.locator(f'tr[data-session-id="{session_id}"] a').first.click()
    page.wait_for_url(f"**/admin/sessions/{session_id}")
    rest = http.get(f"/rl/sessions/{session_id}").json()
    tokens = page.locator(".tok")
    shown = [int(i) for i in tokens.evaluate_all("els => els.map(e => e.dataset.id)")]
    assert shown == [token for row in rest["rows"] for token in row["input_ids"]]
    masks = [int(m) for m in tokens.evaluate_all("els => els.map(e => e.dataset.mask)")]
    assert masks == [mask for row in rest["rows"] for mask in row["loss_mask"]]
    trained = masks.index(1)
    title = tokens.nth(trained).get_attribute("title")
    assert title.startswith(f"id {shown[trained]} ") and "loss mask 1" in title
    assert "version" in title
    transcript = page.locator(".turn").all_inner_texts()
    assert len(transcript) == 2 and "why?" in transcript[1]
    page.screenshot(path=shots / "session.png", full_page=True)
    page.check('input[name="colour"][value="version"]')
    page.screenshot(path=shots / "session-by-version.png", full_page=True)


def test_a_wrong_key_is_refused(page, live, shots):
    proxy, *_ = live
    log_in(page, proxy.url, key="not-the-admin-key")
    page.locator(".error").wait_for()
    assert "not the admin key" in page.locator(".error").inner_text()
    assert "/admin/login" in page.url
    assert not page.context.cookies()
    page.screenshot(path=shots / "wrong-key.png")


def test_nothing_admin_is_reachable_without_the_key(page, live):
    proxy, _, run_id, session_id = live
    pages = [
        "/admin/runs",
        f"/admin/runs/{run_id}",
        "/admin/sessions",
        f"/admin/sessions/{session_id}",
        "/admin/pool",
    ]
    for path in pages:
        page.goto(f"{proxy.url}{path}")
        assert "/admin/login" in page.url, path
        assert page.locator("input[name=key]").count() == 1
    apis = [
        "/admin/api/runs",
        f"/admin/api/runs/{run_id}/series",
        f"/admin/api/sessions/{session_id}",
        "/admin/api/engines",
        "/admin/static/plotly.min.js",
    ]
    for path in apis:
        reply = page.request.get(f"{proxy.url}{path}", max_redirects=0)
        assert reply.status in (401, 303), (path, reply.status)


def test_engines_page_and_logging_out(page, live, shots):
    proxy, *_ = live
    log_in(page, proxy.url)
    page.wait_for_url("**/admin/runs")
    page.click("text=Engines")
    page.wait_for_url("**/admin/pool")
    assert "healthy" in page.locator("#engines").inner_text()
    page.screenshot(path=shots / "engines.png")
    page.click("text=Log out")
    page.wait_for_url("**/admin/login")
    page.goto(f"{proxy.url}/admin/runs")
    assert "/admin/login" in page.url
