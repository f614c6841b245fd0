"""The in-process API tier: the proxy app of ``create_app`` with a real SQLite store (a temporary
file) and its real engine client, driven through ``fastapi.testclient.TestClient`` (which runs
the app's lifespan as is: migrations, the tokenizer, the engine pool, the default run).

The engine is the real embedded engine (``server.engine``) on the tiny model, served by uvicorn
in a thread of the test process on 127.0.0.1: its scheduler on a thread of its own, the same
app and SGLang protocol the engine process serves. It starts in well under a second once the
tiny model is built. The proxy attaches to it with ``--engines`` (``engine_urls``), so it starts
no process of its own.

One proxy serves the whole test session; tests that depend on a run's config create a run of
their own (``Api.new_run``). The shared engine stays at version 0: a module that publishes
weights runs an engine of its own (``app_with_own_engine``), since an app running on a fresh store
takes an engine serving another version out of rotation at its next health check (and one that
starts on a fresh store resets it to the base model).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from tests.api.api_support import ADMIN_KEY, Api, app_settings

START_TIMEOUT_S = 30.0


class ThreadedEngine:
    """The embedded engine in this process: its scheduler thread and a uvicorn thread bound to
    a loopback socket of its own (no port race)."""

    def __init__(self, model_dir: Path) -> None:
        from server.engine.app import create_app as create_engine_app
        from server.engine.service import EngineService
        from server.engine.settings import EngineSettings

        # The flags the proxy's own launcher passes (server.startup.launch_embedded).
        settings = EngineSettings(
            model=str(model_dir),
            num_threads=1,
            incremental_streaming_output=True,
            log_level="warning",
        )
        self.service = EngineService(settings)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(create_engine_app(self.service), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            name="api-tier-engine",
            daemon=True,  # a teardown that fails cannot keep the test process alive
        )

    def start(self) -> ThreadedEngine:
        self.service.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive(), "the engine's HTTP server ended while starting"
            assert time.monotonic() < deadline, f"the engine did not start in {START_TIMEOUT_S}s"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.close()
        self.socket.close()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[ThreadedEngine]:
    started = ThreadedEngine(tiny_model_dir).start()
    yield started
    started.stop()


@pytest.fixture(scope="session")
def api(tiny_model_dir: Path, engine: ThreadedEngine, tmp_path_factory) -> Iterator[Api]:
    from server.main import create_app
    from server.settings import ServerSettings

    settings = ServerSettings(
        model=str(tiny_model_dir),
        engines=engine.url,
        data_dir=tmp_path_factory.mktemp("api-proxy"),
        admin_key=ADMIN_KEY,
        log_level="warning",
    )
    with TestClient(create_app(settings)) as client:
        yield Api(client, tiny_model_dir)


@contextmanager
def app_with_own_engine(
    model_dir: Path, data_dir: Path, **extra
) -> Iterator[tuple[Api, ThreadedEngine]]:
    """An app on an engine of its own (the weights it loads are its business), with the
    settings of ``app_settings`` and the test's own (``extra``)."""
    from server.main import create_app

    engine = ThreadedEngine(model_dir).start()
    try:
        with TestClient(create_app(app_settings(model_dir, engine.url, data_dir, **extra))) as c:
            yield Api(c, model_dir), engine
    finally:
        engine.stop()
