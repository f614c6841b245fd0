"""The ``proxrl`` entry point: its subcommands, their help and their refusals (the import rules
between our packages are test_layers.py's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from server.engine.settings import EngineSettings
from server.settings import ServerSettings
from tests.support import ROOT


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_the_subcommands():
    out = run("--help")
    assert out.returncode == 0
    assert "model" in out.stdout and "engine" in out.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("engine", "--help"), "--incremental-streaming-output"),
        (("model", "--help"), "init"),
        (("model", "init", "--help"), "--size"),
        (("serve", "--help"), "--admin-key"),
        (("db", "--help"), "upgrade"),
        (("db", "upgrade", "--help"), "--db"),
        (("demo", "--help"), "--minutes"),
    ],
)
def test_subcommand_help(args, expected):
    out = run(*args)
    assert out.returncode == 0 and expected in out.stdout


@pytest.mark.parametrize(
    ("command", "settings"), [("serve", ServerSettings), ("engine", EngineSettings)]
)
def test_help_names_each_flags_environment_variable(command, settings):
    prefix = settings.model_config["env_prefix"]
    out = run(command, "--help", env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 0
    options = out.stdout.split("\noptions:\n")[1]
    entries = {  # each option's entry by its flag, its help folded onto one line
        entry.split()[0].rstrip(","): " ".join(entry.split())
        for entry in re.split(r"\n(?=  -)", options)
    }
    for field in settings.model_fields:
        entry = entries[f"--{field.replace('_', '-')}"]
        assert f"[env {prefix}{field.upper()}]" in entry, entry


@pytest.mark.parametrize(
    ("settings", "field", "variable"),
    [(ServerSettings, "port", "PROXRL_PORT"), (EngineSettings, "port", "PROXRL_ENGINE_PORT")],
)
def test_env_name_is_the_variable_pydantic_settings_reads(monkeypatch, settings, field, variable):
    from server.settings import env_name

    assert env_name(settings, field) == variable
    monkeypatch.setenv(variable, "4321")
    assert getattr(settings(model="m"), field) == 4321


def test_invalid_flags_name_the_field():
    out = run("engine", "--model", "m", "--max-running-requests", "0")
    assert out.returncode == 2
    assert "max_running_requests" in out.stderr


def test_serve_refuses_an_open_address_without_an_admin_key():
    env = {k: v for k, v in os.environ.items() if k != "PROXRL_ADMIN_KEY"}
    out = run("serve", "--model", "X", "--host", "0.0.0.0", env=env)
    assert out.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an admin key" in out.stderr


def test_model_init_writes_a_model(tmp_path):
    out = run("model", "init", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    assert "parameters" in out.stdout
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert (tmp_path / "m" / "chat_template.jinja").exists()


def test_model_init_context(tmp_path):
    out = run("model", "init", str(tmp_path / "m"), "--context", "65536")
    assert out.returncode == 0, out.stderr
    assert "context 65,536" in out.stdout
    assert (
        json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 65536
    )
    refused = run("model", "init", str(tmp_path / "x"), "--context", "64")
    assert refused.returncode == 2
    assert "context" in refused.stderr and "greater than or equal to 128" in refused.stderr
    assert not (tmp_path / "x").exists()


def test_a_random_model_says_so_and_how_to_get_a_warm_start(tmp_path):
    out = run("model", "init", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    assert "weights are random" in out.stdout
    assert f"proxrl model init {tmp_path / 'm'} --warm-start" in out.stdout


def test_warm_start_writes_the_demos_warmed_up_model(tmp_path, monkeypatch, capsys):
    from server import cli
    from server.common.tiny_model import create_tiny_model

    # source_tree_module puts examples/agents on sys.path unless it is there: put it there for
    # this test only, so the rest of the session imports as it would without it.
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "agents"))
    warm_start = cli.source_tree_module("warm_start", "test")
    monkeypatch.setitem(warm_start.WARMUP, "steps", 2)  # the demo's recipe, cut short
    monkeypatch.setattr(warm_start, "CACHE_DIR", tmp_path / "cache")
    cli.main(["model", "init", str(tmp_path / "warm"), "--warm-start", "--context", "8192"])
    assert "after the demo's warm-up on addition" in capsys.readouterr().out
    config = json.loads((tmp_path / "warm" / "config.json").read_text())
    assert config["max_position_embeddings"] == 8192
    record = json.loads((tmp_path / "warm" / "warmup.json").read_text())
    assert record["steps"] == 2 and record["examples"] == warm_start.WARMUP_EXAMPLES
    random = create_tiny_model(tmp_path / "random", "tiny", "default")
    trained = (tmp_path / "warm" / "model.safetensors").read_bytes()
    assert trained != (random / "model.safetensors").read_bytes()  # not the random weights


def test_warm_start_refuses_another_size_with_status_2(tmp_path, capsys):
    from server import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["model", "init", str(tmp_path / "x"), "--warm-start", "--size", "small"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("proxrl model init: --warm-start makes the tiny model")
        and err.count("\n") == 1
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ((), "no such directory (make a model with `proxrl model init DIR`)"),
        (("tokenizer.json",), "no config.json in it"),
        (("tokenizer.json", "config.json"), "no weights in it (*.safetensors or *.bin)"),
        (("config.json", "model.safetensors"), "no tokenizer.json in it"),
    ],
)
def test_engine_refuses_a_model_directory_short_of_what_it_loads(tmp_path, capsys, files, expected):
    from server.cli import main

    model = tmp_path / "m"
    if files:
        model.mkdir()
        for name in files:
            (model / name).write_text("{}")
    with pytest.raises(SystemExit) as stop:
        main(["engine", "--model", str(model), "--port", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"proxrl engine: --model {model}: {expected}") and err.count("\n") == 1


@pytest.mark.parametrize("command", [["demo"], ["model", "init", "OUT", "--warm-start"]])
def test_an_example_missing_from_the_install_is_one_line(tmp_path, monkeypatch, capsys, command):
    from server import cli

    monkeypatch.setattr(cli, "SOURCE_TREE", tmp_path)  # an install without the examples
    monkeypatch.setattr(cli, "DEMO_SCRIPT", tmp_path / "examples" / "demo.py")
    with pytest.raises(SystemExit) as stop:
        cli.main(command)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is missing; it runs from a clone of proxrl" in err
    assert str(tmp_path / "examples") in err
