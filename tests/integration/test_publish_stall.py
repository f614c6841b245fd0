"""A publish cannot stall serving, against a real ``proxrl serve``.

- Weights whose file blocks on open (a FIFO named ``model.safetensors``, as a hung network
  mount would block): the publish is refused with a 400 ``weights_unreadable`` before any
  engine pauses, and chats from other clients go on meanwhile. Before, every engine paused
  first and then waited on the file: no client was answered until the weights timeout (600 s).
- A weight group whose rendezvous address accepts connections but answers nothing: a 422
  ``rendezvous_unreachable`` within seconds. Before, the engines were asked to join and the
  admin call hung for up to 10 minutes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server.rl.weights import RENDEZVOUS_PING_S
from tests.support import ProxyProcess

pytestmark = pytest.mark.timeout(240)

CHATS = 10
CHAT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("publish")) as process:
        yield process


@contextlib.contextmanager
def weights_on_a_fifo(tiny_model_dir: Path, where: Path) -> Iterator[Path]:
    """The tiny model's directory with its weights file a FIFO nobody writes to; released
    after (a reader still blocked on it then gets an empty file)."""
    shutil.copytree(tiny_model_dir, where)
    fifo = where / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        yield where
    finally:
        with contextlib.suppress(OSError):  # ENXIO: nobody is reading it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_unreadable_weights_are_refused_before_any_engine_pauses(proxy, tiny_model_dir, tmp_path):
    session = proxy.session(task_id="bystander")
    chat = openai.OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0,
        timeout=CHAT_TIMEOUT_S,
    )  # fmt: skip
    with weights_on_a_fifo(tiny_model_dir, tmp_path / "stuck") as stuck:
        answer: dict = {}

        def publish() -> None:
            started = time.perf_counter()
            reply = httpx.post(
                f"{proxy.url}/admin/weights", headers=proxy.admin,
                json={"model_path": str(stuck)}, timeout=60,
            )  # fmt: skip
            answer.update(reply=reply, seconds=time.perf_counter() - started)

        publishing = threading.Thread(target=publish)
        publishing.start()
        latencies = []
        for index in range(CHATS):
            started = time.perf_counter()
            chat.chat.completions.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": f"Hi {index}"}]
            )
            latencies.append(time.perf_counter() - started)
        publishing.join(60)
    reply = answer["reply"]
    print(f"publish refused in {answer['seconds']:.2f} s; chats max {max(latencies):.2f} s")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "weights_unreadable"
    assert "model.safetensors" in reply.json()["error"]["message"]
    assert answer["seconds"] < 5.0 and max(latencies) < 2.0


def test_a_rendezvous_that_only_accepts_connections_is_refused_within_seconds(proxy):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        port = silent.getsockname()[1]
        started = time.perf_counter()
        reply = httpx.post(
            f"{proxy.url}/admin/weights/group", headers=proxy.admin, timeout=30,
            json={"master_address": "127.0.0.1", "master_port": port, "backend": "gloo"},
        )  # fmt: skip
        seconds = time.perf_counter() - started
    print(f"silent rendezvous refused in {seconds:.2f} s")
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "rendezvous_unreachable"
    assert "not a torch.distributed store" in reply.json()["error"]["message"]
    assert seconds < RENDEZVOUS_PING_S + 2
