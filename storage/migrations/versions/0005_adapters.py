"""A model's LoRA link calibration (`rag-kvcache calibrate --kind lora`) is kept in the
catalog: one row per base model, its safetensors bytes and their sha256.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["fingerprint"],
            ["models.fingerprint"],
            name="fk_adapters_fingerprint_models",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("fingerprint", name="pk_adapters"),
    )


def downgrade() -> None:
    op.drop_table("adapters")
