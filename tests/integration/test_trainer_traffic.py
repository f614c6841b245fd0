"""`proxrl train` against a live `proxrl serve` on the traffic real agents send.

Each test drives a real proxy (tiny model, embedded engine, SQLite) with the real openai SDK and
a real trainer process (Ray, FSDP2), and counts from the outside what the trainer did with:
agents sampling at other temperatures and greedy; sessions that cannot be training rows; rows
longer than a micro-batch; GRPO groups that will never be whole; a lease shorter than a step;
alternatives (n > 1, retries) and per-turn rewards; a checkpoint of another run. A trainer
killed at each point of a step is drilled in tests/reliability/test_trainer_kills.py.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI

from tests.support import ProxyProcess
from tests.trainer_runs import Server, finish, metrics, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MISMATCH_LIMIT = 1e-4  # nats: engine vs trainer on tokens both computed with the same weights


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        yield Server(proxy)


# ----- 1. sampling temperature is part of the data ---------------------------------------------


def test_turns_at_other_temperatures_are_masked_then_trained_off_policy(server, tmp_path):
    out = tmp_path / "train"
    # The run trains at 1.0. A request without a temperature is sampled at the run's.
    plain = [server.episode(reward=float(i % 2)) for i in range(4)]
    warm = [server.episode(temperature=0.7, reward=float(i % 2)) for i in range(2)]
    greedy = [server.episode(temperature=0.0, reward=1.0) for _ in range(2)]
    assert {t["sampling"]["temperature"] for s in plain for t in server.get(s)["turns"]} == {1.0}

    finish(start_trainer(server, out, "batch_size=8", "max_steps=1"))
    (step,) = metrics(out)
    # masked (the default), and counted: the 0.7 tokens by off_temperature, the greedy ones by
    # greedy (a point mass no behaviour weight corrects)
    assert step["off_temperature_tokens"] > 0 and step["off_policy_tokens"] == 0
    assert step["masked_tokens"]["greedy"] > 0
    assert 0 < step["off_temperature_masked_fraction"] < 1
    assert step["logprob_mismatch_mean"] < MISMATCH_LIMIT  # on the tokens that trained
    assert step["dropped_sessions"] == 4 and step["dropped_no_trainable_tokens"] == 4
    for session_ids, why in ((warm, "another temperature than the run's 1"), (greedy, "greedily")):
        for session_id in session_ids:
            shown = server.get(session_id)
            assert shown["status"] == "dropped"
            assert shown["drop_reason"].startswith("no_trainable_tokens:")
            assert why in shown["drop_reason"]
    assert all(server.get(s)["status"] == "consumed" for s in plain)

    # The same run, trained off-policy now: the trainer writes the rule into the run's config.
    # The 0.7 turns train with their own behaviour logprobs; greedy turns stay masked.
    plain = [server.episode(reward=float(i % 2)) for i in range(4)]
    warm = [server.episode(temperature=0.7, reward=float(i % 2)) for i in range(2)]
    greedy = [server.episode(temperature=0.0, reward=1.0) for _ in range(2)]
    finish(
        start_trainer(
            server, out, "batch_size=8", "max_steps=2", "algorithm.off_temperature=off_policy"
        )
    )
    assert server.run["config"]["off_temperature"] == "off_policy"
    step = metrics(out)[-1]
    assert step["step"] == 2 and step["dropped_sessions"] == 2
    assert step["dropped_no_trainable_tokens"] == 2 and step["masked_tokens"]["greedy"] > 0
    assert step["off_policy_tokens"] > 0 and step["off_temperature_tokens"] == 0
    assert step["logprob_mismatch_mean"] < MISMATCH_LIMIT  # off-policy tokens are not in it
    assert all(server.get(s)["status"] == "consumed" for s in plain + warm)
    assert all("greedily" in server.get(s)["drop_reason"] for s in greedy)


def test_the_training_temperature_is_one_value_with_the_run(server, tmp_path):
    out = tmp_path / "train"
    server.configure(temperature=0.7)  # set on the run: the trainer takes it
    sessions = [server.episode(reward=float(i % 2)) for i in range(4)]  # sampled at the run's 0.7
    log = finish(start_trainer(server, out, "batch_size=4", "max_steps=1"))
    assert "temperature 0.7" in log
    (step,) = metrics(out)
    assert step["temperature"] == 0.7 and step["off_temperature_tokens"] == 0
    assert step["logprob_mismatch_mean"] < MISMATCH_LIMIT  # trained at the temperature sampled
    assert all(server.get(s)["status"] == "consumed" for s in sessions)


def wait_for_log(process, text: str, count: int = 1) -> None:
    """Until the trainer's log holds ``text`` ``count`` times (the trainer still running)."""
    deadline = time.monotonic() + 240
    while process.log_path.read_text().count(text) < count:
        assert process.poll() is None, process.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"never logged {text!r} {count} times"
        time.sleep(0.2)


def test_sessions_the_trainer_drops_free_admission_at_once(server, tmp_path):
    """Every session sampled at 0.7 while the run trains at 1.0 (masked: the default), under an
    admission bound of 4 sessions set before the agent starts: the trainer drops each batch,
    which is not a step (nothing trained, published or recorded), so the bound never grows.
    Were the drops only settled at a checkpoint, the agent would wait for admission and the
    trainer for sessions, for ever. The trainer follows the run's batch_size when it changes,
    and confirms each dropped-only claim at once (nothing trained: no checkpoint to wait for)."""
    out = tmp_path / "train"
    server.configure(batch_size=2, max_staleness=1, admission_wait_s=20)  # bound: 4 sessions
    stop = threading.Event()
    created: list[str] = []

    def agent() -> None:
        while not stop.is_set():
            reply = server.http.post("/rl/sessions", json={"task_id": "t"}, timeout=60)
            if reply.status_code == 429:  # at the bound: wait (the server waited 20 s already)
                continue
            assert reply.status_code == 201, reply.text
            session = reply.json()
            client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
            client.chat.completions.create(
                model=server.proxy_model,
                messages=[{"role": "user", "content": "Count."}],
                max_tokens=6,
                temperature=0.7,
            )
            server.reward(session["session_id"], 1.0)
            server.end(session["session_id"])
            created.append(session["session_id"])

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while len(created) < 4:  # the agent is at the bound before the trainer starts
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.1)
    options = ["batch_size=2", "max_staleness=1", "max_steps=1", "checkpoint_every=100"]
    process = start_trainer(server, out, *options)
    try:
        wait_for_log(process, "nothing to train in 2 sessions (2 no_trainable_tokens)", 4)
        server.configure(batch_size=4)  # followed from the next claim on
        wait_for_log(process, "the run's config changed: {'batch_size': 4}")
        wait_for_log(process, "nothing to train in 4 sessions (4 no_trainable_tokens)")
        process.send_signal(signal.SIGTERM)
        log = finish(process, 240)
    finally:
        stop.set()
        thread.join(60)
    assert "not counted as a step" in log
    assert metrics(out) == []  # no step: nothing recorded
    run = server.run
    assert run["policy_version"] == 0  # nothing trained, nothing published
    assert len(created) >= 8  # admission let the agent go on past its bound of 4
    statuses = server.statuses()
    assert "claimed" not in statuses.values()  # every claim confirmed
    dropped = [s for s in created if statuses[s] == "dropped"]
    assert len(dropped) >= 12
    assert all(server.get(s)["drop_reason"].startswith("no_trainable_tokens:") for s in dropped)
    training = run["training"]
    assert training["total_trained_share"] is None  # no step reported its totals
    assert training["dropped_sessions"]["no_trainable_tokens"] == len(dropped)


# ----- 3. bad data never stops the trainer --------------------------------------------------


def test_sessions_that_cannot_train_are_dropped_and_the_trainer_keeps_publishing(server, tmp_path):
    out = tmp_path / "train"
    empty, _ = server.session(task_id="t")  # rewarded and ended without a single model call
    server.reward(empty, 1.0)
    server.end(empty)
    long_one = server.episode(turns=4, max_tokens=12, reward=1.0)  # one row over the row limit
    good = [server.episode(reward=float(i % 2)) for i in range(8)]
    rows = [len(r["input_ids"]) for s in good for r in server.get(s)["rows"]]
    assert min(rows) > 16  # every good row is longer than a micro-batch: each trains alone
    assert max(len(r["input_ids"]) for r in server.get(long_one)["rows"]) > 60 > max(rows)

    process = start_trainer(
        server, out, "batch_size=4", "max_steps=3", "max_staleness=2",
        "algorithm.max_tokens_per_microbatch=16", "algorithm.max_tokens_per_row=60",
    )  # fmt: skip
    extra = [server.episode(reward=float(i % 2)) for i in range(4)]  # enough for three steps
    finish(process)
    steps = metrics(out)
    assert [s["version"] for s in steps] == [1, 2, 3]  # it kept publishing
    assert server.run["policy_version"] == 3
    assert server.get(empty)["status"] == "dropped"
    assert server.get(empty)["drop_reason"].startswith("no_turns:")
    dropped = server.get(long_one)
    assert dropped["status"] == "dropped"
    assert dropped["drop_reason"].startswith("row_too_long: a row of")
    assert "algorithm.max_tokens_per_row (60)" in dropped["drop_reason"]
    trained = {s for step in steps for s in step["session_ids"]} - {long_one, empty}
    assert len(trained) == sum(step["sessions"] for step in steps) - 1  # all but the long one
    assert trained <= set(good + extra)
    assert all(server.get(s)["status"] == "consumed" for s in trained)


# ----- 4. groups never get stuck ------------------------------------------------------------


def test_incomplete_groups_train_after_their_deadline_and_never_block(server, tmp_path):
    out = tmp_path / "train"
    server.configure(group_timeout_s=2.0, reward_timeout_s=1.0)

    def member(group: str | None, task: str | None, reward: float | None = 1.0) -> str:
        body = {k: v for k, v in {"group_id": group, "task_id": task}.items() if v}
        session_id, client = server.session(**body)
        client.chat.completions.create(
            model=server.proxy_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        if reward is not None:
            server.reward(session_id, reward)
        server.end(session_id)
        return session_id

    whole = [member("g1", "t1", 1.0), member("g1", "t1", 0.0)]
    lost = member("g2", "t2", None)  # its reward never comes: dropped at the reward deadline
    survivor = member("g2", "t2", 1.0)  # so its group can never be whole
    by_task = [member(None, "t3", float(i % 2)) for i in range(3)]  # task only: no group id
    keyless = [member(None, None, 1.0) for _ in range(2)]  # neither key
    broken = [*whole, survivor, *by_task, *keyless]
    later = [member(f"g{i}", None, float(j)) for i in (5, 6) for j in (0, 1)]  # whole, newer
    groups = [whole, later[:2], later[2:]]

    finish(start_trainer(server, out, "batch_size=4", "max_steps=2", "algorithm.group_size=2"))
    steps = metrics(out)
    trained = [s for step in steps for s in step["session_ids"]]
    assert len(trained) == len(set(trained)) >= 8
    assert set(broken) <= set(trained)  # oldest first: the broken groups did not wait forever
    assert set(trained) <= set(broken + later)
    for group in groups:  # a whole group trains in one step, never split across two
        steps_of = {i for i, step in enumerate(steps) for s in group if s in step["session_ids"]}
        assert len(steps_of) <= 1, (group, steps_of)
    assert any(set(whole) <= set(step["session_ids"]) for step in steps)
    assert server.get(lost)["status"] == "dropped"
    assert server.get(lost)["drop_reason"].startswith("no_reward:")
    assert all(server.get(s)["status"] == "consumed" for s in trained)


# ----- 6. rewards and alternatives -----------------------------------------------------------


def test_alternatives_train_only_on_their_own_reward_and_late_session_rewards_count(
    server, tmp_path
):
    out = tmp_path / "train"
    model = server.proxy_model
    ask = [{"role": "user", "content": "Count."}]

    def more(messages: list, reply) -> list:
        said = {"role": "assistant", "content": reply.message.content or ""}
        return [*messages, said, {"role": "user", "content": "More."}]

    # n = 2, continued from choice 1: choice 0 is an alternative without a reward of its own
    picked, client = server.session(task_id="t")
    two = client.chat.completions.create(model=model, messages=ask, n=2, max_tokens=6)
    client.chat.completions.create(model=model, messages=more(ask, two.choices[1]), max_tokens=6)
    server.reward(picked, 1.0)
    server.end(picked)
    # a retried request: its first attempt is an alternative
    retried, client = server.session(task_id="t")
    client.chat.completions.create(model=model, messages=ask, max_tokens=6)
    again = client.chat.completions.create(model=model, messages=ask, max_tokens=6)
    client.chat.completions.create(model=model, messages=more(ask, again.choices[0]), max_tokens=6)
    server.reward(retried, 0.0)
    server.end(retried)
    # n = 2 where the choice not continued has a reward of its own: it trains on that alone
    scored, client = server.session(task_id="t")
    both = client.chat.completions.create(model=model, messages=ask, n=2, max_tokens=6)
    server.reward(scored, 0.25, completion_id=both.choices[1].completion_id)
    server.reward(scored, 1.0)
    server.end(scored)
    # per-turn rewards, then the end: trainable only once the session reward comes
    late, client = server.session(task_id="t")
    first = client.chat.completions.create(model=model, messages=ask, max_tokens=6)
    server.reward(late, 0.5, completion_id=first.id)
    server.end(late)
    assert server.get(late)["status"] == "ended"
    assert server.reward(late, 0.0)["status"] == "trainable"  # accepted after per-turn ones

    turns = {s: server.get(s)["turns"] for s in (picked, retried, scored)}
    flags = {
        s: [t["alternative"] for row in server.get(s)["rows"] for t in row["turns"]] for s in turns
    }
    assert sorted(flags[picked]) == [False, False, True]
    assert sorted(flags[retried]) == [False, False, True]
    unrewarded = [  # choice 0 of `picked` and the first attempt of `retried`
        len(t["completion_ids"])
        for s in (picked, retried)
        for row in server.get(s)["rows"]
        for span in row["turns"]
        if span["alternative"]
        for t in turns[s]
        if t["completion_id"] == span["completion_id"]
    ]
    finish(start_trainer(server, out, "batch_size=4", "max_steps=1"))
    (step,) = metrics(out)
    assert step["alternative_tokens"] == sum(unrewarded) > 0  # masked and counted
    assert step["dropped_sessions"] == 0
    assert all(server.get(s)["status"] == "consumed" for s in (picked, retried, scored, late))


# ----- 5. exactly once ----------------------------------------------------------------------


LEASE = 0.4  # seconds; renewed every 0.1 s (a quarter of it, at least 0.1 s)


def test_a_lease_shorter_than_the_claims_are_held_is_renewed_and_never_handed_out_twice(
    server, tmp_path
):
    out = tmp_path / "train"
    # all at version 0; rows long enough that steps of 8 PPO minibatches take a while
    sessions = [server.episode(reward=float(i % 2), max_tokens=64) for i in range(24)]
    stop = threading.Event()
    stolen: list[str] = []

    def rival() -> None:
        """Another claimer, all the time: it would get any session whose lease lapsed."""
        run_id = server.run["id"]
        with httpx.Client(
            base_url=server.proxy.url, headers=server.proxy.admin, timeout=30
        ) as http:
            while not stop.is_set():
                body = {"max_sessions": 1, "lease_s": 30}
                claim = http.post(f"/rl/runs/{run_id}/claims", json=body).json()
                if claim["sessions"]:
                    stolen.append(claim["sessions"][0]["session_id"])
                    http.post(f"/rl/claims/{claim['claim_id']}/release")
                time.sleep(0.05)

    process = start_trainer(
        server, out, "batch_size=8", "max_steps=3", "max_staleness=2", f"claim_lease_s={LEASE}",
        "checkpoint_every=3", "algorithm.ppo_minibatches=8",
    )  # fmt: skip
    # the rival starts once the trainer has claimed its first batch
    deadline = time.monotonic() + 300
    while not (out / "claims.jsonl").exists() or not (out / "claims.jsonl").read_text():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    thread = threading.Thread(target=rival, daemon=True)
    thread.start()
    try:
        log = finish(process)  # a lost claim would stop it with ClaimLost
    finally:
        stop.set()
        thread.join(30)
    steps = metrics(out)
    assert len(steps) == 3
    trained = [s for step in steps for s in step["session_ids"]]
    assert len(trained) == len(set(trained)) == 24
    assert set(trained) == set(sessions)
    assert all(server.get(s)["status"] == "consumed" for s in sessions)
    assert "could not renew" not in log
    # the first claim was held, unconfirmed, from its claim to the checkpoint after step 3: for
    # more than two leases, so without renewal the rival would have taken its sessions
    phases = ("claim", "train", "publish", "checkpoint")
    held = sum(s[f"{phase}_seconds"] for s in steps for phase in phases)
    assert held > 2 * LEASE


def test_another_run_s_checkpoint_is_refused_naming_both(server, tmp_path):
    out = tmp_path / "train"
    [server.episode(reward=float(i % 2)) for i in range(2)]
    finish(start_trainer(server, out, "batch_size=2", "max_steps=1"))
    first = server.run["id"]
    other = server.http.post("/rl/runs", json={"name": "other"}).json()["id"]
    process = start_trainer(server, out, "batch_size=2", "max_steps=1", f"run_id={other}")
    assert process.wait(120) == 1
    log = process.log_path.read_text()
    assert f"holds checkpoints of run {first}" in log and f"trains run {other}" in log
    assert "worker(s) ready" not in log  # refused before anything started
