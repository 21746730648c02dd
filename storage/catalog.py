"""The SQL catalog of the tiered KV store: `Catalog` and its operations, one transaction each.

It records which models, documents and chunks exist, where each chunk's blob is (placements),
usage counters and LRU/LFU bookkeeping; the chunk text and tokens live here, so a lost or
corrupt blob can be re-encoded. The tables are in `tables.py`; opening the database (engine
settings, migrations applied on open, transactions) is `CatalogDatabase` in `database.py`,
which `Catalog` extends; the records it returns are in `records.py`.

Writes that may race between processes are single `INSERT ... ON CONFLICT` statements, so every
process agrees on who created a row (`begin_chunk` returns True exactly once per cache ID).
Chunks are written in two steps: `begin_chunk` (state 'pending') before the blob is stored and
`commit_chunk` (state 'stored' + durable placement) after; a writer that dies in between leaves
a pending row that `pending_older_than` finds for garbage collection.

`set_document` and `remove_document` delete, in their transaction, the rows of chunks no document
refers to any more, and return them: the blobs themselves are the store's business.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, delete, func, select, update
from sqlalchemy.exc import IntegrityError

from rag_kvcache.errors import UnknownCacheIdError, shown_name
from rag_kvcache.kv import DOCUMENTS_VERSION
from rag_kvcache.storage.database import CatalogDatabase
from rag_kvcache.storage.layout import checked_name
from rag_kvcache.storage.records import (
    CatalogError,
    CatalogStats,
    ChunkRow,
    ChunksGoneError,
    DocumentRow,
    ModelFile,
)
from rag_kvcache.storage.tables import (
    STATES,
    Chunk,
    Counter,
    Document,
    DocumentChunk,
    LinkAdapter,
    LinkCalibration,
    Model,
    Placement,
    StoreIdentity,
    utc,
    utc_now,
)

_CHECKSUM = re.compile(r"xxh3-128:[0-9a-f]{32}|[0-9a-f]{64}")
_BATCH = 5000  # ids per IN (...) list; far below SQLite's and PostgreSQL's parameter limits


class Catalog(CatalogDatabase):
    """The SQL catalog of the tiered KV store (see module docstring).

    Opened as `Catalog(url)`, `Catalog(path=...)` or `Catalog(url, schema=...)` (see
    CatalogDatabase). Each method is one transaction. Safe to use from several threads, and
    from several processes on the same database.
    """

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
                created_at=utc_now(),
            )
            .on_conflict_do_nothing(index_elements=["fingerprint"])
        )
        with self._write() as conn:
            conn.execute(stmt)

    # -- the store

    @functools.cached_property
    def store_id(self) -> str:
        """The random ID of this catalog's store (32 hex digits, made with the catalog)."""
        with self._read() as conn:
            store_id = conn.scalar(select(StoreIdentity.store_id))
        if store_id is None:
            raise CatalogError(f"catalog {self.url} has no store identity row; it is damaged")
        return str(store_id)

    # -- link calibrations

    def put_calibration(self, fingerprint: str, encode_settings: str, data: bytes) -> str:
        """Keep `data` as the model's link calibration for chunks encoded with
        `encode_settings` (replacing any before it); returns its sha256. The model must be
        registered."""
        key = dict(fingerprint=fingerprint, encode_settings=encode_settings)
        return self._put_model_file(LinkCalibration, key, data)

    def calibration(self, fingerprint: str, encode_settings: str) -> tuple[bytes, str] | None:
        """(bytes, sha256 recorded when kept) of the model's calibration, or None."""
        key = dict(fingerprint=fingerprint, encode_settings=encode_settings)
        return self._model_file(LinkCalibration, key)

    def put_adapter(self, fingerprint: str, data: bytes) -> str:
        """Keep `data` as the LoRA link calibration of the base model `fingerprint`
        (replacing any before it); returns its sha256. The model must be registered."""
        return self._put_model_file(LinkAdapter, dict(fingerprint=fingerprint), data)

    def _put_model_file(
        self, table: type[LinkCalibration] | type[LinkAdapter], key: dict[str, str], data: bytes
    ) -> str:
        """Upsert a model's file (`data` and its sha256) into `table` under `key` (its primary
        key, a registered model's fingerprint first); returns the sha256."""
        _check_key("fingerprint", key["fingerprint"])
        checksum = hashlib.sha256(data).hexdigest()
        values = dict(data=data, checksum=checksum, created_at=utc_now())
        stmt = (
            self._insert(table)
            .values(**key, **values)
            .on_conflict_do_update(index_elements=list(key), set_=values)
        )
        try:
            with self._write() as conn:
                conn.execute(stmt)
        except IntegrityError:
            raise CatalogError(
                f"model {key['fingerprint']} is not registered in this catalog; open an engine "
                "with it"
            ) from None
        return checksum

    def adapter(self, fingerprint: str) -> tuple[bytes, str] | None:
        """(bytes, sha256 recorded when kept) of the base model's LoRA adapter, or None."""
        return self._model_file(LinkAdapter, dict(fingerprint=fingerprint))

    def model_files(self) -> list[ModelFile]:
        """Every link calibration and LoRA adapter kept here, each checked against its sha256."""
        found = []
        with self._read() as conn:
            for kind, table in (("calibration", LinkCalibration), ("adapter", LinkAdapter)):
                settings = table.encode_settings if table is LinkCalibration else sa.null()
                stmt = select(table.fingerprint, settings, table.data, table.checksum)
                for fingerprint, encode, data, recorded in conn.execute(stmt):
                    intact = hashlib.sha256(bytes(data)).hexdigest() == recorded
                    found.append(ModelFile(kind, fingerprint, encode, len(data), recorded, intact))
        return found

    def drop_model_file(self, file: ModelFile) -> None:
        """Delete a calibration or adapter row (a damaged one: verify --repair), unless it was
        kept anew since `file` was read (another checksum: a new calibration installed)."""
        table = LinkCalibration if file.kind == "calibration" else LinkAdapter
        same = (table.fingerprint == file.fingerprint) & (table.checksum == file.checksum)
        if table is LinkCalibration:
            same &= LinkCalibration.encode_settings == file.encode_settings
        with self._write() as conn:
            conn.execute(delete(table).where(same))

    def _model_file(
        self, table: type[LinkCalibration] | type[LinkAdapter], key: dict[str, str]
    ) -> tuple[bytes, str] | None:
        """(bytes, sha256) of the row of `table` under `key` (its primary key), or None."""
        with self._read() as conn:
            row = conn.execute(select(table.data, table.checksum).filter_by(**key)).first()
        return None if row is None else (bytes(row[0]), str(row[1]))

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
        whose ingestion was interrupted keeps its old hash and is re-ingested next time; and
        the rows of chunks that were the document's and now belong to no document are deleted
        in it, so a writer killed right after leaks no chunk (only blobs, which gc finds as
        orphans). Returns the row and those chunks (for the store to delete their blobs and hot
        copies). Every chunk must already be recorded.
        """
        new = set(cache_ids)
        try:
            with self._write() as conn:
                row = self._upsert_document(conn, source, content_hash, len(cache_ids))
                old, present = self._unlink(conn, row.id, new)
                if gone := sorted(new - present):  # (locked: none can go before the insert)
                    raise ChunksGoneError(
                        f"cannot record document {source!r}: {len(gone)} of its chunks are "
                        "not in the catalog (another process removed them meanwhile, or they "
                        f"were never begun), e.g. {shown_name(gone[0])}",
                        gone,
                    )
                if cache_ids:
                    conn.execute(
                        sa.insert(DocumentChunk),
                        [
                            {"document_id": row.id, "ordinal": i, "cache_id": cid}
                            for i, cid in enumerate(cache_ids)
                        ],
                    )
                return row, self._drop_orphans(conn, [c for c in old if c not in new])
        except IntegrityError as e:
            raise CatalogError(f"cannot record document {source!r}: {e.orig}") from e

    def remove_document(self, source: str) -> list[str]:
        """Delete a document and, in the same transaction, the rows of its chunks that now
        belong to no document; returns those chunks (for the store to delete their blobs).

        The document row is locked first (PostgreSQL), so no chunk can be linked in between.
        """
        with self._write() as conn:
            doc_id = conn.scalar(
                select(Document.id).where(Document.source == source).with_for_update()
            )
            if doc_id is None:
                return []
            old, _ = self._unlink(conn, doc_id)
            conn.execute(delete(Document).where(Document.id == doc_id))
            return self._drop_orphans(conn, old)

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

    def document_models(self, source: str) -> set[str]:
        """The fingerprints of the models that encoded a document's chunks (reading nothing
        else of their rows)."""
        stmt = (
            select(Chunk.fingerprint)
            .join(DocumentChunk, DocumentChunk.cache_id == Chunk.cache_id)
            .join(Document, Document.id == DocumentChunk.document_id)
            .where(Document.source == source)
            .distinct()
        )
        with self._read() as conn:
            return set(conn.scalars(stmt))

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
        checked_name("document source", source)
        _check_key("content_hash", content_hash)
        values: dict[str, Any] = {"content_hash": content_hash, "ingested_at": utc_now()}
        if chunk_count is not None:
            values["chunk_count"] = chunk_count
        stmt = self._insert(Document).values(source=source, **values)
        stmt = stmt.on_conflict_do_update(
            index_elements=["source"], set_={k: stmt.excluded[k] for k in values}
        ).returning(*Document.__table__.c)
        return DocumentRow(**conn.execute(stmt).one()._mapping)

    @staticmethod
    def _unlink(
        conn: Connection, document_id: int, listing: Iterable[str] = ()
    ) -> tuple[list[str], set[str]]:
        """Drop a (locked) document's chunk list; returns it, and which of it and of the
        chunks about to be `listing` are in the catalog. Their rows are locked before the
        list is dropped: chunk rows, then listings, as a chunk's delete (its cascade) goes."""
        old = list(
            conn.scalars(
                select(DocumentChunk.cache_id)
                .where(DocumentChunk.document_id == document_id)
                .order_by(DocumentChunk.ordinal)
            )
        )
        present = Catalog._lock_chunks(conn, set(listing).union(old))  # (see _lock_chunks)
        conn.execute(delete(DocumentChunk).where(DocumentChunk.document_id == document_id))
        return old, present

    @staticmethod
    def _lock_chunks(conn: Connection, cache_ids: Iterable[str]) -> set[str]:
        """Lock these chunks' rows until the transaction ends (PostgreSQL; SQLite has one
        writer at a time), in one order everywhere (no deadlock). A transaction listing a
        chunk and one dropping it as no document's then go one after the other: dropped
        first, the listing fails (ChunksGoneError: cached again); listed first, the drop
        sees the listing. Otherwise the drop, not seeing the other's listing yet, deleted
        the chunk once it committed, and the cascade silently took that listing too.
        Returns those of `cache_ids` that are in the catalog."""
        present: set[str] = set()
        for batch in _batches(sorted(set(cache_ids))):
            stmt = select(Chunk.cache_id).where(Chunk.cache_id.in_(batch))
            present.update(conn.scalars(stmt.order_by(Chunk.cache_id).with_for_update()))
        return present

    @classmethod
    def _drop_orphans(cls, conn: Connection, cache_ids: list[str]) -> list[str]:
        """Delete the rows of those of `cache_ids` that no document lists; returns them.
        Their rows are locked already (`_unlink`, which both callers ran first)."""
        orphans = cls._orphans(conn, cache_ids)
        for batch in _batches(orphans):
            conn.execute(delete(Chunk).where(Chunk.cache_id.in_(batch)))
        return orphans

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
        now = utc_now()
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
                expires_at=None if expires_at is None else utc(expires_at),
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

    def chunk_ids(self, state: str | None = None) -> set[str]:
        """The IDs of every chunk (optionally only those in `state`), reading nothing else, so
        a row with a damaged value does not stop gc or verify."""
        stmt = select(Chunk.cache_id)
        if state is not None:
            _check_state(state)
            stmt = stmt.where(Chunk.state == state)
        with self._read() as conn:
            return set(conn.scalars(stmt))

    def touch(self, cache_ids: Iterable[str]) -> None:
        """Record a use of each chunk (LRU time and LFU count) in one UPDATE. The rows are
        locked first in ID order: two requests touching overlapping chunks would otherwise
        lock them in whatever order each UPDATE meets them, and PostgreSQL would find them
        deadlocked (SQLite has one writer at a time and no row locks)."""
        ids = sorted(set(cache_ids))
        if not ids:
            return
        now = utc_now()
        with self._write() as conn:
            for batch in _batches(ids):
                if not self._sqlite:
                    rows = select(Chunk.cache_id).where(Chunk.cache_id.in_(batch))
                    conn.execute(rows.order_by(Chunk.cache_id).with_for_update())
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
        self._update_one(cache_id, expires_at=None if expires_at is None else utc(expires_at))

    def expired(self, now: datetime | None = None) -> list[str]:
        """Chunks whose expiry is at or before `now` (default: the current time), pinned or not."""
        cutoff = utc_now() if now is None else utc(now)  # (remove_chunk's expired_by)
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
        cutoff = utc_now() - timedelta(seconds=seconds)
        stmt = (
            select(Chunk.cache_id)
            .where(Chunk.state == "pending", Chunk.created_at <= cutoff)
            .order_by(Chunk.created_at, Chunk.cache_id)
        )
        with self._read() as conn:
            return list(conn.scalars(stmt))

    def remove_chunk(
        self,
        cache_id: str,
        *,
        expired_by: datetime | None = None,
        pending_since: datetime | None = None,
    ) -> bool:
        """Delete a chunk and (by cascade) its placements and document listings; False if it
        was unknown. A chunk some document listed bumps DOCUMENTS_VERSION, so every process's
        vector index drops it (gc's expired chunks, not only `expire_cache`'s).

        `expired_by` / `pending_since`: only if it is still expired by then, or still pending
        since then (gc's lists are read before it deletes: a row another process committed, or
        whose expiry a re-ingest moved, in between is kept)."""
        still = Chunk.cache_id == cache_id
        if expired_by is not None:
            still &= Chunk.expires_at.is_not(None) & (Chunk.expires_at <= utc(expired_by))
        if pending_since is not None:
            still &= (Chunk.state == "pending") & (Chunk.created_at <= utc(pending_since))
        with self._write() as conn:
            # locked before its listings are counted: one made meanwhile is then seen (the
            # delete's cascade took it, uncounted, and no index dropped the chunk)
            conn.execute(select(Chunk.cache_id).where(still).with_for_update()).all()
            listed = conn.scalar(select(func.count()).where(DocumentChunk.cache_id == cache_id))
            removed = conn.execute(delete(Chunk).where(still)).rowcount > 0
            if removed and listed:
                conn.execute(_count(self._insert, DOCUMENTS_VERSION, 1))
            return removed

    def _update_one(self, cache_id: str, **values: Any) -> None:
        with self._write() as conn:
            done = conn.execute(update(Chunk).where(Chunk.cache_id == cache_id).values(**values))
            if done.rowcount == 0:
                raise UnknownCacheIdError([cache_id])

    # -- placements

    def _placement_upsert(self, cache_id: str, tier: str, nbytes: int) -> Any:
        stmt = self._insert(Placement).values(
            cache_id=cache_id, tier=tier, nbytes=nbytes, placed_at=utc_now()
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

    def placement_tiers(self, tiers: Iterable[str]) -> set[str]:
        """Those of `tiers` holding a copy of some chunk (one indexed look-up each)."""
        with self._read() as conn:
            return {
                t
                for t in tiers
                if conn.scalar(select(select(Placement.tier).where(Placement.tier == t).exists()))
            }

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
        with self._write() as conn:
            conn.execute(_count(self._insert, name, by))

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


def _check_key(what: str, value: str, max_len: int = 64) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise CatalogError(f"{what} must be a string of 1..{max_len} characters, got {value!r}")


def _check_state(state: str) -> None:
    if state not in STATES:
        raise CatalogError(f"chunk state {state!r} is not one of {STATES}")


def _batches(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), _BATCH):
        yield ids[i : i + _BATCH]


def _count(insert: Any, name: str, by: int) -> Any:
    """The upsert that adds `by` to counter `name` (created at 0)."""
    stmt = insert(Counter).values(name=name, value=by)
    return stmt.on_conflict_do_update(
        index_elements=["name"], set_={"value": Counter.value + stmt.excluded.value}
    )


def _counters(conn: Connection) -> dict[str, int]:
    rows = conn.execute(select(Counter.name, Counter.value).order_by(Counter.name))
    return {name: int(value) for name, value in rows}
