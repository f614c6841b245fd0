"""Run the embedded engine as a process: ``proxrl engine --model DIR --port P``.

The scheduler (the model) runs on the main thread and HTTP on a second one: torch's OpenMP
kernels ran about twice as slow when driven from a secondary thread on the machine we measured.
SIGTERM and SIGINT stop both: in-flight requests answer with an abort, then the process exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import uvicorn

from server.engine.app import create_app
from server.engine.service import EngineService
from server.engine.settings import EngineSettings, model_directory_problem

log = logging.getLogger(__name__)


def serve(settings: EngineSettings) -> None:
    # A model directory short of what loads, in one line before torch reads it (as serve does).
    problem = model_directory_problem(settings.model)
    if problem is not None:
        print(f"proxrl engine: {problem}", file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    service = EngineService(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(service),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_keep_alive=120,  # longer than any client keeps an idle connection
        )
    )

    def run_http() -> None:
        try:
            server.run()
        finally:  # the HTTP server ended (or never bound its port): stop the engine too
            service.scheduler.request_stop()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %s: stopping", signum)
        service.scheduler.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    http = threading.Thread(target=run_http, name="proxrl-http", daemon=True)
    http.start()
    service.scheduler.run()
    server.should_exit = True
    http.join(timeout=10)
    service.close()
    if not server.started:
        raise SystemExit(f"could not serve on {settings.host}:{settings.port}")
