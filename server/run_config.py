"""A run's configuration: admission (staleness bound), reward deadlines, claims.

Plain data validated by pydantic; the server and the trainer read the same fields. Keys it does
not know are kept (the trainer's own settings may live here) but never acted on by the server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    batch_size: int | None = Field(
        None, ge=1, description="Sessions per training step; admission is off while unset."
    )
    max_staleness: int = Field(
        1, ge=0, description="How many policy versions generation may run ahead (AReaL's eta)."
    )
    group_size: int | None = Field(
        None, ge=1, description="Sessions per GRPO group; claims then take whole groups."
    )
    admission_wait_s: float = Field(
        30.0, ge=0, description="How long a session waits for admission before a 429."
    )
    idle_timeout_s: float | None = Field(
        600.0, gt=0, description="An open session idle this long is ended (None: never)."
    )
    reward_timeout_s: float | None = Field(
        600.0, gt=0, description="An ended session without a reward after this is resolved."
    )
    on_missing_reward: Literal["drop", "default"] = Field(
        "drop", description="What a reward deadline does: drop the session or use default_reward."
    )
    default_reward: float = Field(0.0, description="The reward on_missing_reward=default gives.")
    claim_lease_s: float = Field(
        300.0, gt=0, description="How long a trainer's claim holds before it returns to the pool."
    )

    def admission_limit(self, policy_version: int) -> int | None:
        """AReaL's bound on sessions admitted so far: (eta + version + 1) * batch_size."""
        if self.batch_size is None:
            return None
        return (self.max_staleness + policy_version + 1) * self.batch_size
