"""The weight group's rendezvous check speaks to a real torch.distributed store: a store answers
its ping; a port that only accepts connections, or answers something else, is refused within
``RENDEZVOUS_PING_S``; a port nobody listens at, within the wait."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from torch.distributed import TCPStore

from server.common.processes import free_port
from server.rl.weights import RENDEZVOUS_PING_S, rendezvous_problem


def probe(port: int, wait_s: float = 2.0) -> tuple[str | None, float]:
    started = time.perf_counter()
    problem = asyncio.run(rendezvous_problem("127.0.0.1", port, wait_s))
    return problem, time.perf_counter() - started


def test_a_real_store_answers_and_still_serves_after():
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    problem, seconds = probe(store.port)
    assert problem is None and seconds < 1.0
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_a_port_that_only_accepts_is_refused_within_the_ping_bound():
    with socket.create_server(("127.0.0.1", 0)) as silent:
        problem, seconds = probe(silent.getsockname()[1])
    assert problem is not None and "no answer" in problem
    assert seconds < RENDEZVOUS_PING_S + 1


def test_a_server_that_answers_otherwise_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as other:

        def answer_wrongly() -> None:
            connection, _ = other.accept()
            with connection:
                connection.recv(64)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer_wrongly, daemon=True).start()
        problem, _ = probe(other.getsockname()[1])
    assert problem is not None and "not a torch.distributed store" in problem


def test_nobody_listening_is_refused_after_the_wait():
    problem, seconds = probe(free_port(), wait_s=1.0)
    assert problem is not None and "nothing accepted a connection" in problem
    assert seconds < 2.0
