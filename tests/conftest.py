from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """proxrl's tiny model, built once per test session."""
    from server.common.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A model directory for each architecture of tests/architectures.py (random weights, the
    tiny model's tokenizer), built once per test session; tests read them, never write them."""
    from tests import architectures

    root = tmp_path_factory.mktemp("architectures")
    return {
        name: str(architectures.build(name, root / name, tiny_model_dir))
        for name in architectures.ARCHITECTURES
    }


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session; ``postgres.new_database()`` gives a fresh URL."""
    from tests.postgres import PostgresServer

    server = PostgresServer().start()
    yield server
    server.stop()


# `make test-slow` runs on 2 workers with `--dist loadgroup`, each test in the group
# ``xdist_group`` names: a file's tests stay together (its module fixtures, a wheel and four
# venvs or a browser, are built once), the real-agent lane's files share one group (one server,
# one fixed folder for the agents' prompts), and every test that trains shares another, so two
# training runs never split the two cores between them (their timeouts were set on one core
# each) while the other worker takes the drills, the lane and the installs.
TRAINING = (
    "tests/e2e/",
    "tests/integration/test_architectures_train.py",
    "tests/integration/test_process_cleanup.py",
    "tests/integration/test_ray_",
    "tests/integration/test_trainer_",
    "tests/reliability/test_trainer_kills.py",
)


def xdist_group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    if path.startswith("tests/agents/"):
        return "agents"
    if path.startswith(TRAINING):
        return "training"
    return path


# tryfirst: pytest-xdist reads the markers in its own hook of this name, which a worker registers
# after the conftests (so it would run first and find no marker).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.nodeid)))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
