"""Documents list their chunks in a join table, so a chunk shared by two documents survives
the removal of either; documents record how many chunks they had when ingested.

Before: chunks.document_id (ON DELETE CASCADE) + chunks.ordinal, one document per chunk, so a
chunk that two documents share was deleted with the first. The old columns are emptied; on
PostgreSQL they are dropped. SQLite keeps them (always NULL, unmapped): dropping a column used
by a foreign key means rebuilding the table, whose DROP would cascade into placements.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "document_chunks",
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("cache_id", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["document_id"],
            ["documents.id"],
            name="fk_document_chunks_document_id_documents",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["cache_id"],
            ["chunks.cache_id"],
            name="fk_document_chunks_cache_id_chunks",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("document_id", "ordinal", name="pk_document_chunks"),
    )
    op.create_index("ix_document_chunks_cache_id", "document_chunks", ["cache_id"])
    op.add_column(
        "documents",
        sa.Column("chunk_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.execute(
        "INSERT INTO document_chunks (document_id, ordinal, cache_id) "
        "SELECT document_id, COALESCE(ordinal, 0), cache_id FROM chunks "
        "WHERE document_id IS NOT NULL"
    )
    op.execute(
        "UPDATE documents SET chunk_count = "
        "(SELECT COUNT(*) FROM document_chunks WHERE document_id = documents.id)"
    )
    op.drop_index("ix_chunks_document_id", table_name="chunks")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("UPDATE chunks SET document_id = NULL, ordinal = NULL")
    else:
        op.drop_constraint("fk_chunks_document_id_documents", "chunks", type_="foreignkey")
        op.drop_column("chunks", "document_id")
        op.drop_column("chunks", "ordinal")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.add_column("chunks", sa.Column("document_id", sa.Integer(), nullable=True))
        op.add_column("chunks", sa.Column("ordinal", sa.Integer(), nullable=True))
        op.create_foreign_key(
            "fk_chunks_document_id_documents",
            "chunks",
            "documents",
            ["document_id"],
            ["id"],
            ondelete="CASCADE",
        )
    op.execute(
        "UPDATE chunks SET document_id = (SELECT MIN(document_id) FROM document_chunks d "
        "WHERE d.cache_id = chunks.cache_id), ordinal = (SELECT MIN(d.ordinal) FROM "
        "document_chunks d WHERE d.cache_id = chunks.cache_id)"
    )
    op.create_index("ix_chunks_document_id", "chunks", ["document_id"])
    op.drop_column("documents", "chunk_count")
    op.drop_index("ix_document_chunks_cache_id", table_name="document_chunks")
    op.drop_table("document_chunks")
