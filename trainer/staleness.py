"""The staleness rule: how many updates the trained weights are ahead of a sampled token's.

Versions number the published weights; the *position* of a version is the number of training
updates its weights have had. Without restarts the two are the same, and a token sampled by
version u lags the policy at version p by p - u updates. A restart breaks the numbering: a
trainer that restores the checkpoint of version c while the engines had gone on to v > c (steps
trained after the checkpoint, then lost) republishes the checkpoint's weights as a new version
r > v. Version r then holds c's weights, and the versions after it count on from there:

    position(u) = u                              with no restart
    position(r) = position(c)                    for a republish (c, r)
    position(u) = position(c) + (u - r)          for u > r
    position(u) = its position before (c, r)     for u < r: versions c+1..v keep the updates
                                                 they had on the lineage the restart discarded

    versions_behind(u, p) = max(0, position(p) - position(u))

So the sessions a restart gives back train as they would have without it, instead of being
masked as stale by the version numbers the restart itself added; a token of the discarded
lineage lags by the updates the trained weights have had beyond its own (none, right after the
restart), and what its weights drifted from the restored ones is corrected by the behaviour
weight pi_prox / pi_behav, as for any token.

Pure: versions in, numbers out; it knows nothing about sessions, tokens or the server.
"""

from __future__ import annotations

from collections.abc import Sequence

# (checkpoint version c, republished version r): version r serves the weights of version c.
Republish = tuple[int, int]


def position(version: int, republished: Sequence[Republish]) -> int:
    """Updates behind ``version`` along the lineage the current weights descend from.

    ``republished`` lists the republishes in the order they happened.
    """
    for i in reversed(range(len(republished))):
        checkpoint, republish = republished[i]
        if version >= republish:
            return position(checkpoint, republished[:i]) + (version - republish)
    return version


def versions_behind(version: int, policy_version: int, republished: Sequence[Republish]) -> int:
    """How many updates the weights of ``version`` lag those of ``policy_version``."""
    lag = position(policy_version, republished) - position(version, republished)
    return max(0, lag)
