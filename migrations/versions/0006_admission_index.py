"""An index for admission's window: each base priority's oldest PENDING jobs of one backend, read in order.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 01:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_admission", "jobs", ["phase", "backend", "priority", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_admission", table_name="jobs")
