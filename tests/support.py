"""Helpers for tests that run real processes: an engine process, teacher forcing, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from server.common.processes import EngineProcess as _Launcher
from server.common.processes import ProxyProcess as _Serve
from server.common.processes import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "DASHBOARD_API_ROUTES",
    "ROOT",
    "EngineProcess",
    "ProxyProcess",
    "RestClient",
    "command_of",
    "descendants",
    "free_port",
    "is_loopback_address",
    "kill_all",
    "listening",
    "parse_sse",
    "run_ranks",
    "running",
    "stream_events",
]


def run_ranks(script: str, world: int, *args: object, timeout: float = 240) -> list[str]:
    """``script`` (``python -c``) as ``world`` processes, each given its rank then ``args``, all at
    once (they meet in a process group); each one's output, once every one has exited 0."""
    import subprocess

    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), *map(str, args)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=timeout)[0])
    finally:
        for worker in workers:
            worker.kill()
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
    return outputs


# Every JSON route of the dashboard: each must refuse a request without the admin key.
DASHBOARD_API_ROUTES = [
    "/admin/api/runs",
    "/admin/api/runs/{run_id}",
    "/admin/api/runs/{run_id}/series",
    "/admin/api/sessions",
    "/admin/api/sessions/{session_id}",
    "/admin/api/engines",
]


class EngineProcess(_Launcher):
    """An engine whose log goes to ``log_dir`` (shown if it fails to start)."""

    def __init__(self, model_dir: Path, log_dir: Path, *extra: str) -> None:
        port = free_port()
        super().__init__(model_dir, log_dir / f"engine-{port}.log", *extra, port=port)


def teacher_forced_logprobs(
    model, prompt_ids: list[int], output_ids: list[int], temperature: float
) -> list[float]:
    """log p(output token | everything before it) under ``model``, at ``temperature``."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    t = 1.0 if temperature < 1e-6 else temperature
    log_probs = torch.log_softmax(logits / t, dim=-1)
    return log_probs.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1).tolist()


def logprob_error(model, prompt_ids: list[int], output: dict, temperature: float = 1.0) -> float:
    """Largest gap between a /generate output's logprobs and teacher forcing under ``model``."""
    served = [entry[0] for entry in output["meta_info"]["output_token_logprobs"]]
    expected = teacher_forced_logprobs(model, prompt_ids, output["output_ids"], temperature)
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


def parse_sse(body: str) -> list[dict | str]:
    """The events of an SSE body: parsed JSON, or the string ``[DONE]``."""
    import json

    events: list[dict | str] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream_events(client: httpx.AsyncClient, url: str, body: dict, on_chunk=None) -> list:
    """POST a streaming /generate and collect its events; ``on_chunk(chunk)`` sees each one."""
    import json

    events: list = []
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            event = payload if payload == "[DONE]" else json.loads(payload)
            events.append(event)
            if on_chunk is not None and event != "[DONE]":
                on_chunk(event)
    return events


class AdminSessions:
    """Sessions made and read with the admin key, for anything with a proxy's ``url`` and
    ``admin`` headers."""

    url: str
    admin: dict[str, str]

    def session(self, **body) -> dict:
        """A new session (admin key): its id, api_key and base_url."""
        reply = httpx.post(f"{self.url}/rl/sessions", json=body, headers=self.admin, timeout=60)
        assert reply.status_code == 201, reply.text
        return reply.json()

    def get_session(self, session_id: str) -> dict:
        reply = httpx.get(f"{self.url}/rl/sessions/{session_id}", headers=self.admin, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()


class ProxyProcess(AdminSessions, _Serve):
    """``proxrl serve`` as a real process on loopback (it starts its own embedded engines
    unless ``--engines`` is among ``extra``) with the admin key ``ADMIN_KEY``, offline, its
    whole output in ``data_dir/proxy-{port}.log``; stopped on exit."""

    ADMIN_KEY = "test-admin-key"
    ready_timeout = 180.0
    child_env = ServerProcess.child_env
    log_stdout = True

    def __init__(self, model_dir: Path, data_dir: Path, *extra: str) -> None:
        port = free_port()
        log_path = data_dir / f"proxy-{port}.log"
        super().__init__(
            model_dir, data_dir, self.ADMIN_KEY, *extra, log_path=log_path, cwd=ROOT, port=port
        )


class RestClient:
    """Plain HTTP calls to a running proxy, with a key of the caller's choosing.

    Test modules give it ``process`` (a :class:`ProxyProcess`) and ``http`` (an
    ``httpx.Client`` on its URL), usually as fields of a dataclass that extends it."""

    process: ProxyProcess
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.process.url

    def call(
        self, method: str, path: str, key: str | None = ProxyProcess.ADMIN_KEY, **kwargs
    ) -> httpx.Response:
        """One request; ``key`` goes in ``Authorization: Bearer`` (None: no header)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kwargs.pop("headers", {}))
        return self.http.request(method, path, headers=headers, **kwargs)

    def ok(self, method: str, path: str, status: int = 200, **kwargs) -> dict:
        """The JSON of a call that must answer ``status``."""
        reply = self.call(method, path, **kwargs)
        assert reply.status_code == status, reply.text
        return reply.json()

    def new_run(self, **config) -> dict:
        """A fresh run with ``config``; the answer carries its api_key."""
        return self.ok("POST", "/rl/runs", 201, json={"name": "test", "config": config})

    def patch_run(self, run_id: str, **config) -> dict:
        return self.ok("PATCH", f"/rl/runs/{run_id}", json={"config": config})

    def new_session(
        self, run_id: str | None = None, key: str = ProxyProcess.ADMIN_KEY, **fields
    ) -> dict:
        body = {"run_id": run_id, **fields} if run_id else fields
        return self.ok("POST", "/rl/sessions", 201, key=key, json=body)

    def session(self, session_id: str) -> dict:
        return self.ok("GET", f"/rl/sessions/{session_id}")

    def end(self, session_id: str) -> dict:
        return self.ok("POST", f"/rl/sessions/{session_id}/end")

    def create_while(
        self, run_id: str, unblock: tuple[str, str, dict | None]
    ) -> tuple[httpx.Response, float]:
        """Start creating a session in ``run_id`` (admin key), check that it still waits after
        0.5 s, send ``unblock`` (method, path, JSON body; it must answer 200): the creation's
        response, and how long it took after ``unblock`` was answered."""

        async def run() -> tuple[httpx.Response, float]:
            headers = {"Authorization": f"Bearer {ProxyProcess.ADMIN_KEY}"}
            async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60) as client:
                waiting = asyncio.create_task(client.post("/rl/sessions", json={"run_id": run_id}))
                await asyncio.sleep(0.5)
                assert not waiting.done(), (await waiting).text
                method, path, body = unblock
                unblocked = await client.request(method, path, json=body)
                assert unblocked.status_code == 200, unblocked.text
                started = time.monotonic()
                reply = await waiting
                return reply, time.monotonic() - started

        return asyncio.run(run())

    def wait_for_status(self, session_id: str, wanted: str, timeout: float = 5.0) -> dict:
        """The session once its status is ``wanted`` (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            session = self.session(session_id)
            if session["status"] == wanted or time.monotonic() > deadline:
                assert session["status"] == wanted, f"still {session['status']} after {timeout}s"
                return session
            time.sleep(0.05)


# ----- processes (from /proc) -----------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: each process's parent)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        frontier += children
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still there (a failed test leaves nothing behind)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent has not reaped it yet


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return "?"


def listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The TCP addresses ``pid`` listens on (its socket inodes matched against /proc/net)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue  # it ended meanwhile
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_socket_address(fields[1]))
    return found


def _socket_address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (the kernel's hex, each 32-bit word in host byte order) as an address."""
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    return address, int(port, 16)


def is_loopback_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.0/8, ::1, or 127.x written as an IPv4-mapped IPv6 address."""
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def start_worker(model_dir, lr: float = 1e-3, temperature: float = 1.0):
    """One FSDP2 training worker in this process (gloo, world size 1) on ``model_dir``, set up
    and ready to step; the caller shuts it down."""
    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.worker import Worker, WorkerSettings

    settings = WorkerSettings(
        model_dir=str(model_dir),
        lr=lr,
        optim=OptimConfig(),
        algorithm=AlgorithmConfig(temperature=temperature, off_temperature="mask"),
        seed=0,
        device="cpu",
        threads=1,
    )
    worker = Worker(0, 1, settings)
    worker.setup("127.0.0.1", free_port())
    return worker


def turn_out(
    index: int,
    *,
    surface: str,
    model: str,
    messages: list | None,
    response: dict,
    completion_id: str | None = None,
    request_id: str | None = None,
    created_at: object = "2026-01-01T00:00:00Z",
):
    """A stored turn as ``GET /rl/sessions/{id}`` shows it (``TurnOut``), for tests of what is
    built from turns (the dashboard's transcript): one token each side, the rest as given."""
    from server.rl.schemas import TurnOut

    return TurnOut(
        completion_id=completion_id or f"c{index}",
        request_id=request_id or f"r{index}",
        surface=surface,
        model=model,
        turn_index=index,
        row_index=0,
        extends_previous=index > 0,
        conversation=0,
        messages=messages,
        tools=None,
        response=response,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-0.1],
        versions=[0],
        finish_reason="stop",
        sampling={},
        engine=None,
        resubmits=0,
        reward=None,
        created_at=created_at,
    )


def example_agent_module(name: str):
    """``examples/agents/<name>.py`` imported as ``name`` (as the agents import each other),
    once per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples/agents" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.asynccontextmanager
async def stub_engine_in_loop(tokens: int = 4):
    """bench/stub_engine.py served on a loopback port from the running event loop (SGLang's
    protocol, no model; its pause holds new requests until the continue): its ``Stub`` state
    and its URL."""
    import socket

    import uvicorn

    from bench.proxy import ensure_model
    from bench.stub_engine import Stub, create_app

    stub = Stub(ensure_model(), tokens=tokens)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(stub), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield stub, f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
