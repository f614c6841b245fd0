"""``POST /admin/weights/probe``: the server and its (real, embedded) engine read a probe file
the trainer wrote, and say why not when they cannot (publish.mode=disk's start check)."""

from __future__ import annotations

import secrets

import pytest

from server.common.weights_probe import PROBE_NAME
from tests.api.api_support import assert_error


def probe(api, path, token, status=200):
    return api.ok("POST", "/admin/weights/probe", status, json={"path": str(path), "token": token})


def test_a_probe_both_see_is_readable(api, engine, tmp_path):
    token = secrets.token_hex(16)
    path = tmp_path / "weights" / PROBE_NAME
    path.parent.mkdir()
    path.write_text(token)
    answer = probe(api, path, token)
    assert answer["readable"] is True
    assert answer["server"] == {"url": None, "checked": True, "readable": True, "problem": None}
    assert answer["engines"] == [
        {"url": engine.url, "checked": True, "readable": True, "problem": None}
    ]


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
        assert reader["checked"] and not reader["readable"]
        assert expected[found] in reader["problem"], reader


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
