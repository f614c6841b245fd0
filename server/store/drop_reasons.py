"""Why a session was dropped: a short code, a colon, and a sentence a user can act on.

Every reason the store writes is built here, so the codes stay few and the sentences say which
setting to change. A trainer may give its own reasons when it confirms a claim (any text up to
``DROP_REASON_LENGTH`` characters). Pure: this module knows nothing about SQL or HTTP.
"""

from __future__ import annotations

from server.store.tables import DROP_REASON_LENGTH

NO_TURNS = "no_turns: the session ended without a model call"


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _fit(reason: str) -> str:
    """The reason, cut to what the column holds."""
    if len(reason) <= DROP_REASON_LENGTH:
        return reason
    return reason[: DROP_REASON_LENGTH - 1] + "…"


def no_reward(reward_timeout_s: float) -> str:
    return _fit(
        f"no_reward: no session reward within reward_timeout_s ({_seconds(reward_timeout_s)}); "
        "post the reward sooner, raise reward_timeout_s, or set on_missing_reward=default"
    )


def incomplete_group(
    key: str, trainable: int, group_size: int, waited_s: float, group_timeout_s: float
) -> str:
    return _fit(
        f"incomplete_group: {key} had {trainable} of group_size {group_size} sessions "
        f"trainable after {_seconds(round(waited_s, 1))} (group_timeout_s "
        f"{_seconds(group_timeout_s)}); on_incomplete_group=train would train it as it is"
    )


def no_group(group_size: int) -> str:
    return _fit(
        f"no_group: the session has neither group_id nor task_id, so no group of group_size "
        f"{group_size} can form; give sessions a group_id or task_id, or set "
        "on_incomplete_group=train"
    )


def unservable(problem: str) -> str:
    return _fit(
        f"unservable: its metadata holds {problem}, as an older version stored it; no answer "
        "can carry it to the trainer (GET /rl/sessions/{id} shows the rest)"
    )
