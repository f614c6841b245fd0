"""Each role installs alone from the built wheel and does its job.

The wheel is built once; four clean venvs install ``proxrl[engine]``, ``proxrl[serve]``,
``proxrl[train]`` and the base ``proxrl`` (the SDK) from it, with ``requirements/lock.txt`` as
constraints: nothing is resolved anew and torch stays the lock's CPU build (pip's cache is shared
between them). Then they work together as a deployment would: the engine env builds a model and
serves it, the serve-only env (no torch, ray or transformers) proxies that engine, and the
SDK-only env (no fastapi, no torch) talks to the proxy through ``client_sdk``. The train env
(no tracker, Parquet or example packages) starts ``proxrl train`` and imports the trainer's loop.
Each env's size and install time are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, free_port

# Installing the four envs (torch from local disk) takes most of the test's minutes on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LOCK = ROOT / "requirements" / "lock.txt"
ADMIN_KEY = "install-roles-admin-key"
INSTALL_TIMEOUT_S = 420
# What each env must not be able to import: its role does without it.
ABSENT = {
    "engine": ["ray"],
    "serve": ["torch", "ray", "transformers"],
    "train": ["wandb", "mlflow", "pyarrow", "openai", "matplotlib"],
    "sdk": ["fastapi", "torch"],
}
EXTRAS = {"engine": "[engine]", "serve": "[serve]", "train": "[train]", "sdk": ""}


@dataclass
class Env:
    path: Path
    install_s: float

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=self.path
        )

    def size(self) -> str:
        du = subprocess.run(["du", "-sh", self.path], capture_output=True, text=True, timeout=60)
        return du.stdout.split()[0]


def child_env() -> dict[str, str]:
    """No PYTHONPATH (so the source tree cannot stand in for the install), offline hubs."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    return {**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def build_wheel(work: Path) -> Path:
    """The wheel, built from a copy of the sources (the shared tree gets no build/ folder)."""
    source = work / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("server", "trainer", "client_sdk"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            work / "dist",
            source,
        ],
        check=True,
        capture_output=True,
        timeout=180,
        env=child_env(),
    )
    (wheel,) = (work / "dist").glob("proxrl-*.whl")
    return wheel


def install(path: Path, requirement: str) -> Env:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", path], check=True, timeout=120)
    pip = subprocess.run(
        [path / "bin" / "pip", "install", "--quiet", "--constraint", LOCK, requirement],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        env=child_env(),
    )
    assert pip.returncode == 0, f"installing {requirement}:\n{pip.stderr[-3000:]}"
    return Env(path, time.monotonic() - start)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A folder of our own: pytest's numbered temp folders are pruned by concurrent sessions."""
    path = Path(tempfile.mkdtemp(prefix="proxrl-install-roles-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def envs(work) -> dict[str, Env]:
    wheel = build_wheel(work)
    built = {
        role: install(work / role, f"proxrl{extra} @ {wheel.as_uri()}")
        for role, extra in EXTRAS.items()
    }
    for role, env in built.items():
        print(f"\n{role} env: {env.size()}, installed in {env.install_s:.0f} s", end="")
    return built


def started(args: list[str], log: Path, url: str, timeout: float = 180) -> subprocess.Popen:
    """Start ``args`` (output to ``log``) and wait for ``url`` to answer 200."""
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{args[:2]} exited {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    raise AssertionError(f"{url} not ready in {timeout} s:\n{log.read_text()}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.parametrize("role", list(EXTRAS))
def test_each_role_leaves_out_what_it_does_not_need(envs, role):
    env = envs[role]
    code = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = env.run(env.bin("python"), "-c", code, *ABSENT[role])
    assert found.returncode == 0 and found.stdout.strip() == "[]", found
    assert env.run(env.bin("python"), "-m", "pip", "check").returncode == 0


def test_a_missing_role_is_named_not_a_traceback(envs):
    engine = envs["serve"].run(envs["serve"].bin("proxrl"), "engine", "--model", "none")
    assert engine.returncode == 2
    assert (
        engine.stderr.strip()
        == "proxrl engine: torch is not installed: pip install 'proxrl[engine]'"
    )
    serve = envs["sdk"].run(envs["sdk"].bin("proxrl"), "serve", "--model", "none")
    assert serve.returncode == 2
    assert serve.stderr.strip().endswith("is not installed: pip install 'proxrl[serve]'"), serve


def test_the_train_role_starts_the_trainer(envs):
    env = envs["train"]
    usage = env.run(env.bin("proxrl"), "train", "--help")
    assert usage.returncode == 0 and "--server" in usage.stdout, usage
    loop = env.run(env.bin("python"), "-c", "import trainer.loop", timeout=180)
    assert loop.returncode == 0, loop.stderr


SDK_SCRIPT = """
import json, sys
import httpx
from client_sdk import Client

with Client(sys.argv[1], admin_key=sys.argv[2]) as client:
    with client.session(task_id="install-roles") as session:
        reply = httpx.post(
            f"{session.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {session.api_key}"},
            json={"model": sys.argv[3], "messages": [{"role": "user", "content": "2+2="}],
                  "max_tokens": 4},
            timeout=60,
        )
        reply.raise_for_status()
        reward = session.reward(1.0)
    detail = client.get_session(session.id)
print(json.dumps({"reward": reward, "status": detail["status"]}))
"""


def test_the_roles_serve_together(envs, work):
    tmp_path = work / "serving"
    tmp_path.mkdir()
    engine_env, serve_env, sdk_env = envs["engine"], envs["serve"], envs["sdk"]
    model = tmp_path / "tiny"
    init = engine_env.run(engine_env.bin("proxrl"), "model", "init", str(model), timeout=180)
    assert init.returncode == 0, init.stderr

    # With --engines the proxy reads only the tokenizer and the chat template of the model.
    tokenizer = tmp_path / "tokenizer-only" / model.name
    tokenizer.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / name, tokenizer / name)
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    engine = started(
        [engine_env.bin("proxrl"), "engine", "--model", str(model), "--port", str(engine_port)],
        tmp_path / "engine.log",
        f"{engine_url}/health",
    )
    try:
        proxy = started(
            [
                *(serve_env.bin("proxrl"), "serve", "--model", str(tokenizer)),
                *("--engines", engine_url, "--port", str(proxy_port)),
                *("--data-dir", str(tmp_path / "data"), "--admin-key", ADMIN_KEY),
            ],
            tmp_path / "proxy.log",
            f"{proxy_url}/health",
        )
        try:
            sdk = sdk_env.run(sdk_env.bin("python"), "-c", SDK_SCRIPT, proxy_url, ADMIN_KEY, "tiny")
            assert sdk.returncode == 0, sdk.stderr + (tmp_path / "proxy.log").read_text()[-3000:]
            result = json.loads(sdk.stdout)
            assert result["status"] == "trainable" and result["reward"], result
        finally:
            stop(proxy)
    finally:
        stop(engine)
