"""The load balancer's session rule, for real: HAProxy (Debian's, as the drills run it) with the
drills' configuration (tests/reliability/multihost.py) in front of two tiny HTTP servers on
127.0.0.1, each answering its own name. A session's requests must reach one replica whichever
way it names itself (a key in ``Authorization``, a key in ``x-api-key`` as Anthropic's clients
send it, or its id in the path with any fixed key beside it), and the documented configuration
must be the tested one."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.reliability.multihost import AFFINITY, BALANCE, HAPROXY_CONFIG, haproxy_binary

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["replicas.md", "replicas-drills.md", "kubernetes.md"]
KEYS = [f"sk-session-{i:02d}" for i in range(16)]  # fixed: the spread is checked once, not by luck
SESSIONS = [f"sess_{i:02d}abcdef" for i in range(16)]
REPEATS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _named(name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = name.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[str]:
    backends = []
    for name in ("r0", "r1"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _named(name))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        backends.append(server)
    port = _free_port()
    servers = "\n".join(
        f"    server r{i} 127.0.0.1:{s.server_address[1]} check" for i, s in enumerate(backends)
    )
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        HAPROXY_CONFIG.format(
            stats=tmp_path / "haproxy.sock",
            bind=f"127.0.0.1:{port}",
            balance=BALANCE["session"],
            servers=servers,
        )
    )
    binary = haproxy_binary()
    subprocess.run([binary, "-c", "-q", "-f", str(config)], check=True, timeout=30)
    process = subprocess.Popen(
        [binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "HAProxy did not answer within 20 s"
            assert process.poll() is None, "HAProxy exited"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        for server in backends:
            server.shutdown()
            server.server_close()


def _reached(url: str, requests: list[tuple[str, dict[str, str]]]) -> set[str]:
    """The backends ``requests`` (path, headers) reached, each sent REPEATS times, GET and POST,
    on new connections and on one kept alive."""
    seen = set()
    with httpx.Client(base_url=url, timeout=10) as kept:
        for i in range(REPEATS):
            for path, headers in requests:
                if i % 2:
                    answer = kept.post(path, headers=headers, json={"model": "m"})
                else:
                    answer = httpx.get(url + path, headers=headers, timeout=10)
                assert answer.status_code == 200, answer.text
                seen.add(answer.text)
    return seen


FORMS = {
    "authorization": lambda k, s: ("/v1/chat/completions", {"authorization": f"Bearer {k}"}),
    "x-api-key": lambda k, s: ("/v1/messages", {"x-api-key": k}),
    # An agent's fixed key beside the session's id in the path: the id decides.
    "path": lambda k, s: (f"/sessions/{s}/v1/chat/completions", {"authorization": "Bearer sk-x"}),
    "path, no key": lambda k, s: (f"/sessions/{s}/v1/messages", {}),
    # A run's key, which all its sessions share, beside the session's id: the id decides.
    "x-session-id": lambda k, s: (
        "/v1/chat/completions",
        {"authorization": "Bearer rk-run", "x-session-id": s},
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_a_session_reaches_one_replica_whichever_way_it_names_itself(
    balancer: str, form: str
) -> None:
    placed = {}
    for key, session in zip(KEYS, SESSIONS, strict=True):
        reached = _reached(balancer, [FORMS[form](key, session)])
        assert len(reached) == 1, f"{form} {key}/{session} reached {reached}"
        placed[key] = reached.pop()
    # The sessions are spread (the hash is the session's, not one constant for every request).
    assert set(placed.values()) == {"r0", "r1"}, placed


def test_the_same_key_in_either_header_reaches_the_same_replica(balancer: str) -> None:
    for key in KEYS:
        reached = _reached(
            balancer,
            [
                ("/v1/chat/completions", {"authorization": f"Bearer {key}"}),
                ("/v1/messages", {"x-api-key": key}),
                ("/v1/messages", {"authorization": f"bearer {key}", "x-api-key": key}),
            ],
        )
        assert len(reached) == 1, f"{key} reached {reached}"


def test_the_documented_configuration_is_the_tested_one() -> None:
    for page in DOCS:
        text = (ROOT / "docs" / "operations" / page).read_text()
        for line in AFFINITY.splitlines():
            assert line.strip() in text, f"docs/operations/{page} lacks {line.strip()!r}"
        configured = [line.strip() for line in text.splitlines() if line.startswith("    ")]
        assert not [line for line in configured if line.startswith("balance hdr(")], page
