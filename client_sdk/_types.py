"""What the REST API answers, as TypedDicts: plain dicts at run time, typed for the reader.

They mirror the server's JSON (``/docs`` on a running server is the reference), and
tests/unit/test_sdk_schema.py holds them to the server's OpenAPI document, field by field;
timestamps stay ISO-8601 strings. This module knows nothing about HTTP.
"""

from __future__ import annotations

from typing import Any, TypedDict


class EvalFigures(TypedDict):
    """Rewards of a run's rewarded eval sessions answered by one policy version: a session's
    score is its session reward, else the mean of its turn rewards."""

    version: int
    """The policy version of the session's first sampled token."""
    task_id: str | None
    """The task (None: sessions without one; in per-version totals: every task)."""
    count: int
    mean: float
    std: float
    """Population standard deviation (ddof 0)."""
    min: float
    max: float


class RunEval(TypedDict):
    tasks: list[EvalFigures]
    """Per version and task."""
    versions: list[EvalFigures]
    """Per version, over every task."""


class RunTraining(TypedDict):
    """What of a run's sampled tokens trained, and why the rest did not."""

    total_sampled_tokens: int | None
    """Tokens of the sessions the trainer claimed, as its latest step reports them (None: no
    step yet)."""
    total_trained_tokens: int | None
    total_trained_share: float | None
    total_masked_tokens: dict[str, int] | None
    """Tokens masked out of the loss, by cause."""
    total_dropped_sessions: dict[str, int] | None
    """Sessions the trainer dropped, by reason code."""
    dropped_sessions: dict[str, int]
    """Every dropped session of the run by reason code, the server's drops included."""
    min_trained_share: float
    warning: str | None
    """A sentence when the trained share is below min_trained_share, else None."""


class PromotionCandidate(TypedDict):
    version: int
    """A published version newer than the promoted one."""
    count: int
    """Its rewarded eval sessions."""
    mean: float | None


class Promotion(TypedDict):
    """A run's promotion gate: the version its production sessions are served, the candidates."""

    promoted_version: int
    promoted_count: int
    promoted_mean: float | None
    margin: float | None
    """A candidate is promoted at promoted_mean + margin (None: no gate, promoted by hand)."""
    min_eval_sessions: int | None
    candidates: list[PromotionCandidate]


class Run(TypedDict):
    """A run: one training job."""

    id: str
    name: str
    model: str
    model_path: str
    """The model directory the server started from."""
    weights_path: str | None
    """The directory of the weights last published from disk (None: the start)."""
    config: dict[str, Any]
    """The config as it acts: every field, defaults included, and keys the server does not know
    (the trainer's)."""
    policy_version: int
    """The version of the weights the engines serve."""
    is_default: bool
    created_at: str
    sessions: dict[str, int]
    """Sessions by status (open, ended, trainable, claimed, consumed, dropped, evaluated,
    served)."""
    totals: dict[str, int]
    """turns, prompt_tokens, completion_tokens, and of its sessions: rows, conversations,
    breaks."""
    eval: RunEval
    """Eval sessions' rewards by policy version (and task)."""
    promotion: Promotion | None
    """Its promotion gate (None: production sessions are served the current version)."""
    training: RunTraining
    """What of the sampled tokens trained, and why the rest did not."""
    rollbacks: list[list[int]]
    """[source, version] for each rollback, oldest first."""


class RunCreated(Run):
    """A new run, with its key (shown only this once)."""

    api_key: str


class RunMetrics(TypedDict):
    """A run's counters, as GET /rl/runs/{id} reports them."""

    run_id: str
    policy_version: int
    sessions: dict[str, int]
    totals: dict[str, int]


class SessionCreated(TypedDict):
    session_id: str
    run_id: str
    api_key: str
    base_url: str
    status: str


class Turn(TypedDict):
    """One model call: its exact tokens, logprobs and the policy version of each token."""

    completion_id: str
    request_id: str
    surface: str
    """The API the request came in on: chat, completions, responses or messages."""
    model: str | None
    """The model name the request asked for."""
    turn_index: int
    row_index: int
    extends_previous: bool
    conversation: int
    """Its conversation in the session, from 0: the agent's main thread and each side request's
    (a title, a summary, a sub-agent) are apart."""
    messages: list[Any] | None
    tools: list[Any] | None
    response: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[int]
    """The sampled token ids (not completion identifiers: that is ``completion_id``)."""
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    sampling: dict[str, Any]
    engine: str | None
    resubmits: int
    reward: float | None
    created_at: str


class Row(TypedDict):
    """One training row: merged turns, loss mask 1 on sampled tokens."""

    row_index: int
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[dict[str, Any]]
    """Each turn in the row: completion_id, turn_index, start, end (its sampled tokens are
    input_ids[start:end]), reward (its own, or None), temperature (what it was sampled at, or
    None), alternative (True when the session did not go on from it: a choice of a retried
    request, or one the next request did not continue), finish_reason (why its answer ended:
    "length" when the length limit cut it, else "stop" or "tool_calls")."""


class SessionDetail(TypedDict):
    """A stored session with its turns and the training rows built from them."""

    session_id: str
    run_id: str
    task_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    status: str
    created_at: str
    ended_at: str | None
    turn_count: int
    row_count: int
    """Training rows: one per conversation, plus one per break, retry and extra choice."""
    conversations: int
    """The main thread and each request that continued none of the session's conversations."""
    breaks: int
    """Requests that changed a conversation's recorded history (each opened a row)."""
    drop_reason: str | None
    """Why it was dropped ("code: a sentence", e.g. "no_reward: ..."); None unless dropped."""
    eval: bool
    """An evaluation session: never trained; "evaluated" once ended and rewarded."""
    production: bool
    """A production session: served the promoted version, never trained; "served" once ended."""
    retries: int
    """Requests sent again whose answer the session did not go on from (alternatives)."""
    reward: float | None
    rewards: dict[str, float]
    """By target: "session" or a completion_id."""
    turns: list[Turn]
    rows: list[Row]
    withheld: dict[str, str]
    """Stored values the server could not send back (a string UTF-8 cannot encode, nesting
    too deep, as older versions stored them), by where they are ("metadata",
    "turns[2].messages"), with why; each is shown empty. Empty when nothing is withheld."""


class RewardResult(TypedDict):
    session_id: str
    target: str
    """"session", or the rewarded completion_id."""
    reward: float
    created: bool
    """False when the same reward was already there (posting it again is a no-op)."""
    status: str


class SessionEnded(TypedDict):
    session_id: str
    status: str
    """"ended", or "trainable" when it already had its session reward (or per-turn rewards,
    where the run's turn_rewards_suffice is true); "evaluated" instead for an eval session;
    "served" for a production session."""
