"""The app of ``create_app`` on a store of the test's choosing, a real SQLite file or a real
PostgreSQL database (``store_url``, parametrized over both), with the API tier's engine: for
tests of what each backend can store and serve back. Tests import the fixtures by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api.api_support import ADMIN_KEY, Api


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
def backend_api(store_url: str, tiny_model_dir: Path, engine, tmp_path) -> Iterator[Api]:
    from server.main import create_app
    from server.settings import ServerSettings

    served = httpx.get(f"{engine.url}/model_info", timeout=30).json()["weight_version"]
    assert served in ("0", "default"), (
        f"the shared engine serves version {served}: a module that publishes weights must run "
        "an engine of its own (tests/api/conftest.py: app_with_own_engine)"
    )
    settings = ServerSettings(
        model=str(tiny_model_dir),
        engines=engine.url,
        db=store_url,
        data_dir=tmp_path / "data",
        admin_key=ADMIN_KEY,
        log_level="warning",
    )
    with TestClient(create_app(settings)) as client:
        yield Api(client, tiny_model_dir)
