"""SQLAlchemy tables of the trajectory store. The Alembic migrations beside them (migrations/)
create them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from server.store.run_config import MODEL_NAME_LENGTH

DROP_REASON_LENGTH = 500  # a drop reason: a short code, a colon, a sentence
SESSION_TARGET = "session"  # the target of a reward for the whole session


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite returns them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime: store UTC-aware datetimes")
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Run(Base):
    """One training job: a model, its config, and the policy version the engines serve. A LoRA
    run's versions are adapters on the served base model (``lora``): its ``weights_path`` is the
    current version's adapter directory, and version 0 is the base model itself."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(500))
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    weights_path: Mapped[str | None] = mapped_column(String(1000))  # where that version lives
    lora: Mapped[bool] = mapped_column(default=False, server_default=false())
    # The version the run's production sessions are served (its promotion gate); None: no gate.
    promoted_version: Mapped[int | None] = mapped_column(Integer)
    api_key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_default: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RunVersion(Base):
    """One published version of a run, kept as a name (``<run>@<version>``) a request can pin:
    where its weights (an adapter, for a LoRA run) are, the version that was current before it
    (``parent``: the lineage), and for a rollback the earlier version whose weights it serves
    again (``source``). Retention marks a version ``evicted`` (a pin to it is refused, 410);
    its row stays, as the lineage's."""

    __tablename__ = "run_versions"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str | None] = mapped_column(String(1000))
    lora: Mapped[bool] = mapped_column(default=False)
    parent: Mapped[int | None] = mapped_column(Integer)
    source: Mapped[int | None] = mapped_column(Integer)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    published_at: Mapped[datetime] = mapped_column(default=utcnow)
    evicted_at: Mapped[datetime | None] = mapped_column()
    evicted_reason: Mapped[str | None] = mapped_column(String(DROP_REASON_LENGTH))
    promoted_at: Mapped[datetime | None] = mapped_column()


class Session(Base):
    """One agent episode in a run; its status moves open -> ended -> trainable -> claimed ->
    consumed, or to dropped (with a ``drop_reason``) when it cannot be trained; a step that
    trains it records its version in ``trained_version``. An evaluation session (``eval``) is
    never trained: it moves open -> ended -> evaluated."""

    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_run_status", "run_id", "status"),
        Index("ix_sessions_run_group", "run_id", "group_id"),
        Index("ix_sessions_run_created", "run_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    task_id: Mapped[str | None] = mapped_column(String(200))
    group_id: Mapped[str | None] = mapped_column(String(200))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    api_key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="open")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_activity_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    trainable_at: Mapped[datetime | None]
    rewarded: Mapped[bool] = mapped_column(default=False)
    turn_count: Mapped[int] = mapped_column(Integer, default=0)
    row_count: Mapped[int] = mapped_column(Integer, default=0)
    breaks: Mapped[int] = mapped_column(Integer, default=0)
    # Its conversations (docs/concepts.md): the main thread and each side request's thread.
    conversations: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    engine: Mapped[str | None] = mapped_column(String(500))
    claim_id: Mapped[str | None] = mapped_column(String(64), index=True)
    claim_expires_at: Mapped[datetime | None]
    consumed_at: Mapped[datetime | None]
    drop_reason: Mapped[str | None] = mapped_column(String(DROP_REASON_LENGTH))
    eval: Mapped[bool] = mapped_column(default=False, server_default=false())
    # A production session: never trained, served the run's promoted version (its gate's).
    production: Mapped[bool] = mapped_column(default=False, server_default=false())
    # The version published by the first training step that trained it (its claim marked
    # trained): from then on it holds no admission place (server.rl.admission).
    trained_version: Mapped[int | None] = mapped_column(Integer)


class Turn(Base):
    """One sampled completion: the exact prompt and completion tokens, with the logprob and
    the policy version of every completion token."""

    __tablename__ = "turns"
    __table_args__ = (Index("ix_turns_session_index", "session_id", "turn_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    completion_id: Mapped[str] = mapped_column(String(100), unique=True)
    request_id: Mapped[str] = mapped_column(String(100))
    surface: Mapped[str] = mapped_column(String(16), default="chat")
    model: Mapped[str | None] = mapped_column(String(MODEL_NAME_LENGTH))
    turn_index: Mapped[int] = mapped_column(Integer)
    row_index: Mapped[int] = mapped_column(Integer)
    extends_previous: Mapped[bool] = mapped_column(default=False)
    conversation: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    messages: Mapped[list[Any] | None] = mapped_column(JSON)
    tools: Mapped[list[Any] | None] = mapped_column(JSON)
    response: Mapped[dict[str, Any]] = mapped_column(default=dict)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    completion_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    versions: Mapped[bytes] = mapped_column(LargeBinary)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(32))
    sampling: Mapped[dict[str, Any]] = mapped_column(default=dict)
    engine: Mapped[str | None] = mapped_column(String(500))
    resubmits: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Reward(Base):
    """A reward for a whole session (target "session") or for one turn (target = its id)."""

    __tablename__ = "rewards"
    __table_args__ = (UniqueConstraint("session_id", "target", name="uq_rewards_target"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    target: Mapped[str] = mapped_column(String(100))
    completion_id: Mapped[str | None] = mapped_column(String(100))
    value: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrainerStep(Base):
    """The figures a trainer reported for one step of a run (reward, staleness, loss, rates):
    what the dashboard charts. Reposting a step replaces its figures."""

    __tablename__ = "trainer_steps"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_trainer_steps_run_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ServerSecret(Base):
    """A random secret the server made once and keeps (hex), by name: what it signs with
    (the dashboard's login cookies), so a restart keeps browsers logged in."""

    __tablename__ = "server_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Leader(Base):
    """The replica that leads (one row, id 1): it drives engine health and weight swaps while it
    holds the store's leader lock (``store.leadership``), and is reached at ``url``. Written by
    each replica as it takes the lock; the row of one that died stays until the next takes it,
    so readers check the lock's holder (``backend_pid``) before trusting it."""

    __tablename__ = "leader"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica_id: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2000))
    backend_pid: Mapped[int | None] = mapped_column(Integer)  # its lock's connection (Postgres)
    since: Mapped[datetime] = mapped_column(default=utcnow)
