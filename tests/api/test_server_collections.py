"""A started server keeps what it holds for good out of the garbage collector's walks.

A full collection walks every object the collector tracks, with the event loop held. A started
server tracks some 330,000 (torch and transformers' modules, the tokenizer, the store's and the
pool's machinery), and a full collection, which comes every couple of thousand requests, held
every request of every client for about 0.2 s on this machine. The server now freezes them as it
starts (``startup.kept_out_of_collections``): what a full collection walks is counted here, in
objects (work, not time: the machine is shared), with the real app on a real SQLite file, and
handed back to the collector when the server stops.
"""

from __future__ import annotations

import gc
from pathlib import Path

from fastapi.testclient import TestClient

from tests.api.api_support import app_settings

# Objects a full collection may still walk in a started server, idle: the process's own
# since it started (pytest's, this test's). Before the freeze: every object, 330,000 or more.
WALKED_BOUND = 30_000


def test_a_full_collection_in_a_started_server_walks_only_what_came_after(
    tiny_model_dir: Path, engine, tmp_path: Path
):
    from server.main import create_app

    settings = app_settings(tiny_model_dir, engine.url, tmp_path / "data")
    with TestClient(create_app(settings)) as client:
        assert client.get("/health").status_code == 200
        walked, frozen = len(gc.get_objects()), gc.get_freeze_count()
        gc.collect()  # and a collection finds nothing of the server's to free
        assert client.get("/health").status_code == 200
    assert walked < WALKED_BOUND, walked
    assert frozen > 10 * WALKED_BOUND, frozen
    assert gc.get_freeze_count() == 0  # stopped: all of it the collector's again
