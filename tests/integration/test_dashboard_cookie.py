"""The dashboard's login cookie against a real ``proxrl serve``, and the admin keys it refuses.

A login (POST /admin/login) gives a cookie that opens the dashboard until it expires, also
after a restart on the same store (its secret is kept there); a cookie made the old way (an
HMAC of a fixed label under the key) or signed under any other secret opens nothing, and
changing the admin key logs the browser out. ``--host 0.0.0.0`` with an empty or short admin
key exits 2 with a message that says how to make one, and starts nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.common import admin_keys
from server.dashboard.access import COOKIE, issue_cookie
from server.store import database
from server.store import secrets as store_secrets
from tests.support import ROOT, EngineProcess, ProxyProcess, free_port

ADMIN_KEY = ProxyProcess.ADMIN_KEY
KEY_HASH = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """One engine for every server of this module (they attach to it with --engines)."""
    with EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine-logs")) as started:
        yield started


def serve(tiny_model_dir: Path, data_dir: Path, engine: EngineProcess, *extra: str):
    return ProxyProcess(tiny_model_dir, data_dir, "--engines", engine.url, *extra)


def log_in(url: str, key: str = ADMIN_KEY) -> httpx.Response:
    reply = httpx.post(f"{url}/admin/login", data={"key": key}, follow_redirects=False)
    assert reply.status_code == 303, reply.text
    return reply


def opens(url: str, cookie: str) -> bool:
    """Whether ``cookie`` opens the dashboard's JSON (200) or not (401); anything else fails."""
    reply = httpx.get(f"{url}/admin/api/runs", cookies={COOKIE: cookie})
    assert reply.status_code in (200, 401), reply.text
    return reply.status_code == 200


def page_opens(url: str, cookie: str) -> bool:
    reply = httpx.get(f"{url}/admin/runs", cookies={COOKIE: cookie}, follow_redirects=False)
    assert reply.status_code in (200, 303), reply.text
    return reply.status_code == 200


def stored_secret(data_dir: Path) -> bytes:
    with sqlite3.connect(data_dir / "proxrl.db") as db:
        rows = db.execute("SELECT name, value FROM server_secrets").fetchall()
    assert [name for name, _ in rows] == [store_secrets.DASHBOARD_COOKIE]
    return bytes.fromhex(rows[0][1])


def test_a_login_outlives_a_restart_and_ends_with_the_key(tiny_model_dir, tmp_path, engine):
    data = tmp_path / "data"
    with serve(tiny_model_dir, data, engine) as first:
        reply = log_in(first.url)
        assert "max-age=43200" in reply.headers["set-cookie"].lower()  # 12 hours
        cookie = reply.cookies[COOKIE]
        assert ADMIN_KEY not in cookie and KEY_HASH not in cookie
        assert opens(first.url, cookie) and page_opens(first.url, cookie)

        old_way = hmac.new(ADMIN_KEY.encode(), b"proxrl dashboard session v1", hashlib.sha256)
        assert not opens(first.url, old_way.hexdigest())
        assert not page_opens(first.url, old_way.hexdigest())
        expires_at = int(time.time()) + 3600
        for secret in (ADMIN_KEY.encode(), b"", secrets.token_bytes(32)):
            assert not opens(first.url, issue_cookie(secret, KEY_HASH, expires_at))
        # What the server signs with is the secret in its store, and only that.
        secret = stored_secret(data)
        assert opens(first.url, issue_cookie(secret, KEY_HASH, expires_at))
        assert not opens(first.url, issue_cookie(secret, KEY_HASH, int(time.time()) - 1))

    with serve(tiny_model_dir, data, engine) as second:  # the same store: the same secret
        assert opens(second.url, cookie) and page_opens(second.url, cookie)
    assert stored_secret(data) == secret

    with serve(tiny_model_dir, data, engine, "--admin-key", "a-new-admin-key") as rekeyed:
        assert not opens(rekeyed.url, cookie) and not page_opens(rekeyed.url, cookie)
        assert opens(rekeyed.url, log_in(rekeyed.url, "a-new-admin-key").cookies[COOKIE])

    with serve(tiny_model_dir, tmp_path / "elsewhere", engine) as other_store:
        assert not opens(other_store.url, cookie)  # the same key, another store's secret


def test_a_login_expires(tiny_model_dir, tmp_path, engine):
    with serve(tiny_model_dir, tmp_path / "data", engine, "--dashboard-login-hours", "0.001") as p:
        reply = log_in(p.url)
        assert "max-age=4" in reply.headers["set-cookie"].lower()  # 3.6 s, rounded
        cookie = reply.cookies[COOKIE]
        assert opens(p.url, cookie)
        time.sleep(4.5)
        assert not opens(p.url, cookie) and not page_opens(p.url, cookie)
        assert opens(p.url, log_in(p.url).cookies[COOKIE])  # logging in again works


@pytest.fixture(params=["sqlite", "postgres"])
def migrated_store(request, tmp_path) -> str:
    if request.param == "postgres":
        url = request.getfixturevalue("postgres").new_database()
    else:
        url = f"sqlite:///{tmp_path / 'proxrl.db'}"
    database.upgrade(url)
    return url


def test_servers_starting_together_make_one_secret(migrated_store):
    """Eight servers (each its own thread, event loop and connections) ask a new store for
    the secret at once: one is made, all of them get it."""
    got: list[bytes] = []
    start = threading.Barrier(8)

    async def one_server() -> bytes:
        engine = database.connect(migrated_store)
        try:
            start.wait()
            maker = database.sessionmaker(engine)
            return await store_secrets.get_or_create(maker, store_secrets.DASHBOARD_COOKIE)
        finally:
            await engine.dispose()

    threads = [
        threading.Thread(target=lambda: got.append(asyncio.run(one_server()))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(got) == 8 and len(set(got)) == 1
    assert len(got[0]) == store_secrets.SECRET_BYTES


def serve_command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("flags", "env_key", "expected"),
    [
        (("--admin-key", ""), None, "--admin-key (PROXRL_ADMIN_KEY) is empty"),
        ((), "", "--admin-key (PROXRL_ADMIN_KEY) is empty"),
        (("--admin-key", "short-key"), None, "with a weak --admin-key (PROXRL_ADMIN_KEY): 9 "),
        (("--admin-key", "ab" * 20), None, "40 characters, 2 different"),
    ],
)
def test_serve_off_loopback_refuses_an_empty_or_weak_key(
    tiny_model_dir, tmp_path, flags, env_key, expected
):
    env = {k: v for k, v in os.environ.items() if k != "PROXRL_ADMIN_KEY"}
    if env_key is not None:
        env["PROXRL_ADMIN_KEY"] = env_key
    data, port = tmp_path / "data", free_port()
    common = ("--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", str(port))
    out = serve_command(*common, "--data-dir", str(data), *flags, env=env)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("proxrl: invalid serve: ") and expected in line
    assert admin_keys.HOW_TO_MAKE_ONE in line
    assert out.stdout == ""  # nothing served: no key printed, no address announced
    assert not data.exists()  # no store made, no engine started
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
