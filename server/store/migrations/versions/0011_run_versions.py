"""Versions as names: every published version of a run (its weights' path, lineage, retention,
promotion), the version a run's promotion gate serves, and production sessions

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_versions",
        sa.Column("run_id", sa.String(length=64), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("path", sa.String(length=1000), nullable=True),
        sa.Column("lora", sa.Boolean(), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("source", sa.Integer(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("evicted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("evicted_reason", sa.String(length=500), nullable=True),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True),
    )
    # A run already past version 0 keeps its current version as a name (pinnable, promotable,
    # a rollback's parent); the versions before it were never recorded.
    op.execute(
        "INSERT INTO run_versions (run_id, version, path, lora, published_at) "
        "SELECT id, policy_version, weights_path, lora, CURRENT_TIMESTAMP FROM runs "
        "WHERE policy_version > 0"
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("promoted_version", sa.Integer(), nullable=True))
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("production", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_column("production")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("promoted_version")
    op.drop_table("run_versions")
