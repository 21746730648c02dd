"""The catalog's SQL tables (SQLAlchemy 2 declarative models) and its portable column types.

One row per model, per source document, per chunk (text, token ids, encode settings, size and
checksum of its blob, LRU/LFU bookkeeping, pin, expiry) and per placement (chunk x tier), plus
named counters and the store's identity (one row); `document_chunks` lists each document's
chunks in order (a chunk may serve several documents). Deleting a chunk deletes its
placements and document links (cascades).

`Base.metadata` is what the Alembic migrations (`migrations/`) must produce: a new fact about
chunks is a column here plus a migration (a test compares the two). Only `catalog.py` queries
these tables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from rag_kvcache.storage.records import CatalogError

STATES = ("pending", "stored")


def utc_now() -> datetime:
    """The current time, UTC-aware (what every catalog timestamp is)."""
    return datetime.now(UTC)


def utc(value: datetime) -> datetime:
    """`value` moved to UTC; a naive datetime is a CatalogError (its zone would be a guess)."""
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise CatalogError(
            f"datetime {value!r} must be timezone-aware (e.g. datetime.now(timezone.utc))"
        )
    return value.astimezone(UTC)


# ----------------------------------------------------------------------------- column types


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    SQLite stores no offset, so values are converted to UTC before binding (string order is then
    time order) and read back as UTC-aware; PostgreSQL `timestamptz` values are moved to UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = utc(value)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class TokenIds(TypeDecorator[tuple[int, ...]]):
    """A chunk's token ids as compact JSON text (portable; only ever read whole)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return json.dumps([int(t) for t in value], separators=(",", ":"))

    def process_result_value(self, value: str | None, dialect: Dialect) -> tuple[int, ...] | None:
        return None if value is None else tuple(json.loads(value))


# ----------------------------------------------------------------------------- tables

# Deterministic constraint names, so migrations can refer to (and alter) them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of the catalog tables; its metadata is the migrations' target."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Model(Base):
    """A model whose KV the store holds; chunks refer to it by fingerprint."""

    __tablename__ = "models"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    dtype: Mapped[str] = mapped_column(String(32))
    num_layers: Mapped[int] = mapped_column(Integer)
    num_kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Document(Base):
    """An ingested source; its content hash tells whether re-ingestion is needed."""

    __tablename__ = "documents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(1024), unique=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    ingested_at: Mapped[datetime] = mapped_column(UTCDateTime)
    chunk_count: Mapped[int] = mapped_column(Integer, default=0, server_default=sa.text("0"))


class DocumentChunk(Base):
    """Chunk number `ordinal` of a document (one chunk may serve several documents)."""

    __tablename__ = "document_chunks"

    document_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("documents.id", ondelete="CASCADE"), primary_key=True
    )
    ordinal: Mapped[int] = mapped_column(Integer, primary_key=True)
    cache_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("chunks.cache_id", ondelete="CASCADE"), index=True
    )


class Chunk(Base):
    """One KV-encoded chunk: everything needed to re-encode it, plus usage bookkeeping."""

    __tablename__ = "chunks"
    __table_args__ = (CheckConstraint("state IN ('pending', 'stored')", name="state"),)

    cache_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), ForeignKey("models.fingerprint"))
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[tuple[int, ...]] = mapped_column(TokenIds)
    token_count: Mapped[int] = mapped_column(Integer)
    encode_settings: Mapped[str] = mapped_column(String(1024))
    start: Mapped[int] = mapped_column(Integer)
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=sa.text("0"))
    checksum: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime)
    hit_count: Mapped[int] = mapped_column(Integer, default=0, server_default=sa.text("0"))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    state: Mapped[str] = mapped_column(
        String(16), default="pending", server_default="pending", index=True
    )


class Placement(Base):
    """A copy of a chunk's blob on one tier (disk, redis, cpu, gpu...)."""

    __tablename__ = "placements"

    cache_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("chunks.cache_id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(32), primary_key=True, index=True)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    placed_at: Mapped[datetime] = mapped_column(UTCDateTime)


class StoreIdentity(Base):
    """The one row naming this catalog's store: `store_id` namespaces what the store keeps
    elsewhere (its Redis keys, its folder's marker), so two stores never take each other's."""

    __tablename__ = "store_identity"
    __table_args__ = (CheckConstraint("id = 1", name="one_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    store_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LinkCalibration(Base):
    """A model's link calibration for chunks encoded with given settings (`rag-kvcache
    calibrate`): its safetensors bytes (a few KiB) and their sha256, kept in the catalog so
    every worker on the same catalog links with the same one."""

    __tablename__ = "calibrations"

    fingerprint: Mapped[str] = mapped_column(
        String(64), ForeignKey("models.fingerprint", ondelete="CASCADE"), primary_key=True
    )
    encode_settings: Mapped[str] = mapped_column(String(1024), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    checksum: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LinkAdapter(Base):
    """A model's LoRA link calibration (`rag-kvcache calibrate --kind lora`), keyed by the
    fingerprint of the base model it adapts: its safetensors bytes (a few MiB) and their
    sha256, kept in the catalog so every worker on it can load the same adapted model."""

    __tablename__ = "adapters"

    fingerprint: Mapped[str] = mapped_column(
        String(64), ForeignKey("models.fingerprint", ondelete="CASCADE"), primary_key=True
    )
    data: Mapped[bytes] = mapped_column(LargeBinary)
    checksum: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Counter(Base):
    """A named event counter ('re-encoded', 'checksum-failures', 'hits:<tier>', ...)."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0, server_default=sa.text("0"))
