"""SQL catalog of the tiered KV store: which chunks exist, where their blobs are, usage counters.

One row per model, per source document, per chunk (text, token ids, encode settings, size and
checksum of its blob, LRU/LFU bookkeeping, pin, expiry) and per placement (chunk x tier), plus
named counters. The chunk text and tokens live here, so a lost or corrupt blob can be re-encoded.

SQLite file by default (WAL, busy timeout, foreign keys on every connection), PostgreSQL by URL
(`postgresql+psycopg://...`, optionally inside one schema). The schema is owned by the Alembic
migrations shipped next to this module (`migrations/`) and upgraded to head whenever a Catalog
is opened, serialized across processes (SQLite `BEGIN IMMEDIATE`, PostgreSQL advisory lock).

Writes that may race between processes are single `INSERT ... ON CONFLICT` statements, so every
process agrees on who created a row (`begin_chunk` returns True exactly once per cache ID).
Chunks are written in two steps: `begin_chunk` (state 'pending') before the blob is stored and
`commit_chunk` (state 'stored' + durable placement) after; a writer that dies in between leaves
a pending row that `pending_older_than` finds for garbage collection.

Documents list their chunks in `document_chunks` (a chunk may belong to several documents);
`set_document` and `remove_document` return the chunks no document refers to any more, for the
store to delete. Deleting a chunk deletes its placements and document links (cascades); the
blobs themselves are the store's business.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Connection,
    DateTime,
    Dialect,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    create_engine,
    delete,
    event,
    false,
    func,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from rag_kvcache.errors import RagKVCacheError, UnknownCacheIdError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
STATES = ("pending", "stored")
_SQLITE_BUSY_MS = 30_000
# One advisory-lock key for "someone is changing the catalog schema" on a PostgreSQL server.
_PG_LOCK_KEY = zlib.crc32(b"rag_kvcache.storage.catalog")
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_CHECKSUM = re.compile(r"xxh3-128:[0-9a-f]{32}|[0-9a-f]{64}")
_BATCH = 5000  # ids per IN (...) list; far below SQLite's and PostgreSQL's parameter limits


class CatalogError(RagKVCacheError):
    """The catalog was opened or called with a value it cannot use."""


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
        value = _utc(value)
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


class Counter(Base):
    """A named event counter ('re-encoded', 'checksum-failures', 'hits:<tier>', ...)."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0, server_default=sa.text("0"))


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ChunkRow:
    """One chunk as stored (datetimes UTC-aware; checksum is None while pending)."""

    cache_id: str
    fingerprint: str
    text: str
    token_ids: tuple[int, ...]
    token_count: int
    encode_settings: str
    start: int
    nbytes: int
    checksum: str | None
    created_at: datetime
    last_used_at: datetime
    hit_count: int
    pinned: bool
    expires_at: datetime | None
    state: str


@dataclass(frozen=True)
class DocumentRow:
    """One ingested source document."""

    id: int
    source: str
    content_hash: str
    ingested_at: datetime
    chunk_count: int  # chunks it had when ingested (links vanish when a chunk is removed)


@dataclass(frozen=True)
class CatalogStats:
    """Counts for `rag-kvcache stats`: rows, bytes held per tier, chunks per state, counters."""

    models: int
    documents: int
    chunks: int
    bytes_per_tier: dict[str, int]
    chunks_per_state: dict[str, int]
    counters: dict[str, int]


# ----------------------------------------------------------------------------- engine, migrations


def create_catalog_engine(url: str | URL, schema: str | None = None) -> Engine:
    """An engine with the per-connection settings the catalog relies on.

    SQLite: WAL (readers never block the writer), a 30 s busy timeout (writers queue instead of
    failing), foreign keys (cascades), synchronous=NORMAL (durable at checkpoints, fast), and
    SQLAlchemy-emitted BEGIN so that DDL is transactional and writers can ask for
    `BEGIN IMMEDIATE` (execution option `sqlite_begin`). PostgreSQL: `search_path` = `schema`.
    """
    url = make_url(url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if schema is not None:
            raise CatalogError(f"schema={schema!r} is only for PostgreSQL; SQLite has none")
        if url.database in (None, "", ":memory:"):
            raise CatalogError(
                f"SQLite catalog URL {url!s} names no file; give a file path "
                "(an in-memory catalog would vanish with its connection)"
            )
        engine = create_engine(url, connect_args={"timeout": _SQLITE_BUSY_MS / 1000})
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if backend == "postgresql":
        engine = create_engine(url, pool_pre_ping=True)
        if schema is not None:
            _check_schema_name(schema)
            event.listen(engine, "connect", functools.partial(_pg_set_search_path, schema))
        return engine
    raise CatalogError(
        f"catalog URL backend {backend!r} is not supported; use sqlite:///path or "
        "postgresql+psycopg://user@host/db"
    )


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # no implicit BEGIN; _sqlite_on_begin emits it
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_MS}")  # first: WAL switch may wait
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN"))


def _pg_set_search_path(schema: str, dbapi_connection: Any, _record: Any) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # SET SESSION outside any transaction, so it sticks
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f'SET SESSION search_path TO "{schema}"')
    finally:
        cursor.close()
        dbapi_connection.autocommit = autocommit


def _check_schema_name(schema: str) -> None:
    if not _SCHEMA_NAME.fullmatch(schema):
        raise CatalogError(
            f"schema name {schema!r} is not allowed; use letters, digits and '_' "
            "(not starting with a digit, at most 63 characters)"
        )


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic config for the shipped migrations; `connection` is the one env.py migrates."""
    config = Config()
    # ConfigParser interpolates '%': escape it in the folder path.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """Revision id of the newest shipped migration."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, f"no migrations found in {MIGRATIONS_DIR}"
    return head


def _ensure_pg_schema(url: URL, schema: str) -> None:
    """Create `schema` if missing, before the catalog engine first connects.

    The engine learns its default schema on first connect, so the schema must exist by then.
    A session advisory lock serializes concurrent creators.
    """
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if conn.scalar(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}):
                return
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.commit()
    finally:
        engine.dispose()


# ----------------------------------------------------------------------------- the catalog


class Catalog:
    """The SQL catalog of the tiered KV store (see module docstring).

    `url` is an SQLAlchemy URL; without one, an SQLite file at `path`. `schema` (PostgreSQL only)
    keeps the catalog in its own schema, created if missing. Each method is one transaction.
    Safe to use from several threads, and from several processes on the same database.
    """

    def __init__(
        self, url: str | None = None, *, path: Path | None = None, schema: str | None = None
    ) -> None:
        if url is None:
            if path is None:
                raise CatalogError("Catalog needs a database URL or an SQLite file path")
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            sa_url = URL.create("sqlite+pysqlite", database=str(path))
        elif path is not None:
            raise CatalogError(f"give either url or path, not both (got {url!r} and {path!s})")
        else:
            sa_url = make_url(url)
        if schema is not None and sa_url.get_backend_name() == "postgresql":
            _check_schema_name(schema)
            _ensure_pg_schema(sa_url, schema)
        self._engine = create_catalog_engine(sa_url, schema)
        self._sqlite = self._engine.dialect.name == "sqlite"
        self._schema = schema
        # SQLite: writers take the write lock up front (waiting on busy_timeout) instead of
        # upgrading a read lock later, which fails at once with "database is locked".
        self._writer = (
            self._engine.execution_options(sqlite_begin="BEGIN IMMEDIATE")
            if self._sqlite
            else self._engine
        )
        try:
            self._upgrade()
        except BaseException:
            self._engine.dispose()
            raise

    # -- lifecycle

    @property
    def url(self) -> str:
        """The database URL (password hidden)."""
        return self._engine.url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._engine.dialect.name

    @property
    def engine(self) -> Engine:
        """The underlying engine (for tooling and tests; the catalog API is the contract)."""
        return self._engine

    def close(self) -> None:
        """Close pooled connections (the catalog must not be used afterwards)."""
        self._engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        schema = f", schema={self._schema!r}" if self._schema else ""
        return f"Catalog({self.url!r}{schema})"

    def _upgrade(self) -> None:
        """Bring the schema to the newest migration; a no-op (one read) when it is there.

        Serialized across processes: SQLite holds the write lock (BEGIN IMMEDIATE) and
        PostgreSQL an advisory lock for the whole upgrade transaction, and the version is read
        again under the lock, so a second opener finds the work done.
        """
        head = head_revision()
        with self._engine.connect() as conn:
            if MigrationContext.configure(conn).get_current_revision() == head:
                return
        with self._writer.connect() as conn, conn.begin():
            if not self._sqlite:
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            command.upgrade(alembic_config(conn), "head")

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._writer.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._engine.connect() as conn:
            yield conn

    def _insert(self, table: Any) -> Any:
        """The dialect's INSERT, which has `on_conflict_do_nothing/update` on both backends."""
        return sqlite.insert(table) if self._sqlite else postgresql.insert(table)

    # -- models

    def register_model(
        self,
        fingerprint: str,
        name: str,
        dtype: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """Record a model once (later calls, from any process, are no-ops)."""
        _check_key("fingerprint", fingerprint)
        for field, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise CatalogError(f"{field} must be a positive int, got {value!r}")
        stmt = (
            self._insert(Model)
            .values(
                fingerprint=fingerprint,
                name=name,
                dtype=dtype,
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                created_at=_now(),
            )
            .on_conflict_do_nothing(index_elements=["fingerprint"])
        )
        with self._write() as conn:
            conn.execute(stmt)

    # -- documents

    def upsert_document(self, source: str, content_hash: str) -> DocumentRow:
        """Insert a document, or update its content hash and ingestion time; returns the row."""
        with self._write() as conn:
            return self._upsert_document(conn, source, content_hash)

    def document(self, source: str) -> DocumentRow | None:
        """The document ingested from `source`, if any."""
        with self._read() as conn:
            row = conn.execute(select(Document.__table__).where(Document.source == source)).first()
        return None if row is None else DocumentRow(**row._mapping)

    def documents(self) -> list[DocumentRow]:
        """All documents, oldest id first."""
        with self._read() as conn:
            rows = conn.execute(select(Document.__table__).order_by(Document.id))
            return [DocumentRow(**row._mapping) for row in rows]

    def set_document(
        self, source: str, content_hash: str, cache_ids: Sequence[str]
    ) -> tuple[DocumentRow, list[str]]:
        """Record that `source` (with this content hash) now consists of `cache_ids`, in order.

        One transaction: the hash, chunk count and chunk list change together, so a document
        whose ingestion was interrupted keeps its old hash and is re-ingested next time. Returns
        the row and the chunks that were the document's and now belong to no document (for the
        store to delete). Every chunk must already be recorded.
        """
        new = set(cache_ids)
        try:
            with self._write() as conn:
                row = self._upsert_document(conn, source, content_hash, len(cache_ids))
                old = self._unlink(conn, row.id)
                if cache_ids:
                    conn.execute(
                        sa.insert(DocumentChunk),
                        [
                            {"document_id": row.id, "ordinal": i, "cache_id": cid}
                            for i, cid in enumerate(cache_ids)
                        ],
                    )
                return row, self._orphans(conn, [c for c in old if c not in new])
        except IntegrityError as e:
            raise CatalogError(
                f"cannot record document {source!r}: a chunk it lists is not in the catalog "
                f"(begin_chunk first) ({e.orig})"
            ) from e

    def remove_document(self, source: str) -> list[str]:
        """Delete a document; returns its chunks that now belong to no document.

        The document row is locked first (PostgreSQL), so no chunk can be linked in between.
        """
        with self._write() as conn:
            doc_id = conn.scalar(
                select(Document.id).where(Document.source == source).with_for_update()
            )
            if doc_id is None:
                return []
            old = self._unlink(conn, doc_id)
            conn.execute(delete(Document).where(Document.id == doc_id))
            return self._orphans(conn, old)

    def document_chunks(self, source: str) -> list[str]:
        """The cache IDs of a document's chunks, in order ([] if unknown)."""
        stmt = (
            select(DocumentChunk.cache_id)
            .join(Document, Document.id == DocumentChunk.document_id)
            .where(Document.source == source)
            .order_by(DocumentChunk.ordinal)
        )
        with self._read() as conn:
            return list(conn.scalars(stmt))

    def documented_ids(self) -> set[str]:
        """Every chunk that belongs to at least one document (what retrieval may return)."""
        with self._read() as conn:
            return set(conn.scalars(select(DocumentChunk.cache_id).distinct()))

    def sources(self, cache_ids: Iterable[str]) -> dict[str, str]:
        """For each chunk that belongs to a document, the source of the first such document."""
        wanted = list(dict.fromkeys(cache_ids))
        found: dict[str, str] = {}
        with self._read() as conn:
            for batch in _batches(wanted):
                rows = conn.execute(
                    select(DocumentChunk.cache_id, Document.source)
                    .join(Document, Document.id == DocumentChunk.document_id)
                    .where(DocumentChunk.cache_id.in_(batch))
                    .order_by(Document.id)
                )
                for cache_id, source in rows:
                    found.setdefault(cache_id, source)
        return found

    def _upsert_document(
        self, conn: Connection, source: str, content_hash: str, chunk_count: int | None = None
    ) -> DocumentRow:
        if not source or len(source) > 1024:
            raise CatalogError(f"document source must be 1..1024 characters, got {source!r}")
        _check_key("content_hash", content_hash)
        values: dict[str, Any] = {"content_hash": content_hash, "ingested_at": _now()}
        if chunk_count is not None:
            values["chunk_count"] = chunk_count
        stmt = self._insert(Document).values(source=source, **values)
        stmt = stmt.on_conflict_do_update(
            index_elements=["source"], set_={k: stmt.excluded[k] for k in values}
        ).returning(*Document.__table__.c)
        return DocumentRow(**conn.execute(stmt).one()._mapping)

    @staticmethod
    def _unlink(conn: Connection, document_id: int) -> list[str]:
        """Drop a document's chunk list; returns it."""
        old = list(
            conn.scalars(
                select(DocumentChunk.cache_id)
                .where(DocumentChunk.document_id == document_id)
                .order_by(DocumentChunk.ordinal)
            )
        )
        conn.execute(delete(DocumentChunk).where(DocumentChunk.document_id == document_id))
        return old

    @staticmethod
    def _orphans(conn: Connection, cache_ids: list[str]) -> list[str]:
        """Those of `cache_ids` that no document lists."""
        wanted = list(dict.fromkeys(cache_ids))
        linked: set[str] = set()
        for batch in _batches(wanted):
            linked.update(
                conn.scalars(
                    select(DocumentChunk.cache_id).where(DocumentChunk.cache_id.in_(batch))
                )
            )
        return [c for c in wanted if c not in linked]

    # -- chunks

    def begin_chunk(
        self,
        cache_id: str,
        *,
        fingerprint: str,
        text: str,
        token_ids: Sequence[int],
        encode_settings: str,
        start: int = 0,
        pinned: bool = False,
        expires_at: datetime | None = None,
    ) -> bool:
        """Claim a chunk before its blob is written: True if this call created its row.

        Exactly one caller, across threads and processes, gets True for a cache ID (a single
        INSERT ... ON CONFLICT DO NOTHING); the others should not encode it again.
        The model must be registered.
        """
        _check_key("cache_id", cache_id)
        _check_key("fingerprint", fingerprint)
        if start < 0:
            raise CatalogError(f"start (sink-token count) must be >= 0, got {start}")
        if len(encode_settings) > 1024:
            raise CatalogError(f"encode_settings is {len(encode_settings)} characters; max 1024")
        now = _now()
        tokens = tuple(int(t) for t in token_ids)
        stmt = (
            self._insert(Chunk)
            .values(
                cache_id=cache_id,
                fingerprint=fingerprint,
                text=text,
                token_ids=tokens,
                token_count=len(tokens),
                encode_settings=encode_settings,
                start=start,
                nbytes=0,
                checksum=None,
                created_at=now,
                last_used_at=now,
                hit_count=0,
                pinned=pinned,
                expires_at=None if expires_at is None else _utc(expires_at),
                state="pending",
            )
            .on_conflict_do_nothing(index_elements=["cache_id"])
            .returning(Chunk.cache_id)  # a row back iff inserted (INSERT rowcount is unreliable)
        )
        try:
            with self._write() as conn:
                return conn.execute(stmt).first() is not None
        except IntegrityError as e:
            raise CatalogError(
                f"cannot record chunk {cache_id}: model fingerprint {fingerprint!r} is not "
                f"registered (call register_model first) ({e.orig})"
            ) from e

    def commit_chunk(self, cache_id: str, nbytes: int, checksum: str, tier: str) -> None:
        """Mark a chunk stored once its blob is on the durable `tier` (one transaction)."""
        if not _CHECKSUM.fullmatch(checksum):
            raise CatalogError(
                "checksum must be 'xxh3-128:' and 32 lowercase hex digits, or 64 (sha256), "
                f"got {checksum!r}"
            )
        if nbytes < 0:
            raise CatalogError(f"nbytes must be >= 0, got {nbytes}")
        _check_key("tier", tier, 32)
        with self._write() as conn:
            done = conn.execute(
                update(Chunk)
                .where(Chunk.cache_id == cache_id)
                .values(state="stored", nbytes=nbytes, checksum=checksum)
            )
            if done.rowcount == 0:
                raise UnknownCacheIdError([cache_id])
            conn.execute(self._placement_upsert(cache_id, tier, nbytes))

    def chunk(self, cache_id: str) -> ChunkRow | None:
        """One chunk, or None if unknown."""
        return self.chunks([cache_id]).get(cache_id)

    def chunks(self, cache_ids: Iterable[str]) -> dict[str, ChunkRow]:
        """The known chunks among `cache_ids`, by id (one query per 5000 ids)."""
        wanted = list(dict.fromkeys(cache_ids))
        found: dict[str, ChunkRow] = {}
        with self._read() as conn:
            for batch in _batches(wanted):
                rows = conn.execute(select(Chunk.__table__).where(Chunk.cache_id.in_(batch)))
                found.update((row.cache_id, ChunkRow(**row._mapping)) for row in rows)
        return found

    def all_chunks(self, state: str | None = None) -> list[ChunkRow]:
        """Every chunk (optionally only those in `state`), by creation time."""
        stmt = select(Chunk.__table__).order_by(Chunk.created_at, Chunk.cache_id)
        if state is not None:
            _check_state(state)
            stmt = stmt.where(Chunk.state == state)
        with self._read() as conn:
            return [ChunkRow(**row._mapping) for row in conn.execute(stmt)]

    def touch(self, cache_ids: Iterable[str]) -> None:
        """Record a use of each chunk (LRU time and LFU count) in one UPDATE."""
        ids = list(dict.fromkeys(cache_ids))
        if not ids:
            return
        now = _now()
        with self._write() as conn:
            for batch in _batches(ids):
                conn.execute(
                    update(Chunk)
                    .where(Chunk.cache_id.in_(batch))
                    .values(last_used_at=now, hit_count=Chunk.hit_count + 1)
                )

    def set_pinned(self, cache_id: str, pinned: bool) -> None:
        """Pin (never evict from hot tiers) or unpin a chunk."""
        self._update_one(cache_id, pinned=bool(pinned))

    def set_expiry(self, cache_id: str, expires_at: datetime | None) -> None:
        """Set (aware datetime) or clear (None) when a chunk expires."""
        self._update_one(cache_id, expires_at=None if expires_at is None else _utc(expires_at))

    def expired(self, now: datetime | None = None) -> list[str]:
        """Chunks whose expiry is at or before `now` (default: the current time), pinned or not."""
        cutoff = _now() if now is None else _utc(now)
        stmt = (
            select(Chunk.cache_id)
            .where(Chunk.expires_at.is_not(None), Chunk.expires_at <= cutoff)
            .order_by(Chunk.expires_at, Chunk.cache_id)
        )
        with self._read() as conn:
            return list(conn.scalars(stmt))

    def pending_older_than(self, seconds: float) -> list[str]:
        """Chunks begun at least `seconds` ago and never committed: their writer died (gc them)."""
        if seconds < 0:
            raise CatalogError(f"seconds must be >= 0, got {seconds}")
        cutoff = _now() - timedelta(seconds=seconds)
        stmt = (
            select(Chunk.cache_id)
            .where(Chunk.state == "pending", Chunk.created_at <= cutoff)
            .order_by(Chunk.created_at, Chunk.cache_id)
        )
        with self._read() as conn:
            return list(conn.scalars(stmt))

    def remove_chunk(self, cache_id: str) -> bool:
        """Delete a chunk and (by cascade) its placements; False if it was unknown."""
        with self._write() as conn:
            return conn.execute(delete(Chunk).where(Chunk.cache_id == cache_id)).rowcount > 0

    def _update_one(self, cache_id: str, **values: Any) -> None:
        with self._write() as conn:
            done = conn.execute(update(Chunk).where(Chunk.cache_id == cache_id).values(**values))
            if done.rowcount == 0:
                raise UnknownCacheIdError([cache_id])

    # -- placements

    def _placement_upsert(self, cache_id: str, tier: str, nbytes: int) -> Any:
        stmt = self._insert(Placement).values(
            cache_id=cache_id, tier=tier, nbytes=nbytes, placed_at=_now()
        )
        return stmt.on_conflict_do_update(
            index_elements=["cache_id", "tier"],
            set_={"nbytes": stmt.excluded.nbytes, "placed_at": stmt.excluded.placed_at},
        )

    def add_placement(self, cache_id: str, tier: str, nbytes: int) -> None:
        """Record (or refresh) a copy of a chunk's blob on `tier`."""
        _check_key("tier", tier, 32)
        if nbytes < 0:
            raise CatalogError(f"nbytes must be >= 0, got {nbytes}")
        try:
            with self._write() as conn:
                conn.execute(self._placement_upsert(cache_id, tier, nbytes))
        except IntegrityError as e:  # the chunk row is missing
            raise UnknownCacheIdError([cache_id]) from e

    def remove_placement(self, cache_id: str, tier: str) -> bool:
        """Forget the copy on `tier`; False if there was none."""
        with self._write() as conn:
            done = conn.execute(
                delete(Placement).where(Placement.cache_id == cache_id, Placement.tier == tier)
            )
            return done.rowcount > 0

    def placements(self, cache_id: str) -> set[str]:
        """The tiers holding a copy of the chunk."""
        with self._read() as conn:
            return set(conn.scalars(select(Placement.tier).where(Placement.cache_id == cache_id)))

    def placed_on(self, tier: str) -> list[str]:
        """The chunks with a copy on `tier`, oldest placement first."""
        stmt = (
            select(Placement.cache_id)
            .where(Placement.tier == tier)
            .order_by(Placement.placed_at, Placement.cache_id)
        )
        with self._read() as conn:
            return list(conn.scalars(stmt))

    # -- counters and stats

    def count(self, name: str, by: int = 1) -> None:
        """Add `by` to the counter `name` atomically (one upsert; created at 0)."""
        _check_key("counter name", name, 255)
        if not isinstance(by, int):
            raise CatalogError(f"counter increment must be an int, got {by!r}")
        stmt = self._insert(Counter).values(name=name, value=by)
        stmt = stmt.on_conflict_do_update(
            index_elements=["name"], set_={"value": Counter.value + stmt.excluded.value}
        )
        with self._write() as conn:
            conn.execute(stmt)

    def counters(self) -> dict[str, int]:
        """All counters by name."""
        with self._read() as conn:
            return _counters(conn)

    def stats(self) -> CatalogStats:
        """Row counts, bytes per tier, chunks per state and counters, read in one transaction."""
        with self._read() as conn:
            n_models, n_docs, n_chunks = conn.execute(
                select(
                    select(func.count()).select_from(Model).scalar_subquery(),
                    select(func.count()).select_from(Document).scalar_subquery(),
                    select(func.count()).select_from(Chunk).scalar_subquery(),
                )
            ).one()
            per_tier = conn.execute(
                select(Placement.tier, func.sum(Placement.nbytes)).group_by(Placement.tier)
            )
            per_state = conn.execute(select(Chunk.state, func.count()).group_by(Chunk.state))
            return CatalogStats(
                models=n_models,
                documents=n_docs,
                chunks=n_chunks,
                bytes_per_tier={tier: int(total) for tier, total in per_tier},
                chunks_per_state={state: int(n) for state, n in per_state},
                counters=_counters(conn),
            )


# ----------------------------------------------------------------------------- helpers


def _now() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise CatalogError(
            f"datetime {value!r} must be timezone-aware (e.g. datetime.now(timezone.utc))"
        )
    return value.astimezone(UTC)


def _check_key(what: str, value: str, max_len: int = 64) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise CatalogError(f"{what} must be a string of 1..{max_len} characters, got {value!r}")


def _check_state(state: str) -> None:
    if state not in STATES:
        raise CatalogError(f"chunk state {state!r} is not one of {STATES}")


def _batches(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), _BATCH):
        yield ids[i : i + _BATCH]


def _counters(conn: Connection) -> dict[str, int]:
    rows = conn.execute(select(Counter.name, Counter.value).order_by(Counter.name))
    return {name: int(value) for name, value in rows}
