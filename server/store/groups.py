"""GRPO groups of a run's trainable sessions: which ones a claim takes, which it drops, in what
order.

A session's group key is its group_id, else (with group_size > 1) its task_id (a group_id and a
task_id spelled the same are different keys), else none: a session without a key is a group of
one that nothing can join. With group_size > 1 a group is claimable when it has group_size
trainable sessions, or when its oldest trainable session has waited group_timeout_s (an
incomplete group); a keyless session is claimable at once. Incomplete groups and keyless
sessions are then trained as they are or dropped, as the run's on_incomplete_group says.
Without a group size (or with 1) every group is claimable at once, a group_id's all its
trainable sessions together, and a task_id makes no group: an online task's sessions would
otherwise all come in one claim, however many piled up. Claimable groups are taken oldest first
(by their newest session), never split, up to max_sessions (the first one whole even if it is
larger).

Pure: this module knows nothing about SQL, claims or leases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from server.store import drop_reasons

GroupKey = tuple[Literal["group", "task"], str]


@dataclass(frozen=True)
class Candidate:
    """A trainable session, as much of it as grouping needs."""

    session_id: str
    group_id: str | None
    task_id: str | None
    trainable_at: datetime


@dataclass(frozen=True)
class GroupRule:
    size: int  # 1: no group size (group_id groups are still kept whole)
    timeout_s: float | None = None  # None: wait for the whole group
    on_incomplete: Literal["train", "drop"] = "train"

    @property
    def by_task(self) -> bool:
        """Do sessions with only a task_id form groups too? Only under a group size > 1."""
        return self.size > 1


@dataclass(frozen=True)
class Group:
    key: GroupKey | None
    members: tuple[Candidate, ...]

    @property
    def oldest(self) -> datetime:
        return min(member.trainable_at for member in self.members)

    @property
    def newest(self) -> datetime:
        return max(member.trainable_at for member in self.members)

    @property
    def session_ids(self) -> list[str]:
        return [member.session_id for member in self.members]


@dataclass
class Plan:
    claim: list[Group] = field(default_factory=list)
    drop: list[tuple[Group, str]] = field(default_factory=list)  # each with its reason


def key_of(group_id: str | None, task_id: str | None, by_task: bool) -> GroupKey | None:
    """A session's group key: its group_id, else (``by_task``) its task_id, else none."""
    if group_id is not None:
        return ("group", group_id)
    if by_task and task_id is not None:
        return ("task", task_id)
    return None


def group_key(candidate: Candidate, by_task: bool) -> GroupKey | None:
    return key_of(candidate.group_id, candidate.task_id, by_task)


def form_groups(candidates: list[Candidate], by_task: bool) -> list[Group]:
    """Sessions with the same key form one group; each keyless session is a group of its own."""
    keyed: dict[GroupKey, list[Candidate]] = {}
    alone: list[Group] = []
    for candidate in candidates:
        key = group_key(candidate, by_task)
        if key is None:
            alone.append(Group(None, (candidate,)))
        else:
            keyed.setdefault(key, []).append(candidate)
    return [Group(key, tuple(members)) for key, members in keyed.items()] + alone


def resolution(group: Group, rule: GroupRule, now: datetime) -> str | None:
    """ "claim", "drop" or None (the group still waits for members)."""
    if len(group.members) >= rule.size:
        return "claim"
    if group.key is not None and (
        rule.timeout_s is None or now - group.oldest < timedelta(seconds=rule.timeout_s)
    ):
        return None
    return "claim" if rule.on_incomplete == "train" else "drop"


def drop_reason(group: Group, rule: GroupRule, now: datetime) -> str:
    if group.key is None:
        return drop_reasons.no_group(rule.size)
    kind, name = group.key
    waited = (now - group.oldest).total_seconds()
    return drop_reasons.incomplete_group(
        f"{kind} {name!r}", len(group.members), rule.size, waited, rule.timeout_s or 0.0
    )


def plan_claim(
    candidates: list[Candidate],
    rule: GroupRule,
    max_sessions: int,
    now: datetime,
    already: int = 0,
) -> Plan:
    """Which groups of ``candidates`` one claim takes, and which it drops (with reasons).
    ``already``: sessions the claim holds before these (the first group goes whole, even
    beyond ``max_sessions``, only when it holds none)."""
    plan = Plan()
    ready = []
    for group in form_groups(candidates, rule.by_task):
        decided = resolution(group, rule, now)
        if decided == "drop":
            plan.drop.append((group, drop_reason(group, rule, now)))
        elif decided == "claim":
            ready.append(group)
    ready.sort(key=lambda group: (group.newest, min(group.session_ids)))
    total = already
    for group in ready:
        if total > 0 and total + len(group.members) > max_sessions:
            break
        plan.claim.append(group)
        total += len(group.members)
    return plan
