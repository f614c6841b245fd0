"""The dashboard in real headless Chromium (Debian's ``chromium``, driven by Playwright for
Python through ``executable_path``) against a live ``proxrl serve`` whose run has sessions from
the openai SDK with rewards, and has been trained a few steps on the tiny model by a real
``proxrl train`` (which publishes each version into the engine and reports each step).

Screenshots go to artifacts/dashboard/ (git-ignored), or $PROXRL_TEST_ARTIFACTS/dashboard.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support import DASHBOARD_API_ROUTES, ROOT, ProxyProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ADMIN_KEY = ProxyProcess.ADMIN_KEY
BATCH = 2  # sessions per training step
STEPS = 3  # steps the trainer runs before the browser looks
TRAIN_TIMEOUT_S = 600
EXPECTED_REFUSAL = "status of 401"  # the browser logs the wrong-key login's 401 as an error
CHARTS_WITH_DATA = [
    "reward",
    "eval",
    "throughput",
    "sessions",
    "staleness",
    "staleness-histogram",
    "behaviour",
    "breaks",
    "swaps",
    "loss",
]


@dataclass
class Live:
    proxy: ProxyProcess
    http: httpx.Client
    run_id: str
    session_id: str  # trained: consumed by the trainer
    straddler_id: str  # its first turn sampled by version 0, its second by version STEPS


def step_metrics(step: int, session_ids: list[str]) -> dict:
    """Figures shaped like the trainer's (trainer/loop.py's Progress), for a step posted
    by hand while the page is open."""
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


def chat_session(
    http: httpx.Client,
    run_id: str,
    index: int,
    rewrite: bool = False,
    between: Callable[[], None] | None = None,
) -> str:
    """A two-turn session through the openai SDK, rewarded and ended. Sessions of one
    training batch share a task (a GRPO group). With ``rewrite`` the agent rewrites its history
    before the second turn (a multi-turn prefix break); ``between`` runs between the turns."""
    body = {"run_id": run_id, "task_id": f"t{index // BATCH}"}
    session = http.post("/rl/sessions", json=body)
    assert session.status_code == 201, session.text
    session = session.json()
    with OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        messages = [{"role": "user", "content": f"{index} + 1 = ?"}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
        if between is not None:
            between()
        if rewrite:
            messages = [{"role": "user", "content": "Start again."}]
        else:
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "why?"}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    sid = session["session_id"]
    assert http.post(f"/rl/sessions/{sid}/reward", json={"reward": index % 3 / 2}).is_success
    assert http.post(f"/rl/sessions/{sid}/end").is_success
    return sid


def eval_session(http: httpx.Client, run_id: str, task_id: str, reward: float) -> None:
    """A one-turn evaluation session, rewarded and ended (never trained)."""
    body = {"run_id": run_id, "task_id": task_id, "eval": True}
    session = http.post("/rl/sessions", json=body)
    assert session.status_code == 201, session.text
    session = session.json()
    with OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        messages = [{"role": "user", "content": "2 + 2 = ?"}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    sid = session["session_id"]
    assert http.post(f"/rl/sessions/{sid}/reward", json={"reward": reward}).is_success
    assert http.post(f"/rl/sessions/{sid}/end").json()["status"] == "evaluated"


def train(proxy: ProxyProcess, run_id: str, out: Path) -> None:
    """A real ``proxrl train`` (Ray, an FSDP2 worker) for STEPS steps on the run; it claims
    the sessions, trains, publishes each version into the engine and reports each step."""
    command = [
        sys.executable, "-m", "server.cli", "train", "--server", proxy.url,
        "--admin-key", ADMIN_KEY, f"run_id={run_id}", f"output_dir={out}",
        f"batch_size={BATCH}", f"max_steps={STEPS}", f"max_staleness={STEPS}", "lr=1e-3",
        "claim_wait_s=0.2", "cluster.cpus_per_worker=1", f"checkpoint_every={STEPS}",
    ]  # fmt: skip
    log = out.parent / "trainer.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as sink:
        trainer = subprocess.Popen(
            command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = trainer.wait(TRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
            tail = log.read_text()[-4000:]
            raise AssertionError(f"the trainer did not finish:\n{tail}") from exc
    assert code == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    """A server; its run, trained STEPS steps by a real trainer; a trained two-turn session;
    a session whose turns straddle the training (versions 0 and STEPS)."""
    data_dir = tmp_path_factory.mktemp("dashboard-browser")
    with (
        ProxyProcess(tiny_model_dir, data_dir) as proxy,
        httpx.Client(base_url=proxy.url, headers=proxy.admin, timeout=60) as http,
    ):
        run_id = http.post("/rl/runs", json={"name": "browser-run"}).json()["id"]
        eval_session(http, run_id, "heldout", 0.0)  # held-out scores at version 0 ...
        eval_session(http, run_id, "other", 0.5)
        trained = [chat_session(http, run_id, i) for i in range(BATCH * STEPS)]
        straddler = chat_session(
            http, run_id, BATCH * STEPS, between=lambda: train(proxy, run_id, data_dir / "train")
        )
        chat_session(http, run_id, BATCH * STEPS + 1, rewrite=True)
        eval_session(http, run_id, "heldout", 1.0)  # ... and at version STEPS
        yield Live(proxy, http, run_id, trained[0], straddler)


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
    log_in(page, live.proxy.url)
    page.wait_for_url("**/admin/runs")
    row = page.locator(f'tr[data-run-id="{live.run_id}"]')
    assert "browser-run" in row.inner_text()
    page.screenshot(path=shots / "runs.png", full_page=True)
    row.locator("a").first.click()
    page.wait_for_url(f"**/admin/runs/{live.run_id}")
    assert page.locator("#policy-version").inner_text() == str(STEPS)
    for chart in CHARTS_WITH_DATA:
        section = page.locator(f'[data-chart="{chart}"][data-drawn="yes"]')
        section.wait_for(timeout=20_000)
        assert section.locator("svg.main-svg").count() >= 1, chart
    # Step 1 trains tokens its own starting weights sampled: there the engine's and the
    # trainer's float32 logprobs agree to rounding, so the reported gap is tiny.
    page.locator('[data-chart="mismatch"][data-drawn="yes"]').wait_for(timeout=20_000)
    gaps = page.evaluate(
        "() => document.getElementById('chart-mismatch').data[0].y.filter(y => y !== null)"
    )
    assert gaps and all(0 <= gap < 1e-3 for gap in gaps), gaps
    batch_mean = (
        "() => document.getElementById('chart-reward').data"
        ".find(t => t.name === 'trainer batch mean').x"
    )
    assert len(page.evaluate(batch_mean)) == STEPS
    held_out = page.evaluate(
        "() => document.getElementById('chart-eval').data.map(t => [t.name, t.x, t.y])"
    )
    assert held_out == [
        ["task heldout", [0, STEPS], [0.0, 1.0]],
        ["task other", [0], [0.5]],
        ["all tasks (± std)", [0, STEPS], [0.25, 1.0]],
    ]
    page.screenshot(path=shots / "run-by-time.png", full_page=True)
    page.check('input[name="axis"][value="version"]')
    assert page.evaluate(batch_mean) == list(range(1, STEPS + 1))
    swaps = page.evaluate(
        "() => document.getElementById('chart-swaps').data.find(t => t.name.startsWith('pause')).x"
    )
    assert swaps == list(range(1, STEPS + 1))  # one pause per version the trainer published
    page.screenshot(path=shots / "run-by-version.png", full_page=True)


def test_charts_update_live_while_the_run_trains(page, live):
    log_in(page, live.proxy.url)
    page.wait_for_url("**/admin/runs")
    page.goto(f"{live.proxy.url}/admin/runs/{live.run_id}")
    page.locator('[data-chart="reward"][data-drawn="yes"]').wait_for(timeout=20_000)
    count = (
        "() => document.getElementById('chart-reward').data"
        ".find(t => t.name === 'trainer batch mean').x.length"
    )
    before = page.evaluate(count)
    steps = live.http.get(f"/admin/api/runs/{live.run_id}/series").json()["step_count"]
    body = {"step": steps + 1, "version": steps + 1, "metrics": step_metrics(steps + 1, [])}
    assert live.http.post(f"/rl/runs/{live.run_id}/steps", json=body).status_code == 201
    page.wait_for_function(f"() => ({count})() === {before + 1}", timeout=15_000)


def open_session(page, live, session_id: str) -> dict:
    """Open a session from the run's session list; its GET /rl/sessions/{id}."""
    page.goto(f"{live.proxy.url}/admin/sessions?run_id={live.run_id}")
    page.locator(f'tr[data-session-id="{session_id}"] a').first.click()
    page.wait_for_url(f"**/admin/sessions/{session_id}")
    return live.http.get(f"/rl/sessions/{session_id}").json()


def shown_tokens(page, field: str) -> list[int]:
    return [int(v) for v in page.locator(".tok").evaluate_all(f"els => els.map(e => e.{field})")]


def test_the_token_viewer_shows_the_rest_apis_token_ids(page, live, shots):
    log_in(page, live.proxy.url)
    page.wait_for_url("**/admin/runs")
    rest = open_session(page, live, live.session_id)
    assert rest["status"] == "consumed"
    shown = shown_tokens(page, "dataset.id")
    assert shown == [token for row in rest["rows"] for token in row["input_ids"]]
    masks = shown_tokens(page, "dataset.mask")
    assert masks == [mask for row in rest["rows"] for mask in row["loss_mask"]]
    trained = masks.index(1)
    title = page.locator(".tok").nth(trained).get_attribute("title")
    assert title.startswith(f"id {shown[trained]} ") and "loss mask 1" in title
    assert "version 0" in title
    transcript = page.locator(".turn").all_inner_texts()
    assert len(transcript) == 2 and "why?" in transcript[1]
    page.screenshot(path=shots / "session.png", full_page=True)


def test_the_token_viewer_colours_each_tokens_version(page, live, shots):
    """A session whose second turn came after training: its tokens carry versions 0 and
    STEPS, both in the viewer and in the legend."""
    log_in(page, live.proxy.url)
    page.wait_for_url("**/admin/runs")
    rest = open_session(page, live, live.straddler_id)
    assert shown_tokens(page, "dataset.id") == [t for r in rest["rows"] for t in r["input_ids"]]
    versions = shown_tokens(page, "dataset.version")
    assert versions == [v for row in rest["rows"] for v in row["versions"]]
    assert {v for v in versions if v >= 0} == {0, STEPS}
    page.check('input[name="colour"][value="version"]')
    legend = page.locator("#legend-version")
    assert legend.is_visible()
    assert legend.locator(".swatch").all_inner_texts() == ["v0", f"v{STEPS}"]
    masks = shown_tokens(page, "dataset.mask")
    colour = "els => els.map(e => e.style.backgroundColor)"
    backgrounds = page.locator(".tok").evaluate_all(colour)
    trained = [(b, w) for b, m, w in zip(backgrounds, masks, versions, strict=True) if m]
    by_version = {v: {b for b, w in trained if w == v} for v in (0, STEPS)}
    assert all(len(found) == 1 for found in by_version.values()), by_version
    assert by_version[0] != by_version[STEPS]
    page.screenshot(path=shots / "session-by-version.png", full_page=True)


def test_a_wrong_key_is_refused(page, live, shots):
    log_in(page, live.proxy.url, key="not-the-admin-key")
    page.locator(".error").wait_for()
    assert "not the admin key" in page.locator(".error").inner_text()
    assert "/admin/login" in page.url
    assert not page.context.cookies()
    page.screenshot(path=shots / "wrong-key.png")


def test_nothing_admin_is_reachable_without_the_key(page, live):
    ids = {"run_id": live.run_id, "session_id": live.session_id}
    pages = [
        "/admin/runs",
        "/admin/runs/{run_id}",
        "/admin/sessions",
        "/admin/sessions/{session_id}",
        "/admin/pool",
    ]
    for path in pages:
        page.goto(live.proxy.url + path.format(**ids))
        assert "/admin/login" in page.url, path
        assert page.locator("input[name=key]").count() == 1
        assert page.locator(".tok, #charts, table").count() == 0, path
    for path in DASHBOARD_API_ROUTES:
        reply = page.request.get(live.proxy.url + path.format(**ids), max_redirects=0)
        assert reply.status == 401, (path, reply.status)
        assert reply.json()["error"]["type"] == "authentication_error"
    for script in ("plotly.min.js", "dashboard.js"):
        reply = page.request.get(f"{live.proxy.url}/admin/static/{script}", max_redirects=0)
        assert reply.status == 303 and "/admin/login" in reply.headers["location"]


def test_engines_page_and_logging_out(page, live, shots):
    log_in(page, live.proxy.url)
    page.wait_for_url("**/admin/runs")
    page.click("text=Engines")
    page.wait_for_url("**/admin/pool")
    cells = page.locator("#engines tbody tr").first.locator("td").all_inner_texts()
    assert cells[0].startswith("http://127.0.0.1:") and cells[1] == "healthy"
    assert cells[5] == str(STEPS)  # the weight version the trainer published last
    page.screenshot(path=shots / "engines.png")
    page.click("text=Log out")
    page.wait_for_url("**/admin/login")
    page.goto(f"{live.proxy.url}/admin/runs")
    assert "/admin/login" in page.url
