"""``proxrl serve --engine sglang``: the command each SGLang server runs, the flags that apply,
and a clear exit where SGLang is not installed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from pydantic import ValidationError

from server.engine_client import sglang
from server.settings import ServerSettings
from tests.support import ROOT


def settings(**fields) -> ServerSettings:
    return ServerSettings(model="/models/qwen", engine="sglang", **fields)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_command_has_what_proxrl_needs_then_the_users_flags():
    argv = sglang.command(
        settings(sglang_args="--mem-fraction-static 0.8 --chat-template '/a b/t.jinja'"), 0, 31000
    )
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/qwen"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "31000"
    assert flag(argv, "--tp-size") == "1" and flag(argv, "--base-gpu-id") == "0"
    assert flag(argv, "--weight-version") == "0"
    assert argv[-4:] == ["--mem-fraction-static", "0.8", "--chat-template", "/a b/t.jinja"]


def test_each_server_gets_its_own_gpus():
    config = settings(sglang_tp_size=2, num_engines=3)
    firsts = [flag(sglang.command(config, index, 30000), "--base-gpu-id") for index in range(3)]
    assert firsts == ["0", "2", "4"]
    assert flag(sglang.command(config, 2, 30000), "--tp-size") == "2"


def test_the_module_can_be_replaced():
    argv = sglang.command(settings(sglang_module="tests.sglang_double"), 0, 30000)
    assert argv[1:3] == ["-m", "tests.sglang_double"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ("--port 9", "--port"),
        ("--tp-size=4", "--sglang-tp-size"),
        ("--tp 2", "--sglang-tp-size"),
        ("--model-path /x", "--model"),
        ("--host 0.0.0.0", "--host"),
        ("--base-gpu-id 1", "--base-gpu-id"),
        ("--weight-version 7", "--weight-version"),
        ("--tensor-parallel-size 2", "--sglang-tp-size"),
        ("--dp-size 2", "--num-engines"),
        ("--pp-size=2", "one pipeline rank per server"),
        ("--chat-template 'unclosed", "cannot be split"),
    ],
)
def test_flags_proxrl_sets_are_refused_in_sglang_args(args, named):
    with pytest.raises(ValidationError) as raised:
        settings(sglang_args=args)
    assert named in str(raised.value)


def test_sglang_flags_apply_only_when_proxrl_starts_sglang():
    with pytest.raises(ValidationError, match="--sglang-args only apply with --engine sglang"):
        ServerSettings(model="m", sglang_args="--mem-fraction-static 0.5")
    with pytest.raises(ValidationError, match="give one of the two"):
        ServerSettings(model="m", engine="sglang", engines="http://127.0.0.1:30000")
    with pytest.raises(ValidationError, match="--sglang-tp-size only apply"):
        ServerSettings(model="m", engines="http://127.0.0.1:30000", sglang_tp_size=2)
    assert ServerSettings(model="m", engines="http://127.0.0.1:30000").engine == "embedded"
    with pytest.raises(ValidationError, match="--engine-max-running-requests only applies"):
        ServerSettings(model="m", engine="sglang", engine_max_running_requests=8)
    assert ServerSettings(model="m", engine_max_running_requests=8).engine == "embedded"


def test_a_missing_module_says_how_to_install_sglang():
    assert sglang.missing("json.decoder") is None
    message = sglang.missing("no_such_package_here.launch_server")
    assert message is not None
    assert "'no_such_package_here'" in message and 'pip install "sglang[all]"' in message
    assert "--engines URL" in message


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", "/nowhere", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_without_the_module_exits_with_the_install_hint():
    out = serve("--engine", "sglang", "--sglang-module", "no_such_package_here.launch_server")
    assert out.returncode == 2, out.stderr
    assert 'pip install "sglang[all]"' in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_serve_without_sglang_installed_exits_with_the_install_hint():
    out = serve("--engine", "sglang")
    assert out.returncode == 2, out.stderr
    assert "'sglang'" in out.stderr and 'pip install "sglang[all]"' in out.stderr


def test_a_server_that_dies_is_noticed_while_another_is_still_starting(tmp_path):
    """Servers are probed together: the second one exiting stops the wait at once, though the
    first would take its whole timeout, and every one of them is stopped."""
    import sys
    import time

    from server.common.processes import ServerProcess, free_port, wait_all

    slow = ServerProcess(
        [sys.executable, "-c", "import time; time.sleep(60)"], f"http://127.0.0.1:{free_port()}"
    )
    dying = ServerProcess(
        [sys.executable, "-c", "raise SystemExit(3)"],
        f"http://127.0.0.1:{free_port()}",
        tmp_path / "dying.log",
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_all([slow, dying], timeout=30)
    assert time.monotonic() - started < 10
    assert slow.process.poll() is not None  # stopped with the rest


def test_lora_runs_size_the_launched_servers_from_the_serve_flags():
    from server.startup import embedded_flags, lora_limits

    assert lora_limits(settings()) is None
    assert "--enable-lora" not in sglang.command(settings(), 0, 30000, lora_limits(settings()))
    served = settings(lora_max_rank=16, lora_target_modules=["q_proj", "v_proj"])
    argv = sglang.command(served, 0, 30000, lora_limits(served))
    assert "--enable-lora" in argv and flag(argv, "--max-lora-rank") == "16"
    assert argv[
        argv.index("--lora-target-modules") + 1 : argv.index("--lora-target-modules") + 3
    ] == [
        "q_proj",
        "v_proj",
    ]
    assert flag(argv, "--max-loaded-loras") == "8" and flag(argv, "--max-loras-per-batch") == "8"
    embedded = ServerSettings(model="/models/qwen", max_loaded_loras=3)
    assert flag(embedded_flags(embedded, 1), "--max-loaded-loras") == "3"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"engine": "embedded", "lora_max_rank": 8},
            "--lora-max-rank only apply with --engine sglang",
        ),
        (
            {"engine": "embedded", "max_loras_per_batch": 2},
            "--max-loras-per-batch only apply with --engine sglang",
        ),
        ({"engines": "http://127.0.0.1:1", "max_loaded_loras": 2}, "--max-loaded-loras applies"),
        (
            {"engine": "sglang", "lora_max_rank": 8, "max_loaded_loras": 2},
            "--max-loras-per-batch (8) must be at most --max-loaded-loras (2)",
        ),
        (
            {"pinned_adapters_per_engine": 8},
            "--pinned-adapters-per-engine (8) must be less than --max-loaded-loras (8)",
        ),
    ],
)
def test_lora_flags_that_cannot_apply_are_refused(fields, says):
    with pytest.raises(ValidationError, match=re.escape(says)):
        ServerSettings(model="/models/qwen", **fields)
