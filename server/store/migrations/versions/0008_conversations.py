"""conversations: each turn's conversation within its session, and each session's count

A store from before holds one conversation per session that has turns (every turn in
conversation 0), which is how it was read then: its breaks stay breaks.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("conversation", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("conversations", sa.Integer(), nullable=False, server_default="0")
        )
    op.execute("UPDATE sessions SET conversations = 1 WHERE turn_count > 0")


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_column("conversations")
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.drop_column("conversation")
