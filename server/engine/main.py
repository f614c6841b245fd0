"""Run the embedded engine as a process: ``proxrl engine --model DIR --port P``."""

from __future__ import annotations

import logging
import os

import uvicorn

from server.engine.app import create_app
from server.engine.settings import EngineSettings


def serve(settings: EngineSettings) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
