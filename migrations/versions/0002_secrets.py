"""The local backend's secret store: one encrypted value per (project, name).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 23:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("project", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["project"], ["projects.name"], name=op.f("fk_secrets_project_projects"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("project", "name", name=op.f("pk_secrets")),
    )


def downgrade() -> None:
    op.drop_table("secrets")
