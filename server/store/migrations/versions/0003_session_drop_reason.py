"""why a session was dropped; default rewards within the reward bound

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# The bound rewards now lie within (server/store/run_config.py REWARD_BOUND, as of this revision).
REWARD_BOUND = 1e9


def upgrade() -> None:
    # A dropped session says why: "code: a sentence a user can act on".
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("drop_reason", sa.String(length=500), nullable=True))
    # A default reward stored before the bound existed (NaN, 1e200) would no longer validate:
    # clamp it (not a number: 0).
    runs = sa.table("runs", sa.column("id", sa.String), sa.column("config", sa.JSON))
    connection = op.get_bind()
    for run_id, config in connection.execute(sa.select(runs.c.id, runs.c.config)).all():
        value = (config or {}).get("default_reward")
        if value is None:
            continue
        fixed = _within_bound(value)
        if fixed != value:  # NaN != anything: a NaN is rewritten too
            config = {**config, "default_reward": fixed}
            connection.execute(runs.update().where(runs.c.id == run_id).values(config=config))


def _within_bound(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0.0
    return max(-REWARD_BOUND, min(REWARD_BOUND, float(value)))


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_column("drop_reason")
