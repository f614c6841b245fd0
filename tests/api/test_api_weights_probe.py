"""``POST /admin/weights/probe``: the server and its (real, embedded) engine read a probe file
the trainer wrote, and say why not when they cannot (publish.mode=disk's start check)."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.common import weights_probe
from server.common.weights_probe import PROBE_NAME
from tests.api.api_support import ADMIN_KEY, app_settings, assert_error
from tests.support import free_port


def probe(api, path, token, status=200):
    return api.ok("POST", "/admin/weights/probe", status, json={"path": str(path), "token": token})


def test_a_probe_both_see_is_readable(api, engine, tmp_path):
    token = secrets.token_hex(16)
    path = tmp_path / "weights" / PROBE_NAME
    path.parent.mkdir()
    path.write_text(token)
    answer = probe(api, path, token)
    assert answer["readable"] is True
    fine = {"checked": True, "answered": True, "readable": True, "problem": None}
    assert answer["server"] == {"url": None, **fine}
    assert answer["engines"] == [{"url": engine.url, **fine}]


@pytest.mark.parametrize("found", ["missing", "other token", "directory"])
def test_a_probe_not_there_says_what_each_reader_found(api, tmp_path, found):
    token = secrets.token_hex(16)
    path = tmp_path / PROBE_NAME
    if found == "other token":
        path.write_text(secrets.token_hex(16))
    elif found == "directory":
        path.mkdir()
    answer = probe(api, path, token)
    assert answer["readable"] is False
    expected = {"missing": "does not exist", "other token": "another probe", "directory": "cannot"}
    for reader in (answer["server"], *answer["engines"]):
        assert reader["checked"] and reader["answered"] and not reader["readable"]
        assert expected[found] in reader["problem"], reader


# Odd characters in the path: a NUL, a lone surrogate (JSON's "\ud800"), and control
# characters, anywhere in a probe path's directories.
ODD = st.text(
    st.characters(codec=None, categories=("Cc", "Cs", "Co", "Zs", "Ll")) | st.just("\x00"),
    min_size=1,
    max_size=12,
)


def must_be_refused(path: str) -> bool:
    """Whether ``path`` can never be a probe's (NUL or not UTF-8): it must be refused."""
    return "\x00" in path or any(0xD800 <= ord(c) <= 0xDFFF for c in path)


def assert_refused(reply: httpx.Response, path: str) -> None:
    """The server's 4xx: a lone surrogate is refused for any body (400 unservable_json, before
    any route), a NUL by the probe's own check (422)."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in path):
        assert_error(reply, 400, code="unservable_json")
    else:
        assert "NUL" in assert_error(reply, 422)["message"]


def both(api, engine, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """The server's and the engine's answers to ``body`` sent as JSON escapes (a lone
    surrogate is "\\udcff" in JSON; it has no UTF-8 bytes of its own)."""
    raw = json.dumps(body, ensure_ascii=True)
    headers = {"content-type": "application/json"}
    at_server = api.call("POST", "/admin/weights/probe", content=raw, headers=headers)
    at_engine = httpx.post(f"{engine.url}/weights_probe", content=raw, headers=headers, timeout=30)
    return at_server, at_engine


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(odd=ODD)
def test_a_probe_path_with_odd_characters_is_a_422_or_an_answer_never_a_500(
    api, engine, tmp_path, odd
):
    path = f"{tmp_path}/{odd}/{PROBE_NAME}"  # a directory that is not there
    reply, at_engine = both(api, engine, {"path": path, "token": "x"})
    if must_be_refused(path):
        assert_refused(reply, path)
        assert at_engine.status_code == 400, at_engine.text
    else:  # a name the filesystem takes: read (not there), answered
        assert reply.status_code == 200, reply.text
        assert "does not exist" in reply.json()["server"]["problem"]
        assert at_engine.status_code == 200, at_engine.text


@pytest.mark.parametrize("odd", ["\x00", "\ud800", "\udcff"])
def test_a_nul_or_a_lone_surrogate_is_refused_by_both(api, engine, odd):
    path = f"/tmp/a{odd}b/{PROBE_NAME}"
    reply, at_engine = both(api, engine, {"path": path, "token": "x"})
    assert_refused(reply, path)
    assert at_engine.status_code == 400, at_engine.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_fifo_or_a_symlink_at_the_probe_path_is_not_read(api, tmp_path, kind):
    """A FIFO blocked the reading thread for good (open waits for a writer); a symlink could
    point anywhere. Neither is a regular file the trainer wrote."""
    token = secrets.token_hex(16)
    path = tmp_path / PROBE_NAME
    if kind == "fifo":
        os.mkfifo(path)
    else:
        target = tmp_path / "elsewhere"
        target.write_text(token)
        path.symlink_to(target)
    started = time.monotonic()
    answer = probe(api, path, token)
    assert time.monotonic() - started < 30  # no read bound waited out: refused at once
    assert answer["readable"] is False
    for reader in (answer["server"], *answer["engines"]):
        assert reader["answered"] and not reader["readable"]
        assert "cannot be read here" in reader["problem"], reader


@pytest.mark.timeout(120)
def test_a_read_that_blocks_is_answered_within_the_bound_and_holds_nothing(
    api, tmp_path, monkeypatch
):
    """A stale network mount blocks open() in the kernel: stood in for by a read that waits
    on an event. Each reader answers within READ_WAIT_S; the stuck reads hold threads of their
    own (at most MAX_BLOCKED), not the default executor the app's other work uses."""
    release = threading.Event()

    def stuck(path, token):
        release.wait(60)
        return None

    monkeypatch.setattr(weights_probe, "read_problem", stuck)
    monkeypatch.setattr(weights_probe, "READ_WAIT_S", 1.0, raising=False)  # new with the bound
    path = tmp_path / PROBE_NAME
    try:
        started = time.monotonic()
        answer = probe(api, path, "x")
        took = time.monotonic() - started
        # both reads wait 1 s at once; 20 s leaves room for a loaded machine
        assert took < 20, took
        assert answer["readable"] is False
        for reader in (answer["server"], *answer["engines"]):
            assert reader["answered"] and not reader["readable"]
            assert "did not finish within 1 s" in reader["problem"], reader
        # more probes: past MAX_BLOCKED stuck reads, refused at once instead of a thread more
        for _ in range(weights_probe.MAX_BLOCKED):
            answer = probe(api, path, "x")
        assert "earlier reads are still blocked" in answer["server"]["problem"]
        assert api.ok("GET", "/admin/engines")  # the app still answers
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the released reads give their places back
        answer = probe(api, path, "x")
        if answer["server"]["readable"]:
            break
        time.sleep(0.2)
    assert answer["server"]["readable"], answer


def test_an_engine_out_of_rotation_is_reported_unanswered_not_unreadable(
    tiny_model_dir, engine, tmp_path
):
    """One engine down: the others and the server read the probe; the down one is not asked
    (a publish would not load it) and is reported as not answering, so the trainer warns."""
    from server.main import create_app

    dead = f"http://127.0.0.1:{free_port()}"
    settings = app_settings(tiny_model_dir, f"{engine.url},{dead}", tmp_path / "data")
    token = secrets.token_hex(16)
    path = tmp_path / PROBE_NAME
    path.write_text(token)
    with TestClient(create_app(settings)) as client:
        reply = client.post(
            "/admin/weights/probe",
            json={"path": str(path), "token": token},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["readable"] is True
    by_url = {e["url"]: e for e in answer["engines"]}
    assert by_url[engine.url]["readable"] is True
    assert by_url[dead]["answered"] is False and by_url[dead]["readable"] is False
    assert "not asked" in by_url[dead]["problem"]


@pytest.mark.parametrize(
    "body",
    [
        {"path": "/etc/passwd", "token": "x"},  # only a probe file is ever read
        {"path": f"relative/{PROBE_NAME}", "token": "x"},
        {"path": f"/tmp/{PROBE_NAME}", "token": ""},
        {"path": f"/tmp/{PROBE_NAME}", "token": "x" * 65},
        {"path": f"/tmp/{PROBE_NAME}"},
        {"path": 7, "token": "x"},
    ],
)
def test_a_bad_probe_request_is_a_422(api, body):
    reply = api.call("POST", "/admin/weights/probe", json=body)
    assert_error(reply, 422)


def test_a_probe_body_that_is_not_json_is_a_documented_400(api):
    """The fuzzer's case: bytes that are no JSON are a 400, which the schema must list (it
    listed 422, 502 and 503 only)."""
    headers = {"Content-Type": "application/json"}
    reply = api.call("POST", "/admin/weights/probe", content=b"\xbf\xbd\xd3\x98y", headers=headers)
    assert_error(reply, 400)
    documented = api.ok("GET", "/openapi.json", key=None)["paths"]["/admin/weights/probe"]
    assert "400" in documented["post"]["responses"]


def test_the_probe_is_the_admins(api, tmp_path):
    body = {"path": str(tmp_path / PROBE_NAME), "token": "x"}
    run = api.new_run()
    for key in (None, run["api_key"]):
        assert api.call("POST", "/admin/weights/probe", key=key, json=body).status_code in (
            401,
            403,
        )


def test_the_engine_reads_nothing_but_a_probe(engine, tmp_path):
    import httpx

    secret = tmp_path / "secret"
    secret.write_text("token")
    reply = httpx.post(
        f"{engine.url}/weights_probe", json={"path": str(secret), "token": "token"}, timeout=30
    )
    assert reply.status_code == 400
    assert PROBE_NAME in reply.json()["message"]
