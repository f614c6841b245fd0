"""Pinning a version of the session's run (``<model>@<N>``, ``<run id>@<N>`` or the
``X-Proxrl-Version`` header) on the in-process app with an engine of its own: a LoRA run publishes
four adapter versions; every surface pinned to an earlier version is answered with that version's
adapter (greedy logprobs equal, bit for bit, to an unpinned answer made while it was current),
its turn recording the model name as asked and the pinned version on every token; version 0 is
the base. Refused, each in its surface's error shape: a version never published (404), another
run's id (404), header and name disagreeing (400), a version retention evicted (410), one whose
files are gone (410), a full-weight run's version other than its current one (409). An engine
holds at most ``--pinned-adapters-per-engine`` pinned adapters (its own /v1/models listing); a
production session is served its run's promoted version.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
import sqlalchemy

from server.store.run_adapters import RUN_ADAPTER_TTL_S
from tests.api.api_support import Api, assert_error
from tests.api.conftest import app_with_own_engine
from tests.integration.test_lora_runs import make_adapter

PROMPT = "Tell me a number."
VERSIONS = (1, 2, 3, 4)
KEPT = 4  # --versions-kept: a fifth publish evicts version 1
PINNED_PER_ENGINE = 2

# Each surface's greedy request for PROMPT under a model name.
SURFACES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    "completions": ("/v1/completions", {"prompt": PROMPT}),
    "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": 6}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}]}),
}


def ask(api: Api, run: dict, surface: str, model: str, version: str | None = None):
    """A greedy request of a fresh session of ``run`` on ``surface`` (``version``: the
    X-Proxrl-Version header); the answer and the session."""
    session = api.new_session(run["id"], key=run["api_key"])
    path, body = SURFACES[surface]
    body = {"model": model, "temperature": 0, **body}
    if surface != "responses":
        body["max_tokens"] = 6
    headers = {} if version is None else {"X-Proxrl-Version": version}
    reply = api.call("POST", path, key=session["api_key"], json=body, headers=headers)
    return reply, session


def served(api: Api, run: dict, surface: str, model: str, version: str | None = None) -> dict:
    """The turn a pinned (or unpinned) greedy request recorded."""
    reply, session = ask(api, run, surface, model, version)
    assert reply.status_code == 200, reply.text
    return api.session(session["session_id"])["turns"][-1]


def run_adapters(api: Api, run_id: str) -> set[str]:
    """The run's adapters the engine lists (its own word, not the proxy's)."""
    (engine,) = api.ok("GET", "/admin/engines")
    cards = httpx.get(f"{engine['url']}/v1/models", timeout=30).json()["data"]
    return {card["id"] for card in cards if card.get("parent") and card["id"].startswith(run_id)}


@pytest.fixture(scope="module")
def lane(tiny_model_dir, tmp_path_factory):
    """A LoRA run at version 4, and each surface's unpinned greedy turn at versions 0 to 4."""
    data, adapters = tmp_path_factory.mktemp("pins"), tmp_path_factory.mktemp("pins-adapters")
    settings = {
        "adapters_kept": 1,
        "versions_kept": KEPT,
        "pinned_adapters_per_engine": PINNED_PER_ENGINE,
    }
    with app_with_own_engine(tiny_model_dir, data, **settings) as (api, _):
        run = api.new_run()
        references = {0: {s: served(api, run, s, "tiny") for s in SURFACES}}
        paths = {}
        for version in VERSIONS:
            paths[version] = make_adapter(tiny_model_dir, adapters / f"v{version}", version)
            body = {"run_id": run["id"], "adapter_path": paths[version]}
            assert api.ok("POST", "/admin/weights", json=body)["policy_version"] == version
            references[version] = {s: served(api, run, s, "tiny") for s in SURFACES}
        yield api, run, references, paths


@pytest.mark.parametrize("surface", SURFACES)
def test_each_surface_pinned_by_name_is_served_that_version(lane, surface):
    api, run, references, _ = lane
    for version in (0, 2, 1):
        reference = references[version][surface]
        assert reference["versions"] == [version] * len(reference["versions"])
        for model in (f"tiny@{version}", f"{run['id']}@{version}"):
            turn = served(api, run, surface, model)
            assert turn["completion_ids"] == reference["completion_ids"], (surface, version)
            assert turn["logprobs"] == reference["logprobs"], (surface, version)
            assert turn["versions"] == [version] * len(turn["versions"])
            assert turn["model"] == model  # what was asked
    assert references[4][surface]["logprobs"] != references[1][surface]["logprobs"]


@pytest.mark.parametrize("surface", SURFACES)
def test_each_surface_pinned_by_header_is_served_that_version(lane, surface):
    api, run, references, _ = lane
    turn = served(api, run, surface, "tiny", version="3")
    assert turn["logprobs"] == references[3][surface]["logprobs"]
    assert turn["versions"] == [3] * len(turn["versions"])
    same = served(api, run, surface, "tiny@3", version="3")  # both, agreeing
    assert same["logprobs"] == references[3][surface]["logprobs"]
    current = served(api, run, surface, "tiny@4")  # the current one, pinned: as unpinned
    assert current["logprobs"] == references[4][surface]["logprobs"]


def test_an_engine_holds_at_most_its_bound_of_pinned_adapters(lane):
    api, run, _, _ = lane
    for version in (1, 2, 3, 1, 2, 3):
        served(api, run, "chat", f"tiny@{version}")
        held = run_adapters(api, run["id"]) - {f"{run['id']}@4"}
        assert len(held) <= PINNED_PER_ENGINE, held
        assert f"{run['id']}@{version}" in held  # the one just served stays until used less
    assert f"{run['id']}@4" in run_adapters(api, run["id"])  # the current one untouched


def anthropic_error(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_what_cannot_be_served_is_refused_in_the_surfaces_shape(lane):
    api, run, _, _ = lane
    other = api.new_run()["id"]
    cases = [
        ("tiny@9", None, 404, "version_not_found", "not_found_error"),
        ("tiny", "9", 404, "version_not_found", "not_found_error"),
        (f"{other}@1", None, 404, "model_not_found", "not_found_error"),
        ("tiny@1", "2", 400, None, "invalid_request_error"),
        ("tiny", "one", 400, None, "invalid_request_error"),
        ("tiny", "-1", 400, None, "invalid_request_error"),
        ("tiny@" + "9" * 5000, None, 400, None, "invalid_request_error"),  # past int's parse
        ("tiny@2147483648", None, 400, None, "invalid_request_error"),
    ]
    for model, header, status, code, anthropic_kind in cases:
        for surface in ("chat", "completions", "responses"):
            assert_error(ask(api, run, surface, model, header)[0], status, code=code)
        anthropic_error(ask(api, run, "messages", model, header)[0], status, anthropic_kind)
    # Streamed, the refusal still comes as a status, before any event.
    session = api.new_session(run["id"], key=run["api_key"])
    body = {"model": "tiny@9", "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    reply = api.call("POST", "/v1/chat/completions", key=session["api_key"], json=body)
    assert_error(reply, 404, code="version_not_found")
    # A name with an "@" that names neither the model nor a run is no pin: served as today; so
    # is one whose "number" is digits only outside ASCII (int() refused them: a 500).
    assert served(api, run, "chat", "claude-3-5-sonnet@20240620")["versions"][0] == 4
    for model in ("tiny@\u00b2", f"{run['id']}@\u00b3"):
        for surface in ("chat", "completions", "responses", "messages"):
            assert ask(api, run, surface, model)[0].status_code == 200, (model, surface)


def test_an_evicted_version_and_one_whose_files_are_gone_answer_410(lane, tiny_model_dir):
    api, run, references, paths = lane
    fifth = make_adapter(tiny_model_dir, f"{paths[4]}-5", 5)
    served(api, run, "chat", "tiny@3")  # loaded as a pinned adapter
    pinned = run_adapters(api, run["id"]) - {f"{run['id']}@4"}
    assert f"{run['id']}@3" in pinned
    api.ok("POST", "/admin/weights", json={"run_id": run["id"], "adapter_path": fifth})
    assert pinned <= run_adapters(api, run["id"])  # a publish leaves the pinned ones loaded
    time.sleep(RUN_ADAPTER_TTL_S)  # a pin's answer is kept that long
    error = assert_error(ask(api, run, "chat", "tiny@1")[0], 410, code="version_evicted")
    assert "versions_kept" in error["message"], error
    anthropic_error(ask(api, run, "messages", "tiny@1")[0], 410, "not_found_error")
    assert served(api, run, "chat", "tiny@2")["logprobs"] == references[2]["chat"]["logprobs"]

    shutil.rmtree(paths[4])  # the trainer's publish.keep_versions pruned it
    for _ in range(2):  # the second refused at once: the version is marked evicted
        error = assert_error(ask(api, run, "chat", "tiny@4")[0], 410, code="version_evicted")
        assert "gone" in error["message"], error
    ctx = api.http.app.state.ctx  # type: ignore[attr-defined]
    with sqlalchemy.create_engine(ctx.settings.database_url).connect() as db:
        rows = db.execute(
            sqlalchemy.text(
                "SELECT version, evicted_reason FROM run_versions WHERE run_id = :run "
                "AND evicted_at IS NOT NULL ORDER BY version"
            ),
            {"run": run["id"]},
        ).all()
    assert [version for version, _ in rows] == [1, 4], rows
    assert rows[1][1] == "files_gone"


def test_a_production_session_is_served_the_promoted_version(lane):
    api, run, references, _ = lane
    session = api.new_session(run["id"], key=run["api_key"])
    ctx = api.http.app.state.ctx  # type: ignore[attr-defined]
    with sqlalchemy.create_engine(ctx.settings.database_url).begin() as db:
        db.execute(
            sqlalchemy.text("UPDATE runs SET promoted_version = 2 WHERE id = :run"),
            {"run": run["id"]},
        )
        db.execute(
            sqlalchemy.text("UPDATE sessions SET production = 1 WHERE id = :session"),
            {"session": session["session_id"]},
        )
    ctx.sessions.forget(session["session_id"])
    ctx.run_adapters._read.pop(run["id"])  # the run read again at once, not in 2 s
    api.chat(session, PROMPT, max_tokens=6, temperature=0)
    turn = api.session(session["session_id"])["turns"][-1]
    assert turn["logprobs"] == references[2]["chat"]["logprobs"]
    assert turn["versions"] == [2] * len(turn["versions"])


def test_a_full_weight_run_serves_only_its_current_version(tiny_model_dir, tmp_path):
    with app_with_own_engine(tiny_model_dir, tmp_path) as (api, _):
        run = api.new_run()
        body = {"run_id": run["id"], "model_path": str(tiny_model_dir), "version": 1}
        api.ok("POST", "/admin/weights", json=body)
        assert served(api, run, "chat", "tiny@1")["versions"][0] == 1
        error = assert_error(ask(api, run, "chat", "tiny@0")[0], 409, code="version_not_servable")
        assert "pin versions of LoRA runs" in error["message"]
        assert_error(ask(api, run, "chat", "tiny", "7")[0], 404, code="version_not_found")
        anthropic_error(ask(api, run, "messages", "tiny@0")[0], 409, "invalid_request_error")
