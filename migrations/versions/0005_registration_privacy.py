"""A job's model registration (state and outcome) and the DP-SGD epsilon/delta of each heartbeat.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("registration_state", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("registration", sa.JSON(), nullable=True))
        batch.create_check_constraint(op.f("ck_jobs_registration_state"),
                                      "registration_state IN ('pending', 'registered', 'failed')")
        batch.create_index("ix_jobs_registration_state", ["registration_state"])
    with op.batch_alter_table("heartbeats") as batch:
        batch.add_column(sa.Column("dp_epsilon", sa.Float(), nullable=True))
        batch.add_column(sa.Column("dp_delta", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.drop_column("dp_delta")
        batch.drop_column("dp_epsilon")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_registration_state")
        batch.drop_constraint(op.f("ck_jobs_registration_state"), type_="check")
        batch.drop_column("registration")
        batch.drop_column("registration_state")
