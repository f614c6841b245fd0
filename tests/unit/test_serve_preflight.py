"""`proxrl serve`'s checks before it creates anything (``server.startup.first_problem``): each
problem is one line naming the flag; a good model directory, store URL and free port pass."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from server.settings import ServerSettings
from server.startup import first_problem

MODEL_FILES = ("tokenizer.json", "config.json", "model.safetensors")


def model_dir(root: Path, files=MODEL_FILES) -> Path:
    root.mkdir()
    for name in files:
        (root / name).write_text("{}")
    return root


def settings(model: Path | str, **flags) -> ServerSettings:
    return ServerSettings(model=str(model), admin_key=None, **flags)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_whole_model_a_good_url_and_a_free_port_pass(tmp_path):
    model = model_dir(tmp_path / "m")
    assert first_problem(settings(model, port=free_port(), data_dir=tmp_path / "d")) is None
    assert not (tmp_path / "d").exists()  # nothing created


@pytest.mark.parametrize(
    ("files", "flags", "expected"),
    [
        (None, {}, "no such directory (make a model with `proxrl model init DIR`)"),
        (("config.json", "model.safetensors"), {}, "no tokenizer.json in it"),
        (("tokenizer.json", "model.safetensors"), {}, "no config.json in it"),
        (("tokenizer.json", "config.json"), {}, "no weights in it (*.safetensors or *.bin)"),
    ],
)
def test_a_model_directory_short_of_what_is_loaded_names_the_flag(tmp_path, files, flags, expected):
    model = tmp_path / "m" if files is None else model_dir(tmp_path / "m", files)
    problem = first_problem(settings(model, **flags))
    assert problem is not None and problem.startswith(f"--model {model}: ")
    assert expected in problem and "\n" not in problem


def test_attached_engines_need_only_the_tokenizer_here(tmp_path):
    model = model_dir(tmp_path / "m", ("tokenizer.json",))
    flags = {"engines": "http://127.0.0.1:30000", "port": free_port()}
    assert first_problem(settings(model, **flags)) is None


def test_a_file_for_a_model_directory(tmp_path):
    (tmp_path / "f").write_text("")
    assert first_problem(settings(tmp_path / "f")) == (
        f"--model {tmp_path / 'f'}: not a directory; give the model's folder"
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mysql://user:secret@db/proxrl", "--db: unsupported database 'mysql'"),
        ("::not a url", "--db: not a database URL"),
    ],
)
def test_a_db_url_the_store_cannot_use(tmp_path, url, expected):
    problem = first_problem(settings(model_dir(tmp_path / "m"), db=url))
    assert problem is not None and problem.startswith(expected)
    assert "secret" not in problem  # the URL, password included, is not repeated


def test_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        problem = first_problem(settings(model_dir(tmp_path / "m"), port=port))
    assert problem == f"--port {port}: 127.0.0.1:{port} is in use; choose another port"


@pytest.mark.parametrize(
    ("command", "env"), [("serve", "PROXRL_MODEL"), ("engine", "PROXRL_ENGINE_MODEL")]
)
def test_a_missing_model_names_the_flag_and_its_variable(monkeypatch, capsys, command, env):
    from server.cli import main

    monkeypatch.delenv(env, raising=False)
    with pytest.raises(SystemExit) as stop:
        main([command])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"proxrl {command}: --model is required (or set {env})\n"


def test_the_model_can_come_from_the_environment(monkeypatch, capsys, tmp_path):
    from server.cli import main

    monkeypatch.setenv("PROXRL_MODEL", str(tmp_path / "absent"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--port", str(free_port())])
    assert stop.value.code == 2  # the start-up check read the variable's directory
    assert f"--model {tmp_path / 'absent'}: no such directory" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_a_missing_flag_of_a_nested_command_is_named(capsys):
    from server.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["db", "upgrade"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "proxrl db upgrade: --db is required\n"
