"""No key reaches a log: a real ``proxrl serve --log-level debug`` with a generated admin key,
its stdout a file as under a service manager (a journal), writes that key and the default
run's key to files only its user can read (mode 0600) and prints where, not the keys; nothing
of any key (admin, run, session, a wrong one tried), the dashboard's cookie or the secret that
signs it appears in its stdout, its log (stderr) or any file under its data dir's logs, after
runs, sessions, chats (streamed too), rewards and a dashboard login.
"""

from __future__ import annotations

import re
import sqlite3
import sys
from pathlib import Path

import httpx

from server.common.processes import ServerProcess
from tests.support import ROOT, free_port

ADMIN_LINE = re.compile(r"^admin key \(generated; [^)]*\): written to (\S+) ", re.MULTILINE)
RUN_LINE = re.compile(
    r"^default run (\S+), run key \(shown once\): written to (\S+) ", re.MULTILINE
)


class LoggedServe(ServerProcess):
    """``proxrl serve`` on loopback with no --admin-key: its stdout in ``stdout_path``, its
    stderr (the log) apart in ``stderr_path``."""

    name = "proxy"
    ready_timeout = 180.0
    stop_timeout = 30.0

    def __init__(self, model_dir: Path, data_dir: Path) -> None:
        port = free_port()
        self.stdout_path, self.stderr_path = data_dir / "stdout.txt", data_dir / "stderr.txt"
        data_dir.mkdir(parents=True)
        command = [
            # the shell sends stderr to its own file, then becomes proxrl serve (exec)
            "sh", "-c", 'exec "$@" 2>"$0"', str(self.stderr_path),
            sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
            "--port", str(port), "--data-dir", str(data_dir), "--log-level", "debug",
        ]  # fmt: skip
        super().__init__(command, f"http://127.0.0.1:{port}", self.stdout_path, cwd=ROOT)


def test_keys_go_to_the_terminal_and_never_to_a_log(  # noqa: PLR0915  # one scenario, start to end
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("PROXRL_ADMIN_KEY", raising=False)
    data = tmp_path / "data"
    secrets_seen: list[str] = []
    session_ids: list[str] = []  # credentials of the path form /sessions/{id}/v1/...
    with LoggedServe(tiny_model_dir, data) as serve:
        printed = serve.stdout_path.read_text()
        (admin_file,) = ADMIN_LINE.findall(printed)
        ((default_run, run_key_file),) = RUN_LINE.findall(printed)
        admin_key, default_key = (private_key(Path(file)) for file in (admin_file, run_key_file))
        secrets_seen += [admin_key, default_key]
        admin = {"Authorization": f"Bearer {admin_key}"}
        with httpx.Client(base_url=serve.url, timeout=120) as http:
            run = http.post("/rl/runs", headers=admin, json={"name": "logged", "config": {}})
            assert run.status_code == 201, run.text
            run_key = run.json()["api_key"]
            secrets_seen.append(run_key)
            for run_id, key in ((default_run, admin_key), (run.json()["id"], run_key)):
                session = http.post(
                    "/rl/sessions", headers={"Authorization": f"Bearer {key}"},
                    json={"run_id": run_id},
                )  # fmt: skip
                assert session.status_code == 201, session.text
                session_id, session_key = session.json()["session_id"], session.json()["api_key"]
                secrets_seen.append(session_key)
                session_ids.append(session_id)
                chat(http, session_key)
                path_form = f"/sessions/{session_id}/v1/chat/completions"  # the id is the key
                body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
                assert http.post(path_form, json=body).status_code == 200
                reward = http.post(
                    f"/rl/sessions/{session_id}/reward", headers=admin, json={"reward": 1.0}
                )
                assert reward.status_code == 200, reward.text
            wrong = "proxrl-sess-" + "x" * 43  # a key that is not one: not logged either
            secrets_seen.append(wrong)
            assert http.get("/rl/runs", headers={"Authorization": f"Bearer {wrong}"}).is_error

            typo = admin_key[:-1] + ("x" if admin_key[-1] != "x" else "y")
            secrets_seen.append(typo)
            assert http.post("/admin/login", data={"key": typo}).status_code == 401
            login = http.post("/admin/login", data={"key": admin_key}, follow_redirects=False)
            assert login.status_code == 303, login.text
            cookie = login.cookies["proxrl_admin"]
            secrets_seen.append(cookie)
        with httpx.Client(base_url=serve.url, cookies={"proxrl_admin": cookie}) as browser:
            for path in ("/admin/runs", "/admin/sessions", f"/admin/runs/{default_run}"):
                assert browser.get(path).status_code == 200, path
        printed = serve.stdout_path.read_text()
    with sqlite3.connect(data / "proxrl.db") as db:
        (dashboard_secret,) = db.execute("SELECT value FROM server_secrets").fetchone()
    secrets_seen.append(dashboard_secret)

    # Its stdout (a journal's) holds no key; uvicorn's access log shares it (every request
    # above, by path).
    assert not [secret for secret in secrets_seen if secret in printed]
    assert '"POST /admin/login HTTP/1.1" 303' in printed
    assert '"POST /sessions/<id>/v1/chat/completions HTTP/1.1" 200' in printed
    assert not [session_id for session_id in session_ids if session_id in printed]
    logs = {"stderr": serve.stderr_path.read_text()}
    logs |= {str(p): p.read_text() for p in (data / "logs").rglob("*") if p.is_file()}
    assert len(logs) >= 2, logs.keys()  # the proxy's log and its engine's
    assert " DEBUG " in logs["stderr"]  # it did log, in detail
    for where, text in logs.items():
        for secret in secrets_seen:
            assert secret not in text, f"a key or secret in {where}"


def private_key(file: Path) -> str:
    """The key in ``file``, which its owner alone may read."""
    assert file.stat().st_mode & 0o777 == 0o600, oct(file.stat().st_mode)
    return file.read_text().strip()


def chat(http: httpx.Client, session_key: str) -> None:
    """A plain and a streamed chat completion with the session's key."""
    headers = {"Authorization": f"Bearer {session_key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    reply = http.post("/v1/chat/completions", headers=headers, json=body)
    assert reply.status_code == 200, reply.text
    with http.stream(
        "POST", "/v1/chat/completions", headers=headers, json={**body, "stream": True}
    ) as streamed:
        assert streamed.status_code == 200
        assert "[DONE]" in "".join(streamed.iter_text())
