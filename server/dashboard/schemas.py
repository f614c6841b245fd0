"""Answers of the dashboard's JSON API under /admin/api (documented at /docs)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.rl.schemas import ROW_TURNS, RunEval, RunTraining, SessionOut, SessionSummary


class RunSummary(BaseModel):
    id: str
    name: str
    model: str
    is_default: bool
    created_at: datetime
    policy_version: int = Field(description="The version the engines serve.")
    sessions: dict[str, int] = Field(description="Sessions by status.")
    session_total: int
    reward_mean: float | None = Field(description="Mean session reward (null: none yet).")
    rewarded_sessions: int
    steps: int = Field(description="Trainer steps reported.")
    last_step: int | None = Field(description="The last step reported (null: none).")
    last_step_at: datetime | None
    trainer_active: bool = Field(
        description="A step arrived within three step intervals (and 5 minutes at least), and "
        "the trainer has not said it stopped."
    )
    trainer: Literal["training", "stopped", "idle", "not started"] = Field(
        description="stopped: the trainer said so when it stopped cleanly; idle: no step for "
        "longer than trainer_active allows (it may have been killed)."
    )
    trainer_quiet_since: datetime | None = Field(
        description="When the last word came from a trainer that has gone quiet (no step for "
        "three step intervals, 30 s at least) without saying it stopped; null otherwise."
    )
    training: RunTraining = Field(
        description="What of the sampled tokens trained and why the rest did not, with a "
        "warning below min_trained_share, as GET /rl/runs/{id} shows it."
    )


class RunsPage(BaseModel):
    items: list[RunSummary]
    total: int
    limit: int
    offset: int


class RunDetail(RunSummary):
    config: dict[str, Any]
    totals: dict[str, int] = Field(
        description="turns, prompt_tokens, completion_tokens, and of its sessions: rows, "
        "conversations, breaks."
    )


class StepPoint(BaseModel):
    step: int
    version: int
    time: float = Field(description="Unix seconds: the trainer's clock, else arrival.")
    metrics: dict[str, Any] = Field(description="The figures the trainer reported.")


class RewardPoint(BaseModel):
    time: float = Field(description="Unix seconds at the start of the bucket.")
    count: int
    mean: float
    std: float
    min: float
    max: float


class SessionPoint(BaseModel):
    time: float = Field(description="Unix seconds at the start of the bucket.")
    created: int = Field(description="Sessions started in the bucket.")
    ended: int = Field(description="Sessions ended in the bucket.")
    turns: int = Field(description="Turns of the sessions started in the bucket.")
    breaks: int = Field(description="Breaks of those sessions (changed conversation histories).")


class SwapPoint(BaseModel):
    version: int
    pause_seconds: float
    time: float


class RunSeries(BaseModel):
    run_id: str
    policy_version: int
    now: float = Field(description="The server's clock (unix seconds).")
    steps: list[StepPoint] = Field(
        description="Trainer steps after `after_step`, in order (every n-th when many)."
    )
    step_count: int = Field(description="Steps the run has in all.")
    min_trained_share: float = Field(
        description="The run's min_trained_share, drawn beside the steps' trained share."
    )
    bucket_seconds: int = Field(description="Width of the reward and session buckets.")
    rewards: list[RewardPoint] = Field(description="Session rewards by time of arrival.")
    sessions: list[SessionPoint] = Field(description="Sessions started and ended by time.")
    swaps: list[SwapPoint] = Field(
        description="Weight swaps this server process made for the run, with their pauses."
    )
    eval: RunEval = Field(
        description="Held-out rewards of eval sessions by policy version and task, as GET "
        "/rl/runs/{id} shows them (the reward buckets are the training sessions' only)."
    )


class SessionRow(SessionSummary):
    reward: float | None = Field(description="The whole-session reward (null: none).")
    completion_tokens: int


class SessionsPage(BaseModel):
    items: list[SessionRow]
    total: int = Field(description="Sessions matching the filters in all.")
    limit: int
    offset: int


class TokenRow(BaseModel):
    """One training row, position by position: what the trainer sees."""

    row_index: int
    ids: list[int]
    pieces: list[str] = Field(description="The text of each token.")
    logprobs: list[float] = Field(description="Behaviour logprob (0 on prompt tokens).")
    versions: list[int] = Field(description="Policy version (-1 on prompt tokens).")
    loss_mask: list[int] = Field(description="1 where the token is trained.")
    turn: list[int] = Field(description="Index of the turn that sampled it (-1: prompt).")
    turns: list[dict[str, Any]] = Field(description=ROW_TURNS)


class SessionDetail(SessionOut):
    token_rows: list[TokenRow] = Field(description="The token viewer's data, one per row.")


class EngineRow(BaseModel):
    url: str
    healthy: bool
    in_flight: int = Field(description="Requests this proxy has in flight there.")
    running: int | None = Field(description="Requests the engine is decoding (null: unknown).")
    queued: int | None = Field(description="Requests waiting in the engine (null: unknown).")
    weight_version: str | None
    served_tokens: int = Field(description="Tokens it sampled for this proxy.")
    tokens_per_second: float = Field(description="Over the last health-check interval.")
    engine_tokens_per_second: float | None = Field(description="The engine's own figure.")
    failures: int
    last_error: str | None
