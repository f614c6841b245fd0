"""Bodies and answers of the REST API under /rl and /admin (documented at /docs)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StringConstraints,
    model_validator,
)

from server.bounds import (
    MAX_INT,
    NAME_LENGTH,
    Count,
    DtypeName,
    Host,
    Id,
    Name,
    NoNul,
    Shape,
    StoredPath,
)
from server.store.run_config import MAX_COUNT, REWARD_BOUND, RunConfig, Seconds
from server.store.tables import DROP_REASON_LENGTH
from server.store.turns import TurnFields

RENDEZVOUS_WAIT_S = 5.0
MAX_TENSORS = 1_000_000


DROP_REASON = (
    'Why the session was dropped: a short code, a colon, a sentence (e.g. "no_reward: ...", '
    '"no_turns: ...", "incomplete_group: ...", "no_group: ...", "unservable: ...", or a '
    "trainer's own reason); null unless dropped."
)
ROW_TURNS = (
    "The turns in the row, in order, each {completion_id, turn_index, start, end (its sampled "
    "tokens are input_ids[start:end]), reward (its own reward or null), temperature (what it "
    "was sampled at; null if unknown), alternative (true when the session did not go on from "
    "it: a choice of a retried request, or a choice the next request did not continue), "
    "finish_reason (why its answer ended: length when the length limit cut it, else stop or "
    "tool_calls)}."
)


class RunCreate(BaseModel):
    model_config = ConfigDict(strict=True)

    name: Name = Field("run", description="A name for people.")
    config: RunConfig = Field(default_factory=RunConfig, description="The run's configuration.")


ROW_COUNT = (
    "Its training rows: one per conversation, plus one per break, retry and extra choice (n > 1)."
)
CONVERSATIONS = (
    "Its conversations: the agent's main thread and each request that continued none of the "
    "session's conversations (a title or summary request, a sub-agent, a compacted history)."
)
BREAKS = (
    "Requests that changed a conversation's recorded history (edited or dropped an earlier "
    "message, or re-rendered an answer otherwise): each opened a row. Not retries, not new "
    "conversations."
)
EVAL_SESSION = (
    "An evaluation session: served and recorded like any other, never trained, never counted "
    'against admission; it ends "evaluated" (not "trainable") once ended and rewarded.'
)
PRODUCTION_SESSION = (
    "A production session: traffic the run serves but never trains on, admitted at once, never "
    "counted against admission; served the run's promoted version where it has one (its "
    'promotion gate), else its current version; it ends "served" once ended, rewarded or not '
    "(rewards are recorded all the same)."
)


class EvalFigures(BaseModel):
    """Rewards of a run's rewarded eval sessions answered by one policy version."""

    version: int = Field(
        description="The policy version of the session's first sampled token (the weights "
        "that answered)."
    )
    task_id: str | None = Field(
        description="The task (null: sessions without one; in per-version totals: every task)."
    )
    count: int
    mean: float
    std: float = Field(description="Population standard deviation (ddof 0).")
    min: float
    max: float


class RunEval(BaseModel):
    tasks: list[EvalFigures] = Field(
        description="Per version and task. A session's score is its session reward, else the "
        "mean of its turn rewards; unrewarded eval sessions do not count."
    )
    versions: list[EvalFigures] = Field(description="Per version, over every task.")


class PromotionCandidate(BaseModel):
    version: int = Field(description="A published version newer than the promoted one.")
    count: int = Field(description="Its rewarded eval sessions.")
    mean: float | None = Field(description="Their mean reward (null: none).")


class PromotionOut(BaseModel):
    """The run's promotion gate: what its production sessions are served, and what may be
    promoted next."""

    promoted_version: int = Field(description="The version production sessions are served.")
    promoted_count: int = Field(description="Rewarded eval sessions of the promoted version.")
    promoted_mean: float | None = Field(description="Their mean reward (null: none).")
    margin: float | None = Field(
        description="A candidate is promoted once its mean is at least promoted_mean + margin "
        "(null: no gate, a version promoted by hand)."
    )
    min_eval_sessions: int | None = Field(
        description="Rewarded eval sessions a candidate needs (null: no gate)."
    )
    candidates: list[PromotionCandidate] = Field(
        description="The published versions newer than the promoted one, not evicted, oldest "
        "first: the newest that passes is promoted."
    )


class PromoteIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(
        ge=0,
        le=MAX_INT,
        description="The version to serve the run's production sessions: 0 (the base) or one "
        "it published and has not evicted.",
    )


class RunTraining(BaseModel):
    """What of the run's sampled tokens trained, and why the rest did not."""

    total_sampled_tokens: int | None = Field(
        description="Tokens the sessions the trainer claimed sampled (trained, masked, or in "
        "dropped sessions), as its latest step reports them (null: no step yet)."
    )
    total_trained_tokens: int | None = Field(description="Of those, the tokens that trained.")
    total_trained_share: float | None = Field(
        description="total_trained_tokens / total_sampled_tokens (1.0 when nothing was sampled)."
    )
    total_masked_tokens: dict[str, int] | None = Field(
        description="Tokens masked out of the loss, by cause (stale, off_temperature, ...)."
    )
    total_dropped_sessions: dict[str, int] | None = Field(
        description="Sessions the trainer dropped, by reason code."
    )
    dropped_sessions: dict[str, int] = Field(
        description="Every dropped session of the run by reason code (the text of its "
        "drop_reason before the colon), the server's drops included (no_turns, no_reward, "
        "incomplete_group, ...)."
    )
    min_trained_share: float = Field(description="The run's min_trained_share.")
    warning: str | None = Field(
        description="A sentence naming the biggest causes when total_trained_share is below "
        "min_trained_share, or, before any step, when sessions the trainer claimed were dropped "
        "(a batch that trains nothing is no step); null otherwise."
    )


class RunOut(BaseModel):
    id: str
    name: str
    model: str
    model_path: str = Field(description="The model directory the server started from.")
    weights_path: str | None = Field(
        description="The directory of the weights last published from disk (null: the start)."
    )
    config: dict[str, Any] = Field(
        description="The run's config as it acts: every field, defaults included, and keys the "
        "server does not know (the trainer's)."
    )
    policy_version: int = Field(description="The version of the weights the engines serve.")
    is_default: bool
    created_at: datetime
    sessions: dict[str, int] = Field(description="Sessions by status.")
    totals: dict[str, int] = Field(
        description="turns, prompt_tokens, completion_tokens, and of its sessions: rows, "
        "conversations, breaks."
    )
    eval: RunEval = Field(description="Held-out rewards of eval sessions by version and task.")
    promotion: PromotionOut | None = Field(
        description="Its promotion gate: the version production sessions are served, the "
        "candidates with their eval figures (null: no gate and no promotion by hand; production "
        "sessions are served the current version).",
    )
    training: RunTraining = Field(
        description="What of the sampled tokens trained (the trainer's totals) and why the rest "
        "did not: masked tokens by cause, dropped sessions by reason."
    )
    rollbacks: list[list[int]] = Field(
        description="[source, version] for each rollback: a version that serves an earlier "
        "one's weights again, oldest first, as the staleness rule counts it (GET "
        "/rl/runs/{id}/versions shows the whole lineage).",
    )


class RollbackIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Count = Field(
        description="The earlier version to serve again (0: the base model); published as the "
        "run's next version, whose source it is."
    )


class RunVersionOut(BaseModel):
    version: int
    path: str | None = Field(
        description="Its weights directory, or adapter directory for a LoRA run (null: the base "
        "model, or weights sent over a weight group)."
    )
    lora: bool
    parent: int | None = Field(description="The version current before it was published.")
    source: int | None = Field(
        description="The earlier version whose weights it serves again (a rollback or a "
        "trainer's restart); null for weights trained anew."
    )
    size_bytes: int | None
    published_at: datetime
    evicted_at: datetime | None = Field(description="When retention evicted it (null: kept).")
    evicted_reason: str | None
    promoted_at: datetime | None
    current: bool = Field(description="The run's version now.")
    promoted: bool = Field(description="The version the run's promotion gate serves.")


class RunCreated(RunOut):
    api_key: str = Field(description="The run's key; shown once.")


WITHHELD = (
    "Stored values this answer cannot carry, by where they are (metadata, turns[2].messages), "
    "with why: a string UTF-8 cannot encode or nesting deeper than 200 levels, as older versions "
    "stored them. Each is shown empty ({} or []); empty when nothing is withheld."
)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    run_id: Id | None = Field(None, description="The run (default: the server's default run).")
    task_id: Name | None = Field(None, description="The task (for baselines).")
    group_id: Name | None = Field(None, description="The GRPO group.")
    metadata: dict[Name, Any] = Field(
        default_factory=dict,
        max_length=1000,
        description="Anything of yours: JSON of at most max_metadata_bytes (64 KiB by default) "
        "as UTF-8, nested at most max_json_depth deep.",
    )
    eval: bool = Field(
        False,
        description=EVAL_SESSION + " Admitted even at the staleness bound; its group_id may not "
        "be shared with training sessions.",
    )
    production: bool = Field(
        False,
        description=PRODUCTION_SESSION + " Not with eval; its group_id may not be shared with "
        "sessions of another kind.",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> SessionCreate:
        if self.eval and self.production:
            raise ValueError(
                "a session is eval or production, not both: an eval session scores a version, "
                "a production session is served the promoted one"
            )
        return self


class SessionCreated(BaseModel):
    session_id: str
    run_id: str
    api_key: str = Field(description="Use it as the OpenAI api_key; shown once.")
    base_url: str = Field(description="Point the agent's OpenAI client here.")
    status: str


class RewardIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(
        strict=True,
        allow_inf_nan=False,
        ge=-REWARD_BOUND,
        le=REWARD_BOUND,
        description=f"A finite number within [-{REWARD_BOUND:g}, {REWARD_BOUND:g}].",
    )
    completion_id: Id | None = Field(None, description="Reward one turn instead of the session.")


class RewardOut(BaseModel):
    session_id: str
    target: str = Field(description='"session", or the rewarded completion_id.')
    reward: float
    created: bool = Field(description="False when the same reward was already there.")
    status: str


class SessionEnded(BaseModel):
    session_id: str
    status: str = Field(
        description='"ended", or "trainable" when it already had its session reward (or per-turn '
        'rewards, where the run\'s turn_rewards_suffice is true); "evaluated" instead of '
        '"trainable" for an eval session; "served" for a production session.'
    )


@dataclass(kw_only=True)
class TurnOut(TurnFields):
    """A turn as GET /rl/sessions/{id} shows it: its stored fields, its own reward (null: none),
    and when it was served."""

    reward: float | None
    created_at: datetime


class RowOut(BaseModel):
    row_index: int
    input_ids: list[int]
    loss_mask: list[int] = Field(description="1 on tokens the model sampled, 0 on the rest.")
    logprobs: list[float]
    versions: list[int]
    turns: list[dict[str, Any]] = Field(description=ROW_TURNS)


SessionStatus = Literal[
    "open", "ended", "trainable", "claimed", "consumed", "dropped", "evaluated", "served"
]


class SessionSummary(BaseModel):
    session_id: str
    run_id: str
    task_id: str | None
    group_id: str | None
    status: str
    created_at: datetime
    ended_at: datetime | None
    turn_count: int
    row_count: int = Field(description=ROW_COUNT)
    conversations: int = Field(description=CONVERSATIONS)
    breaks: int = Field(description=BREAKS)
    drop_reason: str | None = Field(description=DROP_REASON)
    eval: bool = Field(description=EVAL_SESSION)
    production: bool = Field(description=PRODUCTION_SESSION)


class SessionOut(BaseModel):
    session_id: str
    run_id: str
    task_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    withheld: dict[str, str] = Field(description=WITHHELD)
    status: str
    created_at: datetime
    ended_at: datetime | None
    turn_count: int
    row_count: int = Field(description=ROW_COUNT)
    conversations: int = Field(description=CONVERSATIONS)
    breaks: int = Field(description=BREAKS)
    drop_reason: str | None = Field(description=DROP_REASON)
    eval: bool = Field(description=EVAL_SESSION)
    production: bool = Field(description=PRODUCTION_SESSION)
    retries: int = Field(
        description="Requests the agent sent again (the same prompt) whose answer the session "
        "did not go on from: their turns are alternatives."
    )
    reward: float | None
    rewards: dict[str, float]
    turns: list[TurnOut]
    rows: list[RowOut]


class ClaimIn(BaseModel):
    model_config = ConfigDict(strict=True)

    max_sessions: int = Field(
        ge=1,
        le=100_000,
        description="At most this many sessions; a GRPO group is never split, so the first "
        "group is claimed whole even if it is larger.",
    )
    lease_s: Seconds | None = Field(None, description="Default: the run's claim_lease_s.")
    group_size: int | None = Field(
        None,
        ge=1,
        le=MAX_INT,
        description="Default: the run's group_size. Above 1, whole groups (by group_id, else "
        "task_id) with group_size trainable sessions, or incomplete ones after the run's "
        "group_timeout_s, and sessions with neither id; on_incomplete_group says whether those "
        "are trained or dropped. Unset or 1: the trainable sessions of a group_id all at once, "
        "in one claim; any other session alone.",
    )


class ClaimedSessionOut(BaseModel):
    session_id: str
    task_id: str | None
    group_id: str | None
    metadata: dict[str, Any]
    reward: float | None
    rows: list[RowOut]


class ClaimOut(BaseModel):
    claim_id: str
    expires_at: datetime = Field(description="When the lease runs out (renew it before).")
    run_config: dict[str, Any] = Field(
        description="The run's config as the claim found it, every field with its default "
        "(temperature, off_temperature, group_size, ...), and keys the server does not know."
    )
    sessions: list[ClaimedSessionOut]


DropReason = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=DROP_REASON_LENGTH),
    NoNul,
]
EACH_WITH_ITS_REASON = (
    f'each with its reason ("code: a sentence", at most {DROP_REASON_LENGTH} characters)'
)


class ConfirmIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dropped: dict[Id, DropReason] = Field(
        default_factory=dict,
        max_length=100_000,
        description=f"Sessions of the claim not to consume but to drop, {EACH_WITH_ITS_REASON}.",
    )


class ConfirmOut(BaseModel):
    claim_id: str
    consumed: int = Field(description="Sessions this call marked consumed.")
    dropped: int = Field(description="Sessions this call marked dropped.")
    settled: int = Field(
        description="Every session of the claim now consumed or dropped (the same when "
        "confirming again); fewer than the claim gave means another claim took some after its "
        "lease ran out."
    )


class DropIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dropped: dict[Id, DropReason] = Field(
        min_length=1,
        max_length=10_000,
        description=f"Sessions of the claim to drop now, {EACH_WITH_ITS_REASON}.",
    )


class DropOut(BaseModel):
    claim_id: str
    dropped: int = Field(description="Sessions this call marked dropped.")
    held: int = Field(description="Sessions of the claim still claimed.")


class TrainedIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: int = Field(
        ge=0, le=MAX_COUNT, description="The policy version the step that trained it published."
    )


class TrainedOut(BaseModel):
    claim_id: str
    trained: int = Field(
        description="Sessions of the claim now marked trained (they no longer hold admission "
        "places); 0 for an unknown or settled claim."
    )


class ReleaseOut(BaseModel):
    claim_id: str
    released: int = Field(description="Sessions given back to the pool.")


class RenewIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    claim_ids: list[Id] = Field(max_length=10_000, description="The claims to hold longer.")
    lease_s: Seconds | None = Field(
        None, description="Seconds from now (default: the run's claim_lease_s)."
    )


class RenewOut(BaseModel):
    held: dict[str, int] = Field(
        description="For each claim, the sessions it now holds: its claimed ones, and those "
        "back in the pool after a lapse that no other claim took (0: none left)."
    )
    expires_at: datetime | None = Field(
        description="When the renewed leases run out (null: no claim holds a session)."
    )


class DistributedWeightsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    group_name: Name = Field(description="The group formed with POST /admin/weights/group.")
    names: list[Name] = Field(
        min_length=1, max_length=MAX_TENSORS, description="Parameter names, in broadcast order."
    )
    dtypes: list[DtypeName] = Field(
        max_length=MAX_TENSORS, description="torch dtype name of each, e.g. float32."
    )
    shapes: list[Shape] = Field(max_length=MAX_TENSORS, description="Shape of each.")
    load_format: Literal["flattened_bucket"] | None = Field(
        None, description='"flattened_bucket": one flat broadcast (null: one per tensor).'
    )

    @model_validator(mode="after")
    def _same_lengths(self) -> DistributedWeightsIn:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class WeightsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model_path: StoredPath | None = Field(
        None,
        description="A Hugging Face directory the engines can read (at most 1,000 characters: "
        "the run records it).",
    )
    distributed: DistributedWeightsIn | None = Field(
        None,
        description="Instead of model_path: the engines receive the weights from the trainer's "
        "broadcast over the named torch.distributed group while this call holds them paused.",
    )
    adapter_path: StoredPath | None = Field(
        None,
        description="Instead of model_path: a LoRA adapter directory the engines can read "
        "(peft's layout: adapter_config.json, adapter_model.safetensors), a version of a LoRA "
        "run on the served base model. The engines load it under the name `<run id>@<version>` "
        "alongside the other runs' adapters, without pausing; the run's requests are served "
        "with it from then on.",
    )
    version: Count | None = Field(None, description="Default: the current version + 1.")
    run_id: Id | None = Field(None, description="Default: the server's default run.")

    @model_validator(mode="after")
    def _one_source(self) -> WeightsIn:
        given = [self.model_path, self.distributed, self.adapter_path]
        if sum(source is not None for source in given) != 1:
            raise ValueError("give exactly one of model_path, distributed and adapter_path")
        return self


class WeightGroupIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    master_address: Host = Field(
        description="Where the trainer (rank 0) hosts the rendezvous: a host name or an IP "
        "address. Something must accept connections there (rank 0 waiting for the engines) "
        f"within {RENDEZVOUS_WAIT_S:g} s of the call, or the call is refused with a 422."
    )
    master_port: int = Field(ge=1, le=65535)
    group_name: Annotated[str, StringConstraints(min_length=1, max_length=NAME_LENGTH)] = (
        "weight_update_group"
    )
    backend: Literal["gloo", "nccl"] = Field("nccl", description="gloo for CPU engines.")


MetricText = Annotated[str, StringConstraints(max_length=10_000)]
MetricItem = StrictFloat | StrictInt | MetricText | None
MetricCounts = Annotated[dict[Name, StrictInt], Field(max_length=1000)]  # e.g. tokens by cause
MetricValue = MetricItem | Annotated[list[MetricItem], Field(max_length=100_000)] | MetricCounts


class StepIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=1, le=MAX_INT, description="The trainer's step number (1 first).")
    version: Count = Field(description="The policy version the step published.")
    metrics: dict[Name, MetricValue] = Field(
        default_factory=dict,
        max_length=500,
        description="The step's figures by name: numbers, strings, lists of them, counts by "
        "name (masked_tokens, total_dropped_sessions), or null "
        "(reward_mean, trained_tokens, staleness_mean, staleness_histogram, clip_fraction, ...; "
        "see the README). Non-finite numbers are stored as null. A `session_ids` list is used "
        "to compute the batch's reward spread (reward_std, reward_min, reward_max) and is not "
        "stored.",
    )


class StepOut(BaseModel):
    run_id: str
    step: int
    version: int
    replaced: bool = Field(description="True when the step had been reported before.")


class WeightsOut(BaseModel):
    run_id: str
    policy_version: int
    engines: list[dict[str, Any]]
    pause_seconds: float = Field(description="How long generation was paused for the swap.")


class LeaderView(BaseModel):
    replica_id: str
    url: str = Field(
        description="Where the other replicas forward weight swaps (its --advertise-url)."
    )
    since: datetime = Field(description="When it took the lead.")


class LeaderOut(BaseModel):
    replica_id: str = Field(description="This replica's id.")
    leading: bool = Field(description="Whether this replica leads.")
    leader: LeaderView | None = Field(
        description="The replica that leads now; null while none does (a leader died and "
        "none has taken over yet)."
    )


class Health(BaseModel):
    status: Literal["ok", "no engine"]
    engines_healthy: int = Field(description="Engines in rotation now.")
