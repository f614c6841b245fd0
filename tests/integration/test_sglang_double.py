"""The proxy against SGLang 0.5.23's quirks (``tests/sglang_double.py`` in front of a real
embedded engine; the openai SDK as the client): attached with ``--engines``, and launched by
``proxrl serve --engine sglang`` with the double standing in for ``sglang.launch_server``.

The engine behind the doubles enforces a 128-token context; the doubles report it only where
SGLang does (``/v1/models``), or report none, or too much."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.sglang_double import DoubleProcess
from tests.support import EngineProcess, ProxyProcess, command_of, descendants, free_port, kill_all

CONTEXT = 128


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-double-logs")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, logs):
    flags = ("--num-threads", "1", "--context-length", str(CONTEXT))
    with EngineProcess(tiny_model_dir, logs, *flags) as process:
        yield process


def double(engine, logs: Path, name: str, *flags: str) -> DoubleProcess:
    return DoubleProcess(engine.url, logs / f"double-{name}.log", *flags).wait_ready()


@pytest.fixture(scope="module")
def doubles(engine, logs):
    """Two SGLang look-alikes of tensor-parallel sizes 2 and 1, and one that reports no
    context anywhere."""
    started = {
        "tp2": double(engine, logs, "tp2", "--tp-size", "2"),
        "tp1": double(engine, logs, "tp1", "--tp-size", "1"),
        "blind": double(engine, logs, "blind", "--advertise-context", "0"),
    }
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory, doubles):
    urls = ",".join(doubles[name].url for name in ("tp2", "tp1", "blind"))
    flags = ("--engines", urls, "--health-interval-s", "0.5")
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("proxy"), *flags) as process:
        yield process


def engine_table(proxy: ProxyProcess) -> dict[str, dict]:
    rows = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin, timeout=30).json()
    return {row["url"]: row for row in rows}


def client(session: dict) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


MESSAGES = [{"role": "user", "content": "Tell me about numbers."}]


def test_the_context_is_learned_from_v1_models(proxy, doubles):
    table = engine_table(proxy)
    for name, tp_size in (("tp2", 2), ("tp1", 1)):
        row = table[doubles[name].url]
        assert row["healthy"] and row["context_length"] == CONTEXT and row["tp_size"] == tp_size
    session = proxy.session()
    assert client(session).models.list().data[0].model_extra["max_model_len"] == CONTEXT


def test_an_engine_whose_context_is_unknown_is_not_routed_to(proxy, doubles):
    blind = engine_table(proxy)[doubles["blind"].url]
    assert blind["healthy"] is False and blind["context_length"] is None
    assert "context length is unknown" in blind["last_error"]
    assert "--context-length" in blind["last_error"]

    async def run() -> list[str]:
        async def one(stream: bool) -> str:
            session = proxy.session()
            api = AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"], max_retries=0
            )
            try:
                if not stream:
                    reply = await api.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=8
                    )
                    return reply.choices[0].finish_reason
                chunks = await api.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=8, stream=True
                )
                finish = ""
                async for chunk in chunks:
                    finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
                return finish
            finally:
                await api.close()

        return await asyncio.gather(*(one(stream=i % 2 == 1) for i in range(6)))

    assert set(asyncio.run(run())) <= {"stop", "length"}
    assert doubles["blind"].stats()["generate"] == 0
    assert doubles["tp2"].stats()["generate"] + doubles["tp1"].stats()["generate"] >= 6


def test_a_request_over_the_learned_context_is_refused_by_the_proxy(proxy, doubles):
    before = {name: d.stats()["generate"] for name, d in doubles.items()}
    session = proxy.session()
    with pytest.raises(openai.BadRequestError) as refused:
        client(session).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=CONTEXT, stream=True
        )
    assert refused.value.code == "context_length_exceeded"
    assert {name: d.stats()["generate"] for name, d in doubles.items()} == before


@contextlib.contextmanager
def rendezvous() -> Iterator[int]:
    """The port of a torch.distributed store, as rank 0's would be (the proxy asks no engine to
    join where no store answers); the doubles only record the join."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    yield store.port
    del store


def test_weight_group_ranks_follow_each_engines_tp_size(proxy, doubles):
    with rendezvous() as port:
        body = {"master_address": "127.0.0.1", "master_port": port, "backend": "gloo"}
        reply = httpx.post(
            f"{proxy.url}/admin/weights/group", json=body, headers=proxy.admin, timeout=60
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["world_size"] == 1 + 2 + 1
    ((tp2_join,), (tp1_join,)) = (doubles[n].stats()["joins"] for n in ("tp2", "tp1"))
    assert (tp2_join["rank_offset"], tp2_join["world_size"]) == (1, 4)
    assert (tp1_join["rank_offset"], tp1_join["world_size"]) == (3, 4)
    assert doubles["blind"].stats()["joins"] == []


def test_the_weights_probe_says_sglang_engines_cannot_be_checked(proxy, doubles, tmp_path):
    """SGLang has no route that reads a file without loading it: the server reads the
    trainer's probe itself and reports each SGLang engine as unchecked, not as unreadable."""
    from server.common.weights_probe import PROBE_NAME

    path = tmp_path / PROBE_NAME
    path.write_text("t0ken")
    body = {"path": str(path), "token": "t0ken"}
    reply = httpx.post(
        f"{proxy.url}/admin/weights/probe", json=body, headers=proxy.admin, timeout=60
    )
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["readable"] is True and answer["server"]["readable"] is True
    assert {e["url"] for e in answer["engines"]} == {d.url for d in doubles.values()}
    by_url = {e["url"]: e for e in answer["engines"]}
    blind = by_url.pop(doubles["blind"].url)  # no context: out of rotation, not loaded, not asked
    assert blind["answered"] is False and "not asked" in blind["problem"], blind
    assert all(not e["checked"] and "SGLang" in e["problem"] for e in by_url.values()), answer


# ----- an engine that refuses a request the proxy let through -------------------------------


@pytest.fixture(scope="module")
def overstated(engine, logs):
    """A double that claims a 4096-token context over the engine's 128: the engine refuses
    what the proxy lets through, in-band when streamed, as SGLang does."""
    process = double(engine, logs, "overstated", "--advertise-context", "4096")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def trusting_proxy(tiny_model_dir, tmp_path_factory, overstated):
    flags = ("--engines", overstated.url, "--health-interval-s", "0.5")
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("proxy"), *flags) as process:
        yield process


@pytest.mark.parametrize("stream", [True, False])
def test_an_engines_refusal_is_a_400_and_the_engine_stays(trusting_proxy, overstated, stream):
    before = overstated.stats()["generate"]
    session = trusting_proxy.session()
    api = client(session)
    with pytest.raises(openai.BadRequestError) as refused:
        reply = api.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1000, stream=stream
        )
        if stream:  # the SDK raises on the status, before any chunk
            list(reply)
    assert refused.value.status_code == 400
    assert "maximum context length of 128 tokens" in str(refused.value.message)
    assert overstated.stats()["generate"] == before + 1  # not resubmitted
    assert trusting_proxy.get_session(session["session_id"])["turns"] == []
    (row,) = engine_table(trusting_proxy).values()
    assert row["healthy"] and row["failures"] == 0
    answer = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert overstated.stats()["generate"] == before + 2


# ----- proxrl serve --engine sglang, with the double standing in for sglang.launch_server ---


def launched_doubles(proxy: ProxyProcess) -> list[int]:
    return [
        pid for pid in descendants(proxy.process.pid) if "-m tests.sglang_double" in command_of(pid)
    ]


def test_serve_launches_and_supervises_sglang_servers(tiny_model_dir, tmp_path, engine):
    flags = (
        "--engine", "sglang", "--sglang-module", "tests.sglang_double", "--num-engines", "2",
        "--sglang-tp-size", "2", "--sglang-args", f"--upstream {engine.url}",
        "--health-interval-s", "0.5",
    )  # fmt: skip
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "serve", *flags)
    pids: list[int] = []
    try:
        proxy.wait_ready()
        pids = launched_doubles(proxy)
        assert len(pids) == 2
        commands = [command_of(pid) for pid in pids]
        for command in commands:
            assert "--host 127.0.0.1" in command and "--tp-size 2" in command
            assert "--weight-version 0" in command
            assert f"--model-path {tiny_model_dir}" in command
        gpus = sorted(command.split("--base-gpu-id ")[1].split()[0] for command in commands)
        assert gpus == ["0", "2"]  # each server its own two GPUs
        table = engine_table(proxy)
        assert [row["tp_size"] for row in table.values()] == [2, 2]
        assert all(row["healthy"] and row["context_length"] == CONTEXT for row in table.values())
        session = proxy.session()
        reply = client(session).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        with rendezvous() as port:
            body = {"master_address": "127.0.0.1", "master_port": port, "backend": "gloo"}
            group = httpx.post(
                f"{proxy.url}/admin/weights/group", json=body, headers=proxy.admin, timeout=60
            ).json()
        assert group["world_size"] == 5
        assert [e["rank_offset"] for e in group["engines"]] == [1, 3]

        # One server dies: it leaves the rotation; the other serves.
        victim = pids[0]
        kill_all([victim])
        deadline = time.monotonic() + 15
        while sum(row["healthy"] for row in engine_table(proxy).values()) != 1:
            assert time.monotonic() < deadline, engine_table(proxy)
            time.sleep(0.2)
        reply = client(session).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proxy.stop()

    def survivors() -> list[int]:  # zombies (reaped later, no command line) do not count
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        return [pid for pid in alive if "tests.sglang_double" in command_of(pid)]

    deadline = time.monotonic() + 5
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = survivors()  # judged before anything is killed here
    kill_all([pid for pid in pids if Path(f"/proc/{pid}").exists()])
    assert not left


def test_serve_stops_when_an_sglang_server_is_not_ready_in_time(tiny_model_dir, tmp_path):
    nothing_there = f"http://127.0.0.1:{free_port()}"  # /health never answers 200
    flags = (
        "--engine", "sglang", "--sglang-module", "tests.sglang_double",
        "--sglang-args", f"--upstream {nothing_there}", "--sglang-start-timeout-s", "2",
    )  # fmt: skip
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "serve", *flags)
    try:
        with pytest.raises(RuntimeError) as failed:
            proxy.wait_ready(timeout=90)
    finally:
        proxy.stop()
    assert "sglang not ready within 2s" in str(failed.value)
    assert proxy.process.returncode not in (0, None)
    stray = [
        pid
        for pid in map(int, (p.name for p in Path("/proc").iterdir() if p.name.isdigit()))
        if nothing_there.rsplit(":", 1)[1] in command_of(pid) and "sglang_double" in command_of(pid)
    ]
    kill_all(stray)
    assert stray == []


def test_a_stopped_proxy_stops_its_sglang_servers_with_sigkill(tiny_model_dir, tmp_path, engine):
    """Killed outright, the proxy takes its SGLang servers with it (they die with their parent)."""
    flags = (
        "--engine", "sglang", "--sglang-module", "tests.sglang_double",
        "--sglang-args", f"--upstream {engine.url}",
    )  # fmt: skip
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "serve", *flags)
    try:
        proxy.wait_ready()
        pids = launched_doubles(proxy)
        assert len(pids) == 1
        proxy.process.send_signal(signal.SIGKILL)
        proxy.process.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any("tests.sglang_double" in command_of(pid) for pid in pids):
            if time.monotonic() > deadline:
                kill_all(pids)
                pytest.fail("the SGLang stand-in outlived the proxy")
            time.sleep(0.1)
    finally:
        proxy.stop()
