"""The warning a run gives when too little of what its sessions sampled trained: one sentence,
written once for the trainer's log and the server's run view (``GET /rl/runs/{id}``).

Pure and stdlib only. It knows nothing of where the figures come from (the trainer's running
totals, or a step record the server stored), of HTTP or SQL, nor of which drop codes are the
trainer's and which the server's: the caller passes the causes it means, already counted. It
does not check the figures either: a caller holding figures of unknown type (a stored step
record) cleans them first.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TOP_CAUSES", "share_warning", "untrained_warning"]

TOP_CAUSES = 3  # of each kind (masked tokens, dropped sessions), the biggest first


def share_warning(
    share: float | None,
    sampled: int | None,
    masked: Mapping[str, int],
    dropped: Mapping[str, int],
    min_share: float,
) -> str | None:
    """None when ``share`` (of the ``sampled`` tokens, the share that trained) is unknown or at
    least ``min_share``; else one sentence naming the biggest causes: ``masked`` tokens by cause
    and ``dropped`` sessions by reason code."""
    if share is None or share >= min_share:
        return None
    causes = [f"{n} tokens masked as {cause}" for cause, n in _biggest(masked)]
    causes += [f"{n} sessions dropped as {code}" for code, n in _biggest(dropped)]
    of_tokens = "the tokens" if sampled is None else f"the {sampled} tokens"
    return (
        f"only {share:.0%} of {of_tokens} the trainer's sessions sampled trained "
        f"(min_trained_share {min_share:g}); the biggest causes: "
        + ("; ".join(causes) or "none counted")
    )


def untrained_warning(dropped: Mapping[str, int]) -> str | None:
    """For a run with no step yet (a batch that trains nothing is no step): one sentence when
    the trainer dropped sessions it claimed (``dropped``: by reason code), naming the biggest
    codes; None when it dropped none."""
    total = sum(dropped.values())
    if total <= 0:
        return None
    codes = ", ".join(f"{n} as {code}" for code, n in _biggest(dropped))
    return (
        f"no step has trained anything yet; {total} sessions the trainer claimed were "
        f"dropped: {codes}"
    )


def _biggest(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """The ``TOP_CAUSES`` biggest counts, biggest first (ties by name, so the text is stable);
    counts of 0 are left out."""
    ranked = sorted(
        ((k, n) for k, n in counts.items() if n > 0), key=lambda item: (-item[1], item[0])
    )
    return ranked[:TOP_CAUSES]
