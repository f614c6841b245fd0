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
    return ServerSettings(model=str(model), **{"admin_key": None, **flags})


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


@pytest.mark.parametrize(
    ("data_dir", "expected"),
    [
        ("/proc/nope", "--data-dir /proc/nope: cannot write in /proc"),
        ("file", "--data-dir {tmp}/file: it is not a directory"),
        ("file/sub", "--data-dir {tmp}/file/sub: {tmp}/file is not a directory"),
    ],
)
def test_a_data_dir_that_cannot_be_made_or_written_names_the_flag(tmp_path, data_dir, expected):
    (tmp_path / "file").write_text("")
    model = model_dir(tmp_path / "m")
    problem = first_problem(settings(model, data_dir=tmp_path / data_dir, port=free_port()))
    assert problem is not None and problem.startswith(expected.format(tmp=tmp_path)), problem
    assert "\n" not in problem


def test_a_data_dir_to_be_made_passes_and_is_not_made(tmp_path):
    model = model_dir(tmp_path / "m")
    data_dir = tmp_path / "a" / "b"
    assert first_problem(settings(model, data_dir=data_dir, port=free_port())) is None
    assert not (tmp_path / "a").exists() and sorted(tmp_path.iterdir()) == [tmp_path / "m"]


def test_an_explicit_sqlite_file_in_a_folder_that_cannot_be_made(tmp_path):
    problem = first_problem(
        settings(model_dir(tmp_path / "m"), db="sqlite:////proc/nope/x.db", port=free_port())
    )
    assert problem is not None and problem.startswith("--db sqlite:////proc/nope/x.db: "), problem


def test_a_store_that_cannot_be_reached_names_the_flag_and_not_the_password(tmp_path):
    url = "postgresql://proxrl:secret@127.0.0.1:1/proxrl"  # nothing listens on port 1
    problem = first_problem(settings(model_dir(tmp_path / "m"), db=url, port=free_port()))
    assert problem is not None and problem.startswith("--db: cannot open the store: "), problem
    assert "secret" not in problem and "\n" not in problem


def test_a_file_that_is_not_a_store(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"not a database, " * 64)
    url = f"sqlite:///{tmp_path / 'junk.db'}"
    problem = first_problem(settings(model_dir(tmp_path / "m"), db=url, port=free_port()))
    assert problem == "--db: cannot open the store: file is not a database"


def test_every_address_the_host_resolves_to_is_probed(tmp_path):
    """Host "" is every interface: uvicorn binds 0.0.0.0 and [::]; the second one is busy."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(socket.AF_INET6) as busy:
        busy.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        busy.bind(("::", 0))
        busy.listen()
        port = busy.getsockname()[1]
        key = "k-" + "abcdefghijklmnopqrstuvwxyz0123456789"
        problem = first_problem(
            settings(model_dir(tmp_path / "m"), host="", port=port, admin_key=key)
        )
    assert problem == f"--port {port}: [::]:{port} is in use; choose another port"


def test_serve_refuses_a_data_dir_before_it_prints_a_key_or_creates_anything(capsys, tmp_path):
    from server.cli import main

    model = model_dir(tmp_path / "m")
    with pytest.raises(SystemExit) as stop:
        main(
            ["serve", "--model", str(model), "--data-dir", "/proc/nope", "--port", str(free_port())]
        )
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # no admin key, no banner
    assert err.startswith("proxrl serve: --data-dir /proc/nope: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("notaurl", "not a database URL"),
        ("mysql://user:secret@db/proxrl", "unsupported database 'mysql'"),
    ],
)
def test_db_upgrade_refuses_a_bad_url_in_one_line_as_serve_does(capsys, url, expected):
    from server.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["db", "upgrade", "--db", url])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("proxrl: invalid db.upgrade.db: ") and expected in err
    assert err.count("\n") == 1 and "secret" not in err


def test_a_sqlite_store_another_process_serves_is_refused_naming_it(tmp_path):
    """SQLite is one process's store: a second `proxrl serve` on the same file used to start
    and decide admission, retries and weights apart from the first. A real second process
    holds the claim here (``database.SingleServer``, as server_context takes it)."""
    import subprocess
    import sys

    from server.store.database import SingleServer, StoreInUse

    store = tmp_path / "store" / "proxrl.db"
    url = f"sqlite:///{store}"
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from server.store.database import SingleServer; "
            f"claim = SingleServer({url!r}); claim.acquire(); print('held', flush=True); "
            "time.sleep(60)"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        model = model_dir(tmp_path / "m")
        problem = first_problem(settings(model, db=url, port=free_port()))
        assert problem is not None and problem.startswith("--db: the SQLite store ")
        assert f"pid {holder.pid}" in problem and "PostgreSQL" in problem, problem
        with pytest.raises(StoreInUse):
            SingleServer(url).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # The claim went with the process: this one may serve the store now.
    assert first_problem(settings(model_dir(tmp_path / "m2"), db=url, port=free_port())) is None
    claim = SingleServer(url)
    claim.acquire()
    claim.release()
    assert SingleServer("postgresql://u@127.0.0.1/db").problem() is None  # replicas share it
