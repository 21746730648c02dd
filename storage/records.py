"""What the catalog and the tiered store hand back: plain, frozen records, and the catalog's error.

Kept apart from the SQL (no SQLAlchemy here) so that the core's `KVStore` protocol
(`rag_kvcache.kv`) and the in-memory store can name these types without loading a database
stack: `ChunkRow` (what re-encoding reads), `DocumentRow`, `CatalogStats`, and the store's
upkeep reports `VerifyReport` and `GcReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from rag_kvcache.errors import RagKVCacheError, StoreUnavailableError


class CatalogError(RagKVCacheError):
    """The catalog was opened or called with a value it cannot use."""


class ChunksGoneError(CatalogError):
    """A document was to be recorded with chunks that are no longer in the catalog: another
    process removed them after this one found them stored (it dropped them as no document's,
    or gc or an expiry did). Caching the texts again, then recording again, mends it."""

    def __init__(self, message: str, cache_ids: list[str]):
        super().__init__(message)
        self.cache_ids = cache_ids


class CatalogUnavailableError(CatalogError, StoreUnavailableError):
    """An open catalog's database did not answer as asked (gone, cut off, a lock not granted
    in time, a file it cannot write): the store's fault, not the caller's."""


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

    def servable(self, now: datetime) -> bool:
        """May a request use this chunk: stored (not pending), and not expired at `now`."""
        return self.state == "stored" and (self.expires_at is None or self.expires_at > now)


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


@dataclass(frozen=True)
class GcReport:
    expired: int
    pending: int  # rows of writers that died between claiming and storing
    orphan_blobs: int  # blob files no stored row accounts for
    temporaries: int  # half-written files of killed writers


@dataclass(frozen=True)
class ModelFile:
    """A model's file kept in the catalog: a link calibration or a LoRA adapter."""

    kind: str  # "calibration" or "adapter"
    fingerprint: str
    encode_settings: str | None  # a calibration's chunk encoding; None for an adapter
    nbytes: int
    checksum: str  # the sha256 recorded when it was kept
    intact: bool  # its bytes match that sha256

    def __str__(self) -> str:
        if self.kind == "adapter":
            return f"the LoRA adapter of model {self.fingerprint}"
        return f"the link calibration of model {self.fingerprint} ({self.encode_settings})"


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    corrupt: list[str]
    missing: list[str]
    repaired: int
    upgraded: int = 0  # sha256 checksums (older stores) rewritten as xxh3-128
    unreadable: list[str] = field(default_factory=list)  # rows with damaged values (dropped
    # when repairing: nothing can re-encode them; their documents are re-ingested next time)
    orphans: list[str] = field(default_factory=list)  # blobs no row names (dropped by repair)
    other_model: list[str] = field(default_factory=list)  # bad, but not this model's to repair
    full: str | None = None  # the store filled up while repairing: why the rest were not
    damaged_files: list[ModelFile] = field(default_factory=list)  # calibrations, adapters
    # whose bytes fail their sha256 (dropped when repairing: only training makes them again)
