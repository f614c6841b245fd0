"""Admission: how far generation may run ahead of training (the staleness bound).

A run with a ``batch_size`` B and ``max_staleness`` eta holds at most (eta + 1) * B *places*.
A training session holds a place from its admission until a training step first trains it
(the trainer marks its claim trained when the step's version is published) or it is dropped;
nothing else frees one, and nothing but an admission takes one. So the invariant

    places held <= max((eta + 1) * B, group_size)

holds, for a fixed config, whatever drops, trainer restarts, republishes, lapsed leases and
claim orders happen (the second term only where a group is larger than the limit, which a
trainer's config never allows: its batch_size is a multiple of group_size; a run holding no
place admits such a group whole rather than never). It counts sessions, not versions, so a
restart that rolls steps back, or a republish that adds a version, changes nothing (AReaL's
``(eta + version + 1) * B`` counted sessions against versions, and every drop or republish
moved the limit for good).

A GRPO group is admitted as a unit: under a ``group_size`` G > 1, sessions that share a group
key (``server.store.groups.key_of``) hold max(G, members) places while they gather, so the first
member of a group takes G places and the next G - 1 come in at once, never refused half way; a
session without a key holds one. A group gathers until its newest session is
``group_timeout_s`` old (a claim resolves a group as it is once its oldest trainable session has
waited that long); from then on it holds one place per member, so places held for members that
never came cannot block a run. Its newest, not its oldest: a member that leaves can only make
the group older, so no place is taken but by an admission; a session that joins a group that
stopped gathering starts it gathering again, and pays for that at its admission.

When the places run out a caller waits (up to the run's ``admission_wait_s``) for the trainer
to free some, then gets a 429 with Retry-After. Runs without a ``batch_size`` admit everything.
Evaluation and production sessions are never trained: they hold no place and never wait
(``server.rl.sessions``, which also makes each check-and-create one transaction under the run's
row lock, so server processes sharing a store admit one at a time).

Why this bounds staleness: claims take the oldest trainable groups first, and every session
ahead of a group that has just become whole holds a place, so it is trained within eta + 1
steps: at most eta versions after the version served when it became whole. What a long session
adds on top (the versions published while it ran) is its own length, which no admission rule
can remove; the trainer keeps those tokens and the decoupled objective's behaviour weight
corrects them (docs/architecture/staleness.md).

Pure but for ``Admission``'s wait; the counts come from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from server.errors import StalenessBound
from server.store.groups import GroupKey, key_of
from server.store.run_config import RunConfig

RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Held:
    """A run's sessions that hold places: how many per group key, which of those groups still
    gather (their places held for the members to come), and how many sessions have no key."""

    groups: dict[GroupKey, int] = field(default_factory=dict)
    gathering: frozenset[GroupKey] = frozenset()
    keyless: int = 0

    @classmethod
    def of(
        cls,
        rows: Iterable[tuple[str | None, str | None, int, datetime]],
        group_size: int,
        now: datetime,
        timeout_s: float | None,
    ) -> Held:
        """From (group_id, task_id, sessions, the newest one's created_at) rows of held
        sessions. A group gathers until its newest session is ``timeout_s`` old (the run's
        group_timeout_s; None: for ever)."""
        groups: dict[GroupKey, int] = {}
        gathering: set[GroupKey] = set()
        keyless = 0
        for group_id, task_id, count, newest in rows:
            key = key_of(group_id, task_id, by_task=group_size > 1)
            if key is None:
                keyless += count
                continue
            groups[key] = groups.get(key, 0) + count
            if timeout_s is None or now - newest < timedelta(seconds=timeout_s):
                gathering.add(key)
        return cls(groups, frozenset(gathering), keyless)

    def _places_of(self, key: GroupKey, members: int, size: int) -> int:
        """A gathering group holds max(size, members) places; one past group_timeout_s (which
        resolves it as it is) one per member: places held for members that never came would
        otherwise block the run."""
        return max(size, members) if key in self.gathering else members

    def places(self, group_size: int) -> int:
        """Places held: a gathering group max(group_size, its members), any other session one."""
        size = max(group_size, 1)
        return self.keyless + sum(
            self._places_of(key, members, size) for key, members in self.groups.items()
        )

    def cost(self, key: GroupKey | None, group_size: int) -> int:
        """Places one more session of ``key`` takes: none when it joins a gathering group short
        of group_size (its place is held already), group_size when it starts a group, and when
        it joins a group that stopped gathering, what starting it gathering again adds."""
        if key is None or group_size <= 1:
            return 1
        members = self.groups.get(key, 0)
        before = self._places_of(key, members, group_size) if members else 0
        return max(group_size, members + 1) - before  # the newcomer: gathering again


def admits(held: Held, key: GroupKey | None, config: RunConfig) -> bool:
    """May one more training session of group ``key`` be admitted? Always when the run has no
    batch_size; else when its places fit under the limit (or it takes none). A run holding no
    place admits, so a group larger than the limit is never shut out for good."""
    limit = config.admission_limit()
    if limit is None:
        return True
    size = config.group_size or 1
    places, cost = held.places(size), held.cost(key, size)
    return cost == 0 or places == 0 or places + cost <= limit


class Admission:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._locks: dict[str, asyncio.Lock] = {}
        self.waits = 0
        self.refusals = 0

    def lock(self, run_id: str) -> asyncio.Lock:
        """Held while a session is checked and created, so two callers cannot both take the
        last place."""
        return self._locks.setdefault(run_id, asyncio.Lock())

    async def notify(self) -> None:
        """Places were freed (sessions trained or dropped) or the run's config changed: waiters
        look again."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_room(
        self, check: Callable[[], Awaitable[tuple[bool, RunConfig]]], wait_s: float | None = None
    ) -> None:
        """Return once ``check`` admits; raise 429 after the run's admission_wait_s."""
        admitted, config = await check()
        if admitted:
            return
        self.waits += 1
        timeout = config.admission_wait_s if wait_s is None else wait_s
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                self.refusals += 1
                retry = max(1, math.ceil(min(RETRY_AFTER_S, timeout or RETRY_AFTER_S)))
                raise StalenessBound(retry)
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            admitted, config = await check()
            if admitted:
                return
