"""A workload simulator for the staleness bound: how much of what agents sample gets trained.

A discrete-event model of one run (the server, its agents and one trainer) in simulated
seconds, no model and no HTTP. Agents want sessions without end; the run admits them by its
admission rule; each session runs its turns (generation, then a tool call) on the weights the
server serves at each token; a session becomes trainable when its last turn ends (its reward
comes at once); the trainer claims ``batch_size`` sessions in whole groups, judges each token's
staleness, drops what cannot train, steps for ``--step-s`` seconds and publishes the next version.

The decisions are the project's own, imported, never copied, so that they cannot drift:

- admission (policy ``places``): ``server.rl.admission.Held`` and ``admits`` with a real
  ``RunConfig`` (its ``admission_limit``, ``(eta + 1) * batch_size`` places), group keys by
  ``server.store.groups.key_of``; the trainer marks a step's claims trained after publishing;
- claims: ``server.store.groups.plan_claim`` (which whole groups a claim takes, which
  incomplete ones it drops, in what order, with the store's drop reasons);
- staleness and drops: ``trainer.rollouts.build_batch`` on rows shaped as the server sends them
  (``versions`` per token; it calls ``trainer.staleness.versions_behind``, restarts' republishes
  included), with a real ``AlgorithmConfig`` (``stale`` as the policy says);
- publish: a step publishes a version only when its batch has samples (``Trainer.publish``).

Modelled, because they are SQL or I/O rather than functions (each held to the real code by
``tests/unit/test_staleness_sim.py``, on random inputs):

- which sessions hold places, ``server/store/sessions.py`` ``held_places``: :func:`holds_place`,
  checked against the SQL on a real SQLite store;
- the admission count of the rule before issue 24 (:func:`areal_admits`): the run's
  sessions not ``dropped`` (consumed ones count; eval sessions are not simulated). Here:
  :func:`counts_toward_admission` (the server no longer has this count);
- the claim, ``server/store/claims.py`` ``claim`` (line 74): with one trainer every planned
  session is locked, so ``_whole_groups`` is one ``plan_claim``; no session lacks turns and no
  lease lapses, so ``_drop_without_turns`` and ``_return_lapsed`` do nothing. Here:
  :meth:`Run.claim_once`, checked against ``claims.claim`` on a real SQLite store;
- the trainer's loop, ``trainer/loop.py`` ``Trainer.claim`` / ``run`` / ``republish``: it claims
  ``batch_size - held`` every ``claim_wait_s`` until it holds a batch, tells the server its drops
  at once (``Trainer.drop``), publishes after ``--step-s``, confirms at checkpoints; a restart
  (``--restart-every``) loses the steps after the last checkpoint (their claims go back to the
  pool, their drops stay) and republishes the checkpoint's weights as a new version.

Not modelled: the engine's capacity (generation takes ``--gen-s`` per turn however many
sessions run: the admission bound, not the engine, limits concurrency, unless ``--max-open``),
admission's wait-then-429 (a waiting session is admitted the moment there is room, first come
first served), reward latency, idle and reward deadlines, and what the update learns.

The rules are an entry of ``POLICIES``: ``current`` the rules before issue 24 (their admission
rule is the one thing this bench defines itself, :func:`areal_admits`), ``places`` today's; a
new design is another entry, compared in the same run (``--policies current,other``). A run
whose trainer waits for a batch nothing can fill stops and is reported stalled. The tables
and the plot are ``bench/staleness_sim_report.py``'s.

    python bench/staleness_sim.py                       # the default grid, several minutes
    python bench/staleness_sim.py --groups 4 --etas 1 --seeds 1 --steps 60   # one small cell
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.staleness_sim_report import plot, report  # noqa: E402
from server.rl.admission import Held, admits  # noqa: E402
from server.rl.claims import group_rule  # noqa: E402
from server.store.groups import Candidate, GroupKey, key_of, plan_claim  # noqa: E402
from server.store.run_config import RunConfig  # noqa: E402
from server.store.sessions import (  # noqa: E402
    CLAIMED,
    CONSUMED,
    DROPPED,
    HOLDING,
    OPEN,
    TRAINABLE,
)
from trainer.advantages import RunningBaseline  # noqa: E402
from trainer.config import AlgorithmConfig  # noqa: E402
from trainer.rollouts import Batch, Rules, build_batch  # noqa: E402

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)  # simulated second 0, for the store's datetimes
RESULTS = ROOT / "bench" / "results"
TITLE = "Staleness simulator: what each admission, claim and staleness rule trains"


def counts_toward_admission(status: str) -> bool:
    """Does a (training) session of this status count toward :func:`areal_admits`? All but
    dropped ones (consumed ones count)."""
    return status != DROPPED


def areal_admits(admitted: int, config: RunConfig, policy_version: int) -> bool:
    """The admission rule before issue 24, kept so the comparison stays runnable: AReaL's
    ``admitted < (max_staleness + version + 1) * batch_size`` over the run's training sessions
    not dropped. The one rule this bench defines itself; the server now admits by places
    (``server.rl.admission``)."""
    if config.batch_size is None:
        return True
    return admitted < (config.max_staleness + policy_version + 1) * config.batch_size


def holds_place(status: str, trained_version: int | None) -> bool:
    """Does a (training) session hold an admission place? Mirrors
    ``server/store/sessions.py`` ``held_places``: a status in ``HOLDING``, no step trained it."""
    return status in HOLDING and trained_version is None


# --- the policy: one entry per design ------------------------------------------------------


def room_by_versions(run: Run, key: GroupKey | None) -> bool:
    return areal_admits(run.admitted, run.config, run.server_version)


def room_by_places(run: Run, key: GroupKey | None) -> bool:
    return admits(run.held_sessions(), key, run.config)


def admitted_untrained(run: Run) -> int:
    """Sessions the rule before issue 24 counted (not dropped) that no step trained."""
    return run.admitted - run.trained_sessions


def places_held(run: Run) -> int:
    return run.held_sessions().places(run.group_size)


@dataclass(frozen=True)
class Policy:
    """The rules one simulated run follows. ``room``: may one more session of a group key be
    admitted; ``plan``: what one claim takes and drops; ``judge``: the trainer's batch;
    ``stale``: the trainer's ``algorithm.stale``; ``backlog``: what admission holds against
    (eta + 1) * batch_size, which under a ``bounded`` policy it never exceeds (checked at every
    admission, restarts included: a breach stops the cell)."""

    room: Callable[[Run, GroupKey | None], bool]
    backlog: Callable[[Run], int]
    bounded: bool
    plan: Callable[..., Any]
    judge: Callable[..., Batch]
    stale: str = "mask"
    description: str = ""


POLICIES: dict[str, Policy] = {
    "current": Policy(
        room=room_by_versions,
        backlog=admitted_untrained,
        bounded=False,
        plan=plan_claim,
        judge=build_batch,
        stale="mask",
        description="before issue 24: AReaL's bound on sessions not dropped, whole oldest "
        "groups, stale tokens masked",
    ),
    "current-drop": Policy(
        room=room_by_versions,
        backlog=admitted_untrained,
        bounded=False,
        plan=plan_claim,
        judge=build_batch,
        stale="drop",
        description="before issue 24, with algorithm.stale=drop",
    ),
    "places": Policy(
        room=room_by_places,
        backlog=places_held,
        bounded=True,
        plan=plan_claim,
        judge=build_batch,
        stale="keep",
        description="issue 24: (eta + 1) * batch_size places held until a step trains a session, "
        "a group admitted as a unit, stale tokens kept",
    ),
}


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    turns_median: float = 5.0
    turns_sigma: float = 0.75  # lognormal, clipped to [turns_min, turns_max]
    turns_min: int = 1
    turns_max: int = 40
    gen_s: float = 3.0  # generation per turn: median seconds
    gen_sigma: float = 0.0  # 0: every turn takes gen_s
    tool_s: float = 2.0  # tool call after each turn but the last: median seconds
    tool_sigma: float = 1.0  # lognormal: a heavy tail (p99 about 20 s at 2 s median)
    tokens_per_s: float = 10.0  # sampled tokens per generated second (one stands for many)
    max_open: int | None = None  # sessions the agents run at once (None: as many as admitted)


@dataclass(frozen=True)
class Cell:
    policy: str = "current"
    group_size: int = 1
    eta: int = 1
    seed: int = 0
    batch_size: int = 16
    steps: int = 150
    step_s: float = 10.0  # one training step, claim aside
    claim_wait_s: float = 1.0  # the trainer's wait between claims (trainer/config.py)
    group_timeout_s: float | None = 600.0
    checkpoint_every: int = 10
    restart_every: int = 0  # a trainer crash after every N-th step (0: none)
    restart_s: float = 60.0  # a restart's downtime
    workload: Workload = field(default_factory=Workload)

    def __post_init__(self) -> None:
        if self.restart_every and self.restart_every <= self.checkpoint_every:
            raise ValueError(
                f"restart_every ({self.restart_every}) must exceed checkpoint_every "
                f"({self.checkpoint_every}): a crash before every checkpoint never gets on"
            )


@dataclass
class SimSession:
    sid: str
    task_id: str
    turns: list[tuple[float, float, int]]  # per turn: generation s, tool s after it, tokens
    reward: float
    status: str = OPEN
    versions: list[list[int]] = field(default_factory=list)  # per generated turn, per token
    trainable_at: float = 0.0
    candidate: Candidate | None = None
    trained_version: int | None = None  # of the first step that trained it (its place freed)
    claimable_at: float | None = None  # when its group was first claimable: whole, or timed out
    created_at: float = 0.0  # when it was admitted

    @property
    def tokens(self) -> int:
        return sum(len(v) for v in self.versions)


def draw_session(rng: random.Random, n: int, cell: Cell) -> SimSession:
    w = cell.workload
    count = round(rng.lognormvariate(math.log(w.turns_median), w.turns_sigma))
    turns = []
    for _ in range(min(max(count, w.turns_min), w.turns_max)):
        gen = w.gen_s * (rng.lognormvariate(0, w.gen_sigma) if w.gen_sigma else 1.0)
        tool = w.tool_s * rng.lognormvariate(0, w.tool_sigma) if w.tool_sigma else w.tool_s
        turns.append((gen, tool, max(1, round(gen * w.tokens_per_s))))
    return SimSession(f"s{n:06d}", task_of(n, cell), turns, float(rng.random() < 0.5))


def task_of(n: int, cell: Cell) -> str:
    """The n-th session's task: a group's sessions are asked one after another."""
    return f"task-{n // cell.group_size}"


# --- the run --------------------------------------------------------------------------------


@dataclass
class Judged:
    """One session's fate as the trainer last settled it."""

    sampled: int
    trained: int
    masked: int
    dropped_reason: str | None
    turns: int
    queue_lag: int | None = None  # trained: versions from its group claimable to its step


@dataclass
class Result:
    cell: Cell
    judged: dict[str, Judged]
    staleness: Counter[int]  # updates behind -> trained tokens
    backlog: list[tuple[float, int, int]]  # (time, step, the policy's backlog) per step
    backlog_peak: int  # the largest backlog any admission left
    sessions: int  # created
    sim_s: float  # simulated seconds to the last step
    steps_run: int  # steps trained, lost ones included
    stalled_at: tuple[float, int] | None  # (time, step) the run could not go on, if it stalled
    events: list[float] = field(default_factory=list)  # event times, in processing order

    def totals(self) -> dict[str, Any]:
        j = list(self.judged.values())
        sampled = sum(x.sampled for x in j)
        trained = sum(x.trained for x in j)
        masked = sum(x.masked for x in j)
        dropped = [x for x in j if x.dropped_reason is not None]
        kept = [x for x in j if x.dropped_reason is None]
        stale = sorted(self.staleness.elements())
        reasons = Counter(x.dropped_reason.split(":")[0] for x in dropped)  # type: ignore[union-attr]
        lags = sorted(x.queue_lag for x in kept if x.queue_lag is not None)
        return {
            "sampled": sampled,
            "trained": trained,
            "masked": masked,
            "dropped_tokens": sum(x.sampled for x in dropped),
            "trained_share": trained / sampled if sampled else 0.0,
            "sessions_judged": len(j),
            "sessions_dropped": len(dropped),
            "dropped_share": len(dropped) / len(j) if j else 0.0,
            "drop_reasons": dict(reasons),
            "staleness_mean": statistics.fmean(stale) if stale else 0.0,
            "staleness_p99": stale[min(len(stale) - 1, int(0.99 * len(stale)))] if stale else 0,
            "staleness_max": stale[-1] if stale else 0,
            "queue_lag_mean": statistics.fmean(lags) if lags else 0.0,
            "queue_lag_p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0,
            "queue_lag_max": lags[-1] if lags else 0,
            "lag_over_eta_share": sum(lag > self.cell.eta for lag in lags) / len(lags)
            if lags
            else 0.0,
            "turns_kept": statistics.fmean(x.turns for x in kept) if kept else 0.0,
            "turns_sampled": statistics.fmean(x.turns for x in j) if j else 0.0,
            "backlog_end": self.backlog[-1][2] if self.backlog else 0,
            "backlog_max": max([self.backlog_peak, *(b for _, _, b in self.backlog)]),
            "bound": (self.cell.eta + 1) * self.cell.batch_size,
            "trained_tokens_per_s": trained / self.sim_s if self.sim_s else 0.0,
            "sampled_tokens_per_s": sampled / self.sim_s if self.sim_s else 0.0,
            "sim_minutes": self.sim_s / 60,
            "stalled": int(self.stalled_at is not None),
            "steps": self.stalled_at[1] if self.stalled_at else self.cell.steps,
        }


class Run:
    """One cell: the server's books, the agents and one trainer, driven by an event queue."""

    def __init__(self, cell: Cell, keep_events: bool = False) -> None:
        self.cell = cell
        self.policy = POLICIES[cell.policy]
        self.rng = random.Random(cell.seed)
        self.config = RunConfig(
            batch_size=cell.batch_size,
            max_staleness=cell.eta,
            group_size=cell.group_size,
            group_timeout_s=cell.group_timeout_s,
        )
        self.rule = group_rule(self.config, None)  # as POST /rl/claims builds it
        self.group_size = cell.group_size
        algorithm = AlgorithmConfig(stale=self.policy.stale)  # type: ignore[arg-type]
        self.algorithm = dataclasses.replace(
            algorithm, temperature=1.0, off_temperature="mask", group_size=cell.group_size
        )
        self.baseline = RunningBaseline(self.algorithm.baseline_momentum)
        self.queue: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.sessions: dict[str, SimSession] = {}
        self.trainable: dict[str, SimSession] = {}  # in the order they became trainable
        self.admitted = 0  # counts_toward_admission, kept as statuses change
        # task id -> the sessions of it that hold places, each with when it was created
        self.holding: dict[str, dict[str, float]] = {}
        self.backlog_peak = 0
        self.open = 0
        self.server_version = 0
        self.published: list[tuple[float, int]] = [(0.0, 0)]  # (time, version) served from
        self.published_at: list[float] = [0.0]  # their times, for bisect
        # the trainer's books (trainer/loop.py)
        self.version = 0
        self.step = 0
        self.steps_run = 0
        self.republished: list[tuple[int, int]] = []
        self.checkpoint: tuple[int, int] = (0, 0)  # (step, version) of the last checkpoint
        self.pending: list[list[str]] = []  # claims trained since it, not yet confirmed
        self.held: list[str] = []  # the step being claimed
        # (time, step) when the trainer waited for a batch that nothing could fill: no session
        # open, none trainable, and admission refused the next (Trainer.claim waits forever)
        self.stalled_at: tuple[float, int] | None = None
        self.trained_sessions = 0
        self.judged: dict[str, Judged] = {}
        self.pending_judged: dict[str, Judged] = {}
        self.staleness: Counter[int] = Counter()
        self.pending_staleness: Counter[int] = Counter()
        self.backlog: list[tuple[float, int, int]] = []
        self.events: list[float] | None = [] if keep_events else None

    # --- the event queue

    def at(self, t: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, kind, payload))

    def run(self) -> Result:
        self.admit()
        self.at(0.0, "claim")
        while self.queue and self.step < self.cell.steps:
            self.now, _, kind, payload = heapq.heappop(self.queue)
            if self.events is not None:
                self.events.append(self.now)
            getattr(self, "on_" + kind)(payload)
        self.confirm()  # the trainer's last checkpoint covers what is pending
        return Result(
            self.cell,
            self.judged,
            self.staleness,
            self.backlog,
            self.backlog_peak,
            len(self.sessions),
            self.now,
            self.steps_run,
            self.stalled_at,
            self.events or [],
        )

    # --- the server: admission, sessions, claims

    def set_status(
        self, session: SimSession, status: str, trained_version: int | None = None
    ) -> None:
        """A session's new status (and the version of the step that first trained it): the
        admission books follow."""
        self.admitted += counts_toward_admission(status) - counts_toward_admission(session.status)
        held = holds_place(session.status, session.trained_version)
        if session.trained_version is None:
            session.trained_version = trained_version
        session.status = status
        holds = holds_place(status, session.trained_version)
        if held and not holds:  # (a test may set sessions up without admitting them)
            members = self.holding.get(session.task_id, {})
            members.pop(session.sid, None)
            if not members:
                self.holding.pop(session.task_id, None)
        elif holds and not held:
            self.holding.setdefault(session.task_id, {})[session.sid] = session.created_at

    def held_sessions(self) -> Held:
        """The run's sessions that hold places, as ``server.store.sessions.held_places`` gives
        them: (group_id, task_id, sessions, the newest one's created_at) rows; the sim's
        sessions carry no group_id, their task id is their group key under a group_size above
        1."""
        rows = (
            (None, task, len(members), EPOCH + timedelta(seconds=max(members.values())))
            for task, members in self.holding.items()
        )
        now = EPOCH + timedelta(seconds=self.now)
        return Held.of(rows, self.group_size, now, self.config.group_timeout_s)

    def admit(self) -> None:
        """Admit waiting sessions while the rule has room (the agents always want more): the
        next session is of a group by its task id, so under places a group's first member takes
        its places and the rest come in at once, as the server admits them."""
        cap = self.cell.workload.max_open
        while cap is None or self.open < cap:
            task = task_of(len(self.sessions), self.cell)
            if not self.policy.room(self, key_of(None, task, by_task=self.group_size > 1)):
                break
            session = draw_session(self.rng, len(self.sessions), self.cell)
            self.sessions[session.sid] = session
            self.admitted += counts_toward_admission(session.status)
            session.created_at = self.now
            self.holding.setdefault(session.task_id, {})[session.sid] = self.now  # open: held
            self.open += 1
            self.at(self.now + session.turns[0][0], "turn_end", (session, 0, self.now))
            self.check_bound()

    def check_bound(self) -> None:
        """Under a bounded policy, admission never holds more than (eta + 1) * batch_size."""
        backlog = self.policy.backlog(self)
        self.backlog_peak = max(self.backlog_peak, backlog)
        limit = self.config.admission_limit()
        if self.policy.bounded and limit is not None and backlog > limit:
            raise AssertionError(
                f"{self.cell}: {backlog} places held at {self.now:.1f} s, above the "
                f"(eta + 1) * batch_size = {limit} the admission rule keeps"
            )

    def version_at(self, t: float) -> int:
        """The version the engines served at time ``t`` (the last one published by then)."""
        return self.published[bisect.bisect_right(self.published_at, t) - 1][1]

    def on_turn_end(self, payload: tuple[SimSession, int, float]) -> None:
        session, i, started = payload
        gen, tool, tokens = session.turns[i]
        session.versions.append(
            [self.version_at(started + gen * (k + 1) / tokens) for k in range(tokens)]
        )
        if i + 1 < len(session.turns):
            start = self.now + tool
            self.at(start + session.turns[i + 1][0], "turn_end", (session, i + 1, start))
            return
        self.open -= 1
        session.trainable_at = self.now
        session.candidate = Candidate(
            session.sid, None, session.task_id, EPOCH + timedelta(seconds=self.now)
        )
        self.set_status(session, TRAINABLE)
        self.trainable[session.sid] = session
        self.admit()

    def drop(self, sid: str) -> None:
        session = self.sessions[sid]
        self.set_status(session, DROPPED)
        self.trainable.pop(sid, None)

    def claim_once(self, max_sessions: int) -> list[str]:
        """One ``POST /rl/claims`` by the only trainer: server/store/claims.py ``claim``."""
        candidates = [s.candidate for s in self.trainable.values()]
        now = EPOCH + timedelta(seconds=self.now)
        plan = self.policy.plan(candidates, self.rule, max_sessions, now)
        for group, reason in plan.drop:
            for sid in group.session_ids:
                self.drop(sid)
                self.settle(sid, reason)
        for group in plan.claim:
            self.note_claimable(group)
        chosen = [sid for group in plan.claim for sid in group.session_ids]
        for sid in chosen:
            self.set_status(self.sessions[sid], CLAIMED)
            del self.trainable[sid]
        return chosen

    def note_claimable(self, group: Any) -> None:
        """When a claimed group first became claimable: when it was whole (its newest member
        trainable), else when its oldest member's group_timeout_s ran out."""
        whole = len(group.members) >= self.rule.size
        at = group.newest if whole else group.oldest + timedelta(seconds=self.rule.timeout_s or 0)
        for sid in group.session_ids:
            session = self.sessions[sid]
            if session.claimable_at is None:  # a restart's release does not reset it
                session.claimable_at = (at - EPOCH).total_seconds()

    # --- the trainer

    def on_claim(self, _: Any) -> None:
        """``Trainer.claim``: claim until a batch is held, waiting claim_wait_s between tries."""
        self.held += self.claim_once(self.cell.batch_size - len(self.held))
        self.admit()  # dropped groups left the count
        if len(self.held) < self.cell.batch_size:
            if not self.open and not self.trainable:  # admit() found no room either
                self.stalled_at = (self.now, self.step)  # nothing can ever fill the batch
                return
            self.at(self.now + self.cell.claim_wait_s, "claim")
            return
        claimed, self.held = self.held, []
        self.train(claimed)

    def rows(self, session: SimSession) -> dict[str, Any]:
        """The session as the server sends it: one row (every turn continues the last), one
        prompt token before each turn's sampled tokens."""
        input_ids: list[int] = []
        loss_mask: list[int] = []
        versions: list[int] = []
        turns = []
        for i, sampled in enumerate(session.versions):
            input_ids.append(0)
            loss_mask.append(0)
            versions.append(-1)
            start = len(input_ids)
            input_ids += [1] * len(sampled)
            loss_mask += [1] * len(sampled)
            versions += sampled
            turns.append(
                {"start": start, "end": len(input_ids), "turn_index": i, "temperature": 1.0}
            )
        row = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "logprobs": [0.0] * len(input_ids),
            "versions": versions,
            "turns": turns,
        }
        return {
            "session_id": session.sid,
            "task_id": session.task_id,
            "group_id": None,
            "reward": session.reward,
            "rows": [row],
        }

    def train(self, claimed: list[str]) -> None:
        rules = Rules(
            algorithm=self.algorithm,
            policy_version=self.version,
            max_staleness=self.cell.eta,
            republished=list(self.republished),
        )
        batch = self.policy.judge(
            [self.rows(self.sessions[sid]) for sid in claimed], rules, self.baseline
        )
        for sid in batch.dropped:  # Trainer.drop: told to the server at once
            self.drop(sid)
        trained = Counter(s.session_id for s in batch.samples for _ in range(s.loss_tokens))
        for sid in claimed:
            session = self.sessions[sid]
            reason = batch.dropped.get(sid)
            served = self.version_at(session.claimable_at or 0.0)
            self.pending_judged[sid] = Judged(
                sampled=session.tokens,
                trained=0 if reason else trained[sid],
                masked=0 if reason else session.tokens - trained[sid],
                dropped_reason=reason,
                turns=len(session.turns),
                queue_lag=None if reason else self.version - served,
            )
        self.pending_staleness.update(batch.staleness)
        self.pending.append(claimed)  # settled by the next checkpoint, trained or not
        self.admit()
        if not batch.samples:  # Trainer.run: not a step (no update, no version); claim again
            self.at(self.now, "claim")
            return
        self.at(self.now + self.cell.step_s, "step_end", claimed)

    def publish(self, version: int) -> None:
        self.server_version = version
        self.published.append((self.now, version))
        self.published_at.append(self.now)

    def on_step_end(self, claimed: list[str]) -> None:
        """``Trainer.run`` after the update: publish, mark the step's claims trained (POST
        /rl/claims/{id}/trained: a session keeps the version of the first step that trained
        it, which frees its place), then maybe crash, else checkpoint when due and claim."""
        self.version += 1
        self.publish(self.version)
        self.step += 1
        self.steps_run += 1
        for sid in claimed:
            session = self.sessions[sid]
            if session.status == CLAIMED:
                self.trained_sessions += 1
                self.set_status(session, CLAIMED, trained_version=self.version)
        self.admit()
        self.record()
        crash = self.cell.restart_every and self.steps_run % self.cell.restart_every == 0
        if crash and self.step < self.cell.steps:
            self.at(self.now + self.cell.restart_s, "restart")
            return
        if self.step % self.cell.checkpoint_every == 0:
            self.confirm()
        self.at(self.now, "claim")

    def record(self) -> None:
        """The policy's backlog after a step (or a restart)."""
        self.backlog.append((self.now, self.step, self.policy.backlog(self)))

    def confirm(self) -> None:
        """A checkpoint: what it covers is settled (consumed, or dropped with its reason)."""
        for claimed in self.pending:
            for sid in claimed:
                if self.sessions[sid].status == CLAIMED:
                    self.set_status(self.sessions[sid], CONSUMED)
        self.judged.update(self.pending_judged)
        self.staleness.update(self.pending_staleness)
        self.pending, self.pending_judged, self.pending_staleness = [], {}, Counter()
        self.checkpoint = (self.step, self.version)

    def settle(self, sid: str, reason: str) -> None:
        """A session the claim dropped (an incomplete group): judged without training."""
        session = self.sessions[sid]
        self.judged[sid] = Judged(session.tokens, 0, 0, reason, len(session.turns))

    def on_restart(self, _: Any) -> None:
        """A crash: the steps since the checkpoint are lost, their claims released (drops
        stay), and the checkpoint's weights republished as a new version
        (``Trainer.start``/``republish``). A released session keeps its trained mark, so it
        takes no place again (the server's rule)."""
        for claimed in self.pending:
            for sid in claimed:
                session = self.sessions[sid]
                if session.status == CLAIMED:
                    self.set_status(session, TRAINABLE)
                    self.trainable[sid] = session
                    self.trained_sessions -= session.trained_version is not None
        self.trainable = dict(sorted(self.trainable.items(), key=lambda kv: kv[1].trainable_at))
        self.judged.update(  # its drops were told to the server: they stay dropped
            {sid: j for sid, j in self.pending_judged.items() if j.dropped_reason is not None}
        )
        self.pending, self.pending_judged, self.pending_staleness = [], {}, Counter()
        self.step, restored = self.checkpoint
        self.version = max(self.server_version, restored) + 1
        self.republished.append((restored, self.version))
        self.publish(self.version)
        self.admit()
        self.record()
        self.at(self.now, "claim")


def simulate(cell: Cell, keep_events: bool = False) -> Result:
    return Run(cell, keep_events).run()


# --- the grid ------------------------------------------------------------------------------


def cells_of(args: argparse.Namespace) -> list[Cell]:
    workload = Workload(
        turns_median=args.turns_median,
        turns_sigma=args.turns_sigma,
        turns_max=args.turns_max,
        gen_s=args.gen_s,
        gen_sigma=args.gen_sigma,
        tool_s=args.tool_s,
        tool_sigma=args.tool_sigma,
        tokens_per_s=args.tokens_per_s,
        max_open=args.max_open,
    )
    return [
        Cell(
            policy=policy,
            group_size=group,
            eta=eta,
            seed=seed,
            batch_size=args.batch_size,
            steps=args.steps,
            step_s=args.step_s,
            group_timeout_s=args.group_timeout_s,
            checkpoint_every=args.checkpoint_every,
            restart_every=args.restart_every,
            workload=workload,
        )
        for policy in args.policies
        for group in args.groups
        for eta in args.etas
        for seed in range(args.seeds)
    ]


def run_grid(cells: list[Cell], out: Any = None) -> dict[tuple[str, int, int], list[Result]]:
    grid: dict[tuple[str, int, int], list[Result]] = {}
    out = out or sys.stdout
    started = time.monotonic()
    for i, cell in enumerate(cells, 1):
        result = simulate(cell)
        grid.setdefault((cell.policy, cell.group_size, cell.eta), []).append(result)
        t = result.totals()
        elapsed = time.monotonic() - started
        eta_s = elapsed / i * (len(cells) - i)
        print(
            f"[{i}/{len(cells)}] {cell.policy} group {cell.group_size} η {cell.eta} "
            f"seed {cell.seed}: trained {100 * t['trained_share']:.0f}%, dropped "
            f"{100 * t['dropped_share']:.0f}%, backlog {t['backlog_end']} "
            f"({i / elapsed:.2f} cells/s, ETA {eta_s:.0f}s)",
            file=out,
            flush=True,
        )
    return grid


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=["current", "places"],
        help=f"comma-separated entries of POLICIES: {', '.join(POLICIES)} (the first is the "
        "before of the before/after table)",
    )
    p.add_argument("--groups", type=ints, default=[1, 4, 8], help="group sizes")
    p.add_argument("--etas", type=ints, default=[0, 1, 2, 4, 8, 16], help="max staleness values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-s", type=float, default=10.0, help="seconds per training step")
    p.add_argument("--turns-median", type=float, default=5.0)
    p.add_argument("--turns-sigma", type=float, default=0.75)
    p.add_argument("--turns-max", type=int, default=40)
    p.add_argument("--gen-s", type=float, default=3.0, help="generation seconds per turn")
    p.add_argument("--gen-sigma", type=float, default=0.0)
    p.add_argument("--tool-s", type=float, default=2.0, help="median tool-call seconds")
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--tokens-per-s", type=float, default=10.0)
    p.add_argument("--max-open", type=int, default=None, help="agents' concurrency cap")
    p.add_argument("--group-timeout-s", type=float, default=600.0)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--restart-every", type=int, default=0, help="a trainer crash every N steps")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument(
        "--append",
        metavar="TITLE",
        help="append the tables under this heading to the results' staleness-sim.md (a second "
        "workload beside the grid's) and leave the plot as it is",
    )
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    try:  # Cell's own check, before the grid starts
        Cell(restart_every=args.restart_every, checkpoint_every=args.checkpoint_every)
    except ValueError as error:
        p.error(str(error))
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown:
        p.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    for group in args.groups:
        if args.batch_size % group:
            p.error(f"--batch-size {args.batch_size} must be a multiple of group size {group}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    grid = run_grid(cells_of(args))
    descriptions = {name: policy.description for name, policy in POLICIES.items()}
    title = f"## {args.append}" if args.append else f"# {TITLE}"
    text = report(grid, args, cells_of(args)[0].workload, descriptions, title)
    print(text)
    print(f"{len(grid)} cells x {args.seeds} seeds in {time.monotonic() - started:.0f}s")
    if args.no_write:
        return 0
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / "staleness-sim.md"
    if args.append:
        with path.open("a") as out:
            out.write("\n" + text.replace("\n## ", "\n### "))
        print(f"appended to {path}")
        return 0
    path.write_text(text)
    plot(grid, args, args.results_dir / "staleness-sim.png")
    print(f"wrote {path} and staleness-sim.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
