"""Initial catalog: models, documents, chunks, placements, counters.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_kv_heads", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name="pk_models"),
    )
    op.create_table(
        "documents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_documents"),
        sa.UniqueConstraint("source", name="uq_documents_source"),
    )
    op.create_table(
        "chunks",
        sa.Column("cache_id", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("document_id", sa.Integer(), nullable=True),
        sa.Column("ordinal", sa.Integer(), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.Text(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("encode_settings", sa.String(length=1024), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hit_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.String(length=16), server_default="pending", nullable=False),
        sa.CheckConstraint("state IN ('pending', 'stored')", name="ck_chunks_state"),
        sa.ForeignKeyConstraint(
            ["document_id"],
            ["documents.id"],
            name="fk_chunks_document_id_documents",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["fingerprint"], ["models.fingerprint"], name="fk_chunks_fingerprint_models"
        ),
        sa.PrimaryKeyConstraint("cache_id", name="pk_chunks"),
    )
    op.create_index("ix_chunks_document_id", "chunks", ["document_id"])
    op.create_index("ix_chunks_expires_at", "chunks", ["expires_at"])
    op.create_index("ix_chunks_state", "chunks", ["state"])
    op.create_table(
        "placements",
        sa.Column("cache_id", sa.String(length=64), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["cache_id"],
            ["chunks.cache_id"],
            name="fk_placements_cache_id_chunks",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("cache_id", "tier", name="pk_placements"),
    )
    op.create_index("ix_placements_tier", "placements", ["tier"])
    op.create_table(
        "counters",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("value", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_counters"),
    )


def downgrade() -> None:
    op.drop_table("counters")
    op.drop_index("ix_placements_tier", table_name="placements")
    op.drop_table("placements")
    op.drop_index("ix_chunks_state", table_name="chunks")
    op.drop_index("ix_chunks_expires_at", table_name="chunks")
    op.drop_index("ix_chunks_document_id", table_name="chunks")
    op.drop_table("chunks")
    op.drop_table("documents")
    op.drop_table("models")
