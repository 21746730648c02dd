"""A catalog names its store: one row with a random store ID, made when the catalog is made
(or upgraded), which namespaces the store's Redis keys and ties its folder's marker to it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "store_identity",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("store_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_store_identity_one_row"),
        sa.PrimaryKeyConstraint("id", name="pk_store_identity"),
    )
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":  # stored as UTC without offset (UTCDateTime)
        now = now.replace(tzinfo=None)
    op.bulk_insert(table, [{"id": 1, "store_id": uuid.uuid4().hex, "created_at": now}])


def downgrade() -> None:
    op.drop_table("store_identity")
