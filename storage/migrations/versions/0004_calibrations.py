"""A model's link calibration (trained link tokens, `rag-kvcache calibrate`) is kept in the
catalog: one row per model and chunk encode settings, its safetensors bytes and their sha256.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("encode_settings", sa.String(length=1024), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["fingerprint"],
            ["models.fingerprint"],
            name="fk_calibrations_fingerprint_models",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("fingerprint", "encode_settings", name="pk_calibrations"),
    )


def downgrade() -> None:
    op.drop_table("calibrations")
