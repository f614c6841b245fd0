"""each turn's API surface and the model name its request asked for

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("surface", sa.String(length=16), nullable=False, server_default="chat")
        )
        batch_op.add_column(sa.Column("model", sa.String(length=200), nullable=True))
    # Until now only two surfaces existed: a turn without messages came from /v1/completions.
    turns = sa.table("turns", sa.column("surface", sa.String), sa.column("messages", sa.JSON))
    op.execute(turns.update().where(turns.c.messages.is_(None)).values(surface="completions"))


def downgrade() -> None:
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.drop_column("model")
        batch_op.drop_column("surface")
