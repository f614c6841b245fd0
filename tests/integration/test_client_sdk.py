"""client_sdk against a real ``proxrl serve`` process (its embedded engine, its SQLite store):
runs, sessions, chat turns through the stock openai SDK, rewards, errors, and the server's own
429 at the staleness bound, retried after its Retry-After.

One server for the module; each test that depends on a run's config creates its own run.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from client_sdk import (
    AsyncClient,
    AuthenticationError,
    Client,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)
from tests.support import ProxyProcess

ADMIN_KEY = ProxyProcess.ADMIN_KEY
MESSAGES = [{"role": "user", "content": "17+25?"}]
# A run that admits one session: (max_staleness 0 + version 0 + 1) * batch_size 1. The next
# creation waits admission_wait_s, then gets 429 with Retry-After: 1.
ONE_SESSION = {"batch_size": 1, "max_staleness": 0, "admission_wait_s": 0.1}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("client-sdk")) as process:
        yield process


@pytest.fixture
def client(proxy):
    with Client(proxy.url, ADMIN_KEY) as client:
        yield client


class RetryLog(logging.Handler):
    """The client_sdk logger's retry records; ``on_retry(error)`` runs before the wait."""

    def __init__(self, on_retry=None) -> None:
        super().__init__(logging.INFO)
        self.errors: list[Exception] = []
        self.on_retry = on_retry

    def emit(self, record: logging.LogRecord) -> None:
        assert isinstance(record.args, tuple)
        error = record.args[3]
        assert isinstance(error, Exception)
        self.errors.append(error)
        if self.on_retry is not None:
            self.on_retry(error)


@pytest.fixture
def retry_log(caplog):
    caplog.set_level(logging.INFO, logger="client_sdk")
    handler = RetryLog()
    logging.getLogger("client_sdk").addHandler(handler)
    yield handler
    logging.getLogger("client_sdk").removeHandler(handler)


# --------------------------------------------------------------------------------------------
# runs


def test_runs_are_created_listed_shown_and_configured(client):
    created = client.create_run(name="sdk", config={"batch_size": 4})
    assert created["api_key"].startswith("proxrl-run-")
    assert created["config"]["batch_size"] == 4 and created["config"]["max_staleness"] == 1
    assert created["id"] in {run["id"] for run in client.list_runs()}
    shown = client.get_run(created["id"])
    assert shown["name"] == "sdk" and "api_key" not in shown

    updated = client.update_run_config(created["id"], {"max_staleness": 2, "lr": 1e-6})
    assert updated["config"]["max_staleness"] == 2 and updated["config"]["batch_size"] == 4
    assert updated["config"]["lr"] == 1e-6
    assert client.run_metrics(created["id"]) == {
        "run_id": created["id"],
        "policy_version": 0,
        "sessions": {},
        "totals": {
            "turns": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "rows": 0,
            "conversations": 0,
            "breaks": 0,
        },
    }


def test_invalid_config_and_keys_raise_their_errors(proxy, client):
    run = client.create_run()
    with pytest.raises(UnprocessableEntityError) as invalid:
        client.update_run_config(run["id"], {"max_staleness": -1})
    assert "max_staleness" in invalid.value.message
    with (
        Client(proxy.url, "not-a-key", max_retries=0) as stranger,
        pytest.raises(AuthenticationError) as unknown,
    ):
        stranger.list_runs()
    assert unknown.value.status_code == 401 and unknown.value.code == "invalid_api_key"
    with Client(proxy.url, run["api_key"]) as run_client:
        with pytest.raises(PermissionDeniedError):
            run_client.list_runs()
        assert run_client.get_run(run["id"])["id"] == run["id"]  # its own run


# --------------------------------------------------------------------------------------------
# sessions


def test_a_session_records_its_turn_and_its_reward_makes_it_trainable(proxy, client):
    run = client.create_run()
    with client.session(run_id=run["id"], task_id="add", group_id="g1") as session:
        assert session.base_url == f"{proxy.url}/v1" and session.run_id == run["id"]
        with session.openai(max_retries=0) as model:
            reply = model.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        detail = session.get()
        assert detail["status"] == "open" and detail["task_id"] == "add"
        (turn,) = detail["turns"]
        assert turn["completion_id"] == reply.id
        assert len(turn["completion_ids"]) == reply.usage.completion_tokens
        assert len(turn["logprobs"]) == len(turn["versions"]) == len(turn["completion_ids"])
        assert detail["rows"][0]["input_ids"] == turn["prompt_ids"] + turn["completion_ids"]

        assert session.reward(0.5, completion_id=reply.id)["target"] == reply.id
        with pytest.raises(NotFoundError) as unknown:
            session.reward(1.0, completion_id="chatcmpl-nope")
        assert unknown.value.code == "completion_not_found"
        assert session.reward(1.0)["status"] == "open"
    assert client.get_session(session.id)["status"] == "trainable"
    metrics = client.run_metrics(run["id"])
    assert metrics["sessions"] == {"trainable": 1} and metrics["totals"]["turns"] == 1


def test_a_late_reward_by_id_is_idempotent_and_a_different_one_conflicts(client):
    with pytest.raises(RuntimeError), client.session() as session:
        raise RuntimeError("the agent failed")
    assert client.get_session(session.id)["status"] == "ended"  # ended despite the error
    assert session.end()["status"] == "ended"  # ending again is fine

    late = client.reward(session.id, 1.0)
    assert late["created"] and late["status"] == "trainable"
    assert not client.reward(session.id, 1.0)["created"]
    with pytest.raises(ConflictError) as conflict:
        client.reward(session.id, 0.0)
    assert conflict.value.code == "reward_conflict" and conflict.value.status_code == 409
    assert client.end_session(session.id)["status"] == "trainable"


def test_an_unknown_session_is_not_found(client):
    for call in (
        lambda: client.get_session("sess-nope"),
        lambda: client.reward("sess-nope", 1.0),
        lambda: client.end_session("sess-nope"),
    ):
        with pytest.raises(NotFoundError) as missing:
            call()
        assert missing.value.code == "session_not_found"


def test_the_async_client_runs_the_same_flow(proxy):
    async def main() -> str:
        async with AsyncClient(proxy.url, ADMIN_KEY) as client:
            run = await client.create_run(name="async")
            assert run["id"] in {r["id"] for r in await client.list_runs()}
            async with client.session(run_id=run["id"]) as session:
                async with session.async_openai(max_retries=0) as model:
                    reply = await model.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=4
                    )
                (turn,) = (await session.get())["turns"]
                assert turn["completion_id"] == reply.id
                await session.reward(1.0)
            assert (await client.get_session(session.id))["status"] == "trainable"
            assert (await client.run_metrics(run["id"]))["sessions"] == {"trainable": 1}
            return session.id

    assert asyncio.run(main()).startswith("sess")


# --------------------------------------------------------------------------------------------
# the staleness bound: a real 429 with Retry-After


def test_a_429_at_the_staleness_bound_is_retried_after_retry_after(proxy, client, retry_log):
    """The second session is refused; on the client's first retry the run makes room (a
    larger batch_size); the retry, a Retry-After later, is admitted."""
    run = client.create_run(config=ONE_SESSION)
    client.session(run_id=run["id"])

    def make_room(error: Exception) -> None:
        if len(retry_log.errors) == 1:
            client.update_run_config(run["id"], {"batch_size": 2})

    retry_log.on_retry = make_room
    started = time.monotonic()
    with Client(proxy.url, ADMIN_KEY, max_retries=2) as patient:
        admitted = patient.session(run_id=run["id"])
    elapsed = time.monotonic() - started
    (refused,) = retry_log.errors
    assert isinstance(refused, RateLimitError) and refused.retry_after == 1.0
    assert refused.code == "staleness_bound"
    assert elapsed >= 1.0
    assert client.get_session(admitted.id)["status"] == "open"


def test_a_429_is_raised_once_retries_are_spent(proxy, client, retry_log):
    run = client.create_run(config=ONE_SESSION)
    client.session(run_id=run["id"])

    async def refused_twice() -> RateLimitError:
        async with AsyncClient(proxy.url, ADMIN_KEY, max_retries=1) as impatient:
            with pytest.raises(RateLimitError) as raised:
                await impatient.session(run_id=run["id"])
        return raised.value

    started = time.monotonic()
    error = asyncio.run(refused_twice())
    assert time.monotonic() - started >= 1.0  # it waited out one Retry-After
    assert error.retry_after == 1.0 and error.response.status_code == 429
    assert len(retry_log.errors) == 1
    assert client.run_metrics(run["id"])["sessions"] == {"open": 1}


# --------------------------------------------------------------------------------------------
# evaluation sessions


def test_eval_sessions_pass_a_full_bound_and_are_charted_by_version(proxy, client):
    """``session(eval=True)``, sync and async: admitted with the bound full, never trainable,
    and their rewards in the run's ``eval`` figures."""
    run = client.create_run(config=ONE_SESSION)
    client.session(run_id=run["id"])  # the bound is full now
    with client.session(run_id=run["id"], task_id="heldout", eval=True) as session:
        session.openai(max_retries=0).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4
        )
        session.reward(1.0)

    async def async_eval() -> str:
        async with AsyncClient(proxy.url, ADMIN_KEY) as async_client:
            async with async_client.session(run_id=run["id"], eval=True) as evaluated:
                async with evaluated.async_openai(max_retries=0) as model:
                    await model.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=4
                    )
                await evaluated.reward(0.0)
            return evaluated.id

    async_id = asyncio.run(async_eval())
    for session_id in (session.id, async_id):
        detail = client.get_session(session_id)
        assert (detail["eval"], detail["status"]) == (True, "evaluated")
    figures = client.get_run(run["id"])["eval"]
    version = client.get_session(session.id)["turns"][0]["versions"][0]
    assert [(f["version"], f["task_id"], f["count"], f["mean"]) for f in figures["tasks"]] == [
        (version, None, 1, 0.0),
        (version, "heldout", 1, 1.0),
    ]
    assert [(f["count"], f["mean"], f["std"]) for f in figures["versions"]] == [(2, 0.5, 0.5)]
