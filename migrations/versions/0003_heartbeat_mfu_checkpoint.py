"""Heartbeats carry MFU and the attempt's cumulative checkpoint-save seconds (goodput's checkpoint
stalls).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 23:59:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.add_column(sa.Column("mfu", sa.Float(), nullable=True))
        batch.add_column(sa.Column("checkpoint_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.drop_column("checkpoint_s")
        batch.drop_column("mfu")
