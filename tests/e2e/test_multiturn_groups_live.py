"""Multi-turn agents in GRPO groups through `proxrl serve` + `proxrl train`: how much of what
they sampled trains (issue 24).

Six agent threads drive the example tool agent (`examples/agents/tool_agent.py`, its
``run_episode`` one reply at a time) against a real proxy on the tiny model: sessions of 1-6
turns with pauses of up to 1.5 s between turns, four consecutive sessions of an agent one GRPO
group (same task_id and group_id). The run's bound is set first (batch_size 8, max_staleness 1,
group_size 4: 16 places), so that admission binds from the first session and the sessions the
trainer meets span versions, as on a run a trainer already serves; the agents start 10 s before
`proxrl train batch_size=8 max_staleness=1 algorithm.group_size=4 max_steps=8` and stop when it
finishes. (Started before any bound, as a new user's agents are, the agents' 90-odd sessions all
trained too, from version 0, when measured once at commit 12af7e0: the audit's 75 % dropped
became 0 % on that shape; this test covers the harder one.)

The trained share is counted from the outside: the sampled tokens are the loss tokens of the
rows of every session the trainer claimed (GET /rl/sessions/{id}), the trained ones the sum of
``trained_tokens`` over the steps of ``metrics.jsonl``. The trainer's and the server's own
figures (``sampled_tokens``, ``trained_share``, the run's ``training``) are reported, and held
to the same numbers, where they exist. The random tiny model almost never calls the tool, so a
reply without a call is followed by a user message asking for the calculator: every session
gets the number of turns it drew.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from client_sdk import Client, RateLimitError
from tests.support import ProxyProcess, example_agent_module
from tests.trainer_runs import Server, finish, metrics, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

tool_agent = example_agent_module("tool_agent")

AGENTS = 6
GROUP_SIZE = 4
MAX_TURNS = 6
MAX_PAUSE_S = 1.5
MAX_TOKENS = 24  # per reply: six turns stay far inside the tiny model's 2048-token context
HEAD_START_S = 10
GROUPS_PER_AGENT = 20  # a bound only: the trainer finishes long before an agent gets there
AGENT_DEADLINE_S = 480
STEPS = 8
TRAINER = (
    "batch_size=8",
    "max_staleness=1",
    f"algorithm.group_size={GROUP_SIZE}",
    f"max_steps={STEPS}",
)
MIN_TRAINED_SHARE = 0.95
NEVER_DROPPED = ("stale", "no_trainable_tokens")  # what staleness control used to cost
MASK_CAUSES = ("stale", "off_temperature", "alternative")
NUDGE = {"role": "user", "content": "Check that with the calculator tool."}


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        yield Server(proxy)


class Agent(threading.Thread):
    """Groups of ``GROUP_SIZE`` multi-turn tool-agent sessions, one after another, until
    ``stop`` (or its bounds)."""

    def __init__(self, index: int, url: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"agent-{index}")
        self.index, self.url, self.stop = index, url, stop
        self.rng = random.Random(index)
        self.errors: list[str] = []
        self.sessions: list[str] = []

    def run(self) -> None:
        deadline = time.monotonic() + AGENT_DEADLINE_S
        with Client(self.url, ProxyProcess.ADMIN_KEY, timeout=120, max_retries=3) as client:
            for group in range(GROUPS_PER_AGENT):
                (question,) = tool_agent.make_questions(1, seed=100 * self.index + group)
                for _ in range(GROUP_SIZE):
                    if self.stop.is_set() or time.monotonic() > deadline:
                        return
                    try:
                        self.session(client, question, f"agent{self.index}-group{group}")
                    except Exception as exc:
                        if not self.stop.is_set():  # the server may go first at the end
                            self.errors.append(repr(exc))
                        return

    def session(self, client: Client, question, group_id: str) -> None:
        """One session of 1-6 turns, each reply one ``run_episode`` step, rewarded as the tool
        agent rewards: per turn by completion id, then the session."""
        while True:  # at the staleness bound the server answers 429 after its wait: ask again
            try:
                opened = client.session(task_id=question.task_id, group_id=group_id)
                break
            except RateLimitError:
                if self.stop.is_set():
                    return
        with opened as session, session.openai(max_retries=10) as model:
            self.sessions.append(session.id)
            conversation = tool_agent.initial_messages(question)
            turns: list = []
            for turn in range(self.rng.randint(1, MAX_TURNS)):
                if turn:
                    time.sleep(self.rng.uniform(0, MAX_PAUSE_S))
                step = tool_agent.run_episode(
                    model, "tiny", question, max_turns=1, max_tokens=MAX_TOKENS,
                    messages=conversation,
                )  # fmt: skip
                turns += step.turns
                if step.stopped == "refused":
                    break
                conversation = step.messages + ([NUDGE] if step.turns[-1].step.final else [])
            for i, turn in enumerate(turns):
                reward = tool_agent.shaped_reward(turn.step, results_read=i + 1 < len(turns))
                session.reward(reward, completion_id=turn.completion_id)
            last = turns[-1].step.assistant.get("content") if turns else None
            answer = tool_agent.final_answer(last)
            session.reward(1.0 if answer == question.answer else 0.0)


@dataclass(frozen=True)
class Figures:
    """What the trainer did with what the agents sampled, counted from the outside."""

    settled: int
    statuses: Counter
    drops: Counter  # reason code -> sessions
    turns: Counter  # turn count -> claimed sessions
    groups: Counter  # claimed sessions of a group -> groups
    sampled: int  # loss tokens in the rows of every claimed session
    trained: int  # trained_tokens over the steps
    masked: dict[str, int]  # by cause, over the steps
    staleness: list[int]  # trained tokens by versions behind: 0, 1, 2, ...

    @property
    def staleness_mean(self) -> float:
        return sum(k * n for k, n in enumerate(self.staleness)) / max(sum(self.staleness), 1)

    @property
    def staleness_max(self) -> int:
        return max((k for k, n in enumerate(self.staleness) if n), default=0)

    @property
    def share(self) -> float:
        return self.trained / max(self.sampled, 1)

    def line(self) -> str:
        return (
            f"{self.settled} sessions settled ({dict(self.statuses)}), dropped by reason "
            f"{dict(self.drops)}, turns {dict(sorted(self.turns.items()))}, group sizes "
            f"{dict(self.groups)}; trained "
            f"{self.trained} of {self.sampled} sampled tokens: trained share {self.share:.3f} "
            f"(masked {self.masked}); staleness mean {self.staleness_mean:.2f} max "
            f"{self.staleness_max} (trained tokens by versions behind: {self.staleness})"
        )


def figures(server: Server, steps: list[dict]) -> Figures:
    claimed = [s for step in steps for s in step["session_ids"]]
    details = [server.get(s) for s in claimed]
    histogram: Counter = Counter()
    for step in steps:
        histogram.update(dict(enumerate(step["staleness_histogram"])))
    return Figures(
        settled=len(claimed),
        statuses=Counter(d["status"] for d in details),
        drops=Counter(d["drop_reason"].split(":", 1)[0] for d in details if d["drop_reason"]),
        turns=Counter(d["turn_count"] for d in details),
        groups=Counter(Counter(d["group_id"] for d in details).values()),
        sampled=sum(sum(row["loss_mask"]) for d in details for row in d["rows"]),
        trained=sum(step["trained_tokens"] for step in steps),
        masked=dict(sum((masked_tokens(step) for step in steps), Counter())),
        staleness=[histogram[k] for k in range(max(histogram, default=-1) + 1)],
    )


def masked_tokens(step: dict) -> Counter:
    """Loss tokens the step masked out, by cause (``masked_tokens`` where the trainer writes it,
    else its ``<cause>_tokens`` counts)."""
    if "masked_tokens" in step:
        return Counter(step["masked_tokens"])
    return Counter({cause: step.get(f"{cause}_tokens", 0) for cause in MASK_CAUSES})


def trainer_own_figures(server: Server, steps: list[dict]) -> dict:
    """The trainer's and the server's own accounting, where this version writes it."""
    own: dict = {}
    if all("sampled_tokens" in step for step in steps):
        own["sampled_tokens"] = sum(step["sampled_tokens"] for step in steps)
        own["trained_share"] = [round(step["trained_share"], 3) for step in steps]
    if all("dropped_tokens" in step for step in steps):
        own["dropped_tokens"] = sum(step["dropped_tokens"] for step in steps)
    training = server.http.get(f"/rl/runs/{server.run['id']}").json().get("training")
    if training is not None:
        own["training"] = training
    return own


def test_multi_turn_groups_train_what_they_sampled(server, tmp_path):
    server.configure(batch_size=8, max_staleness=1, group_size=GROUP_SIZE)
    stop = threading.Event()
    agents = [Agent(i, server.proxy.url, stop) for i in range(AGENTS)]
    started = time.monotonic()
    for agent in agents:
        agent.start()
    time.sleep(HEAD_START_S)
    try:
        finish(start_trainer(server, tmp_path / "train", *TRAINER), timeout=420)
    finally:
        stop.set()
        for agent in agents:
            agent.join(60)
    steps = metrics(tmp_path / "train")
    seen = figures(server, steps)
    own = trainer_own_figures(server, steps)
    report = (
        f"{AGENTS} multi-turn agents, groups of {GROUP_SIZE}, {len(steps)} steps in "
        f"{time.monotonic() - started:.0f} s: {seen.line()}; the trainer's own: {own}"
    )
    print(report)

    assert not [e for agent in agents for e in agent.errors], report
    assert [step["step"] for step in steps] == list(range(1, STEPS + 1)), report
    assert set(seen.groups) == {GROUP_SIZE}, report  # whole groups only
    assert sum(n for turns, n in seen.turns.items() if turns > 1) > seen.settled / 2, report
    assert not {code for code in seen.drops if code in NEVER_DROPPED}, report
    assert seen.share >= MIN_TRAINED_SHARE, report
    assert all(step["trained_tokens"] > 0 for step in steps), report
    assert own["sampled_tokens"] == seen.sampled, report
    assert own["training"]["total_trained_share"] >= MIN_TRAINED_SHARE, report
    assert own["training"]["warning"] is None, report
