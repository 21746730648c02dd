"""TieredStore: the SQL catalog plus a durable blob tier plus hot memory tiers.

    get(ids) --> GPU tier --> CPU tier --> durable tier (disk or Redis) --> re-encode from catalog
                 (hot copies, byte budgets, LRU/LFU, pins)   (every blob, checksummed)

The catalog row is claimed before the blob is written and marked stored after, so a writer
killed in between leaves a `pending` row (removed by gc) and never a row pointing at nothing.
A blob that is missing or fails its checksum is re-encoded from the token ids in the catalog
(and counted), never used silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rag_kvcache.config import COMPRESSIONS
from rag_kvcache.errors import (
    ConfigError,
    FingerprintMismatchError,
    StoreDamagedError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
    UnknownCacheIdError,
    shown_name,
)
from rag_kvcache.kv import ChunkKV, EncodeSettings, Fetched
from rag_kvcache.storage.blob import (
    XXH3,
    CorruptBlobError,
    as_stored,
    checksum,
    from_blob,
    to_blob,
)
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.database import same_catalog, shown_url, sqlite_path
from rag_kvcache.storage.disk import DiskTier, process_alive
from rag_kvcache.storage.hot import MemoryTier
from rag_kvcache.storage.layout import (
    BLOBS_FOLDER,
    CATALOG_FILE,
    FORMAT_VERSION,
    INDEX_TEMPORARIES,
    StoreMarker,
    checked_name,
    is_name,
    open_folder,
    read_marker,
    redis_prefix,
    write_marker,
)
from rag_kvcache.storage.records import ChunkRow, ChunksGoneError, GcReport, VerifyReport
from rag_kvcache.storage.redis_tier import RedisTier
from rag_kvcache.storage.streaming import LayerReads, open_blob

log = logging.getLogger(__name__)
WAIT_SAID_S = 3.0  # a wait for another writer's chunk is logged once it lasts this long
PUT_TRIES = 3  # claims of a chunk that another process keeps removing meanwhile

if TYPE_CHECKING:
    from rag_kvcache.kv import KVStore

# Rebuilds a lost or corrupt blob from its catalog row (rag_kvcache.engine.reencoder(lm)).
Reencode = Callable[[ChunkRow], ChunkKV]


class BlobTier(Protocol):
    """A durable tier: keeps every blob (disk, Redis)."""

    name: str

    def put(self, cache_id: str, data: bytes) -> None: ...
    def get(self, cache_id: str, nbytes: int | None = None) -> bytes | bytearray | None: ...
    def contains(self, cache_id: str) -> bool: ...
    def remove(self, cache_id: str) -> bool: ...
    def ids(self) -> Iterator[str]: ...
    def remove_temporaries(self, older_than_s: float) -> int: ...
    def nbytes(self) -> int: ...
    def close(self) -> None: ...


def _open_catalog(
    root: Path, catalog_url: str | None, create: bool, marker: StoreMarker | None
) -> Catalog:
    """The store's catalog. Once a store exists (it has a marker, or blobs), a missing or empty
    catalog is damage (StoreDamagedError), never a new empty store whose gc would then delete
    every blob."""
    path = root / CATALOG_FILE
    own = marker is None or _in_folder(root, marker.catalog)
    if catalog_url is None:
        lost = not path.is_file() or path.stat().st_size == 0
        if lost and not own:  # (a marker's URL shows no password: it cannot be used as is)
            assert marker is not None
            raise StoreNotFoundError(
                f"the store at {root} keeps its catalog at {marker.catalog}, not in its "
                "folder: give that --catalog-url (catalog_url)"
                + ("" if sqlite_path(marker.catalog) else ", with its password")
            )
        if lost and (marker is not None or any((root / BLOBS_FOLDER).glob("*/*.safetensors"))):
            raise StoreDamagedError(
                f"the store at {root} has lost its catalog ({path} is missing or empty); "
                "restore it from a backup (the blobs alone cannot be used)"
            )
    try:
        if catalog_url:
            return Catalog(catalog_url, create=create and marker is None)
        return Catalog(path=path, create=create and marker is None)
    except StoreNotFoundError:
        if marker is None:
            raise
        if catalog_url and not same_catalog(catalog_url, marker.catalog):  # another's
            made_with = (
                "the catalog in its folder: open it without --catalog-url (catalog_url)"
                if own
                else f"the catalog at {marker.catalog}: give that --catalog-url (catalog_url)"
            )
            raise StoreNotFoundError(
                f"the catalog URL given ({shown_url(catalog_url)}) holds no store; the store at "
                f"{root} was made with {made_with}"
            ) from None
        raise StoreDamagedError(
            f"the store at {root} has lost its catalog ({marker.catalog} holds none); "
            "restore it from a backup"
            + ("" if catalog_url else ", or give the --catalog-url it was made with")
        ) from None


def _in_folder(root: Path, catalog_url: str) -> bool:
    """Does a marker's catalog URL name the catalog file in the store's own folder? (A store
    made by a relative path has a relative one, read against that time's working folder.)"""
    file = sqlite_path(catalog_url)
    if file is None or file.name != CATALOG_FILE:
        return False
    if file.is_absolute():  # (a folder moved since: that path is gone)
        return file.resolve() == (root / CATALOG_FILE).resolve() or not file.exists()
    return file.parent.name in ("", ".", "..", root.resolve().name)  # (`--store .` too)


def _check_marker(root: Path, marker: StoreMarker, catalog: Catalog) -> None:
    """The folder and the catalog must be of one store."""
    if marker.store_id != catalog.store_id:
        raise StoreDamagedError(
            f"the store folder {root} belongs to store {marker.store_id} (catalog "
            f"{marker.catalog}), but the catalog {catalog.url} is store {catalog.store_id}: "
            "give the catalog it was made with, or another --store folder"
        )


def _discard_new_folder(root: Path) -> None:
    """Undo `open_folder` for a store that did not open (its marker is written last, so
    never): the folder is removed if nothing was put in it, by this opener or another."""
    with contextlib.suppress(OSError):
        root.rmdir()


def _check_durable(root: Path, tier: str, catalog: Catalog) -> None:
    """A store whose blobs are all in the other durable tier (Redis, or the folder) is opened
    with its own: opened without --redis-url, a Redis store found no blob on disk and
    re-encoded every chunk it was asked for, silently, into the folder."""
    held = catalog.placement_tiers(("disk", "redis"))
    if held and tier not in held:
        if "redis" in held:
            raise StoreError(
                f"the store at {root} keeps its blobs in Redis: give the --redis-url "
                "(redis_url) it was made with (to move it, ingest into a new store)"
            )
        raise StoreError(
            f"the store at {root} keeps its blobs in its folder, not in Redis: open it "
            "without --redis-url (redis_url) (to move it, ingest into a new store)"
        )


def _reads_bad(row: ChunkRow, data: bytes | bytearray | None) -> bool:
    """Is a blob read for `row` missing (None), unchecked, or not the KV its row describes?"""
    return data is None or row.checksum is None or isinstance(_parsed(row, data), str)


def _parsed(row: ChunkRow, data: bytes | bytearray) -> ChunkKV | str:
    """The chunk a blob holds, checked against its row (checksum, encoding, token count), or
    'corrupt'."""
    assert row.checksum is not None
    try:
        sinks = EncodeSettings.from_key(row.encode_settings).sink_ids
    except ValueError:  # (verify finds such rows first, and names them unreadable)
        raise StoreDamagedError(
            f"the catalog row of chunk {row.cache_id} is damaged (its encode settings cannot "
            "be read): `rag-kvcache verify --repair` drops it, and the next ingest of its "
            "document encodes it again"
        ) from None
    try:
        return from_blob(data, row.checksum, row.cache_id, row.fingerprint, row.token_ids, sinks)
    except CorruptBlobError:
        return "corrupt"


MAX_TTL_S = 100 * 365.25 * 86400  # a chunk's time to live, at most


def _remove_index_temporaries(root: Path, older_than_s: float) -> int:
    """The vector index's half-written files of dead writers (a save cut by a kill; they ate
    the space a retry needed, and gc kept them). A live writer's are left, as are files
    younger than `older_than_s` (a writer on another machine sharing the folder)."""
    removed = 0
    for tmp in root.glob("index.*.tmp"):
        if not (named := INDEX_TEMPORARIES.fullmatch(tmp.name)):  # (not the index's: kept)
            continue
        try:
            if time.time() - tmp.lstat().st_mtime < older_than_s or process_alive(named[2]):
                continue
            tmp.unlink()
        except OSError:  # renamed by its writer meanwhile; a folder of that name: kept
            continue
        removed += 1
    return removed


def _wholesale(orphans: list[str], listed: set[str]) -> bool:
    """Orphan blobs are few (writers killed at the wrong moment); more of them than chunks in
    the catalog means the catalog is lost, old or another store's, not that they are garbage."""
    return len(orphans) > max(2, len(listed))


def servable(row: ChunkRow | None, now: datetime) -> bool:
    """Whether a catalog row names a chunk a request may use (`ChunkRow.servable`)."""
    return row is not None and row.servable(now)


class TieredStore:
    """Durable, shared KV store. `root` holds the blobs (and the SQLite catalog by default).

    `create=False` opens only an existing store (StoreNotFoundError otherwise): what commands
    that only read a store use, so a mistyped folder never becomes a new empty store.

    `reencode` is how a blob found missing or corrupt is rebuilt from its catalog row (the
    model's encoder: `rag_kvcache.engine.reencoder(lm)`); without it such a blob is a
    CorruptBlobError. RagKVCache gives it when it opens the store from a StoreConfig.
    """

    def __init__(
        self,
        root: Path,
        *,
        catalog_url: str | None = None,
        catalog: Catalog | None = None,
        redis_url: str | None = None,
        durable: BlobTier | None = None,
        cpu_bytes: int = 2 << 30,
        gpu_bytes: int = 0,
        policy: str = "lru",
        compress: str | None = None,
        reencode: Reencode | None = None,
        create: bool = True,
    ):
        if compress not in COMPRESSIONS:  # before any folder or catalog is made
            raise ConfigError(f"compress {compress!r} is not one of {COMPRESSIONS}")
        root = Path(root)
        # the folder holds the vector index whatever the tiers are (with a PostgreSQL catalog
        # and Redis blobs nothing else would make it). A reader never makes one, except beside
        # a catalog kept elsewhere, which must exist (a worker's new folder on another machine)
        made = not root.exists()
        open_folder(root, create or catalog is not None or catalog_url is not None)
        self.root = root
        marker = read_marker(root)
        given, own_durable = catalog is not None, durable is None
        if catalog is None:
            try:
                catalog = _open_catalog(root, catalog_url, create, marker)
            except BaseException:  # a folder made for a catalog that did not open: not kept
                if made:
                    _discard_new_folder(root)
                raise
        try:  # the folder's store first, then the durable tier; a new marker only then
            if marker is not None:
                _check_marker(root, marker, catalog)
            if durable is None and redis_url:  # (a bad or unreachable URL says so first)
                durable = RedisTier(redis_url, prefix=redis_prefix(catalog.store_id))
                _check_durable(root, "redis", catalog)
            elif durable is None:
                _check_durable(root, "disk", catalog)
                durable = DiskTier(root / BLOBS_FOLDER)
            if marker is None:  # a new store, or one made before markers
                write_marker(root, StoreMarker(FORMAT_VERSION, catalog.store_id, catalog.url))
        except BaseException:
            if not given:
                catalog.close()
            if own_durable and durable is not None:
                durable.close()
            if made:
                _discard_new_folder(root)
            raise
        self.catalog = catalog
        self.durable = durable
        self._own_durable = own_durable  # (a tier handed in is its caller's to close)
        self.hot = [MemoryTier("cpu", cpu_bytes, "cpu", policy)]
        if gpu_bytes:
            self.hot.insert(0, MemoryTier("gpu", gpu_bytes, "cuda", policy))
        self.reencode = reencode
        # how new durable blobs hold KV (blob.COMPRESSIONS); each blob says how it was written,
        # so a store keeps serving blobs written under another setting. Hot tiers keep what a
        # blob reads back as (blob.as_stored), never more precise than the durable copy
        self.compress = compress
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-read")
        self._prefetching: dict[str, Future[None]] = {}  # reads `prefetch` started, by ID
        self._prefetch_lock = threading.Lock()
        self.takeover_s = 30.0  # a claimed chunk still pending after this: its writer died
        # `fetch` reads cold disk blobs layer by layer behind the forward (off: read whole)
        self.stream_reads = True

    def close(self) -> None:
        self._readers.shutdown()
        self.catalog.close()
        if self._own_durable:
            self.durable.close()

    # ------------------------------------------------------------------ writing

    def register_model(
        self, fingerprint: str, name: str, dtype: str, layers: int, kv_heads: int, head_dim: int
    ) -> None:
        self.catalog.register_model(fingerprint, name, dtype, layers, kv_heads, head_dim)

    def put(
        self,
        kv: ChunkKV,
        text: str = "",
        *,
        pinned: bool = False,
        ttl_s: float | None = None,
    ) -> None:
        """Store kv durably (once, whoever else stores the same chunk) and keep it hot;
        `ttl_s`: seconds until it expires (None: never), at most MAX_TTL_S."""
        checked_name("cache ID", kv.cache_id)
        number = isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
        if ttl_s is not None and not (number and 0 < ttl_s <= MAX_TTL_S):  # NaN too
            raise ConfigError(
                f"ttl_s must be > 0 and <= {MAX_TTL_S:.0f} (100 years), got {shown_name(ttl_s)}"
            )
        expires = datetime.now(UTC) + timedelta(seconds=ttl_s) if ttl_s else None
        claim = partial(
            self.catalog.begin_chunk,
            kv.cache_id,
            fingerprint=kv.fingerprint,
            text=text,
            token_ids=kv.token_ids,
            encode_settings=kv.settings.key(),
            start=kv.start,
            pinned=pinned,
            expires_at=expires,
        )
        # another process may remove the chunk at any step after its claim was refused (its
        # writer withdrew it, or a document removal dropped the chunk): then claim it again
        for _ in range(PUT_TRIES):
            if claim():
                self._keep_hot(self._write(kv), pinned)
                return
            try:
                row = self.catalog.chunk(kv.cache_id)
                if row is None:
                    continue
                if row.expires_at != expires or row.pinned != pinned:
                    self.catalog.set_expiry(kv.cache_id, expires)  # re-ingesting: the TTL
                    self.catalog.set_pinned(kv.cache_id, pinned or row.pinned)
                if not self._wait_stored(kv.cache_id):
                    if self.catalog.chunk(kv.cache_id) is None:
                        continue
                    self._write(kv)  # its writer died (its row stayed pending)
            except UnknownCacheIdError:
                continue
            self._keep_hot(as_stored(kv, self.compress), pinned or row.pinned)
            return
        raise ChunksGoneError(
            f"chunk {kv.cache_id} was removed by another process each of the {PUT_TRIES} "
            "times it was stored here",
            [kv.cache_id],
        )

    def _wait_stored(self, cache_id: str) -> bool:
        """Another writer claimed this chunk: wait for its commit rather than write the blob
        too (two writers' bytes may differ in the last bit, and the catalog must describe the
        file on disk). False if it does not commit in `takeover_s`."""
        began = time.monotonic()
        said = False
        while (waited := time.monotonic() - began) < self.takeover_s:
            row = self.catalog.chunk(cache_id)
            if row is None or row.state == "stored":
                return row is not None
            if waited > WAIT_SAID_S and not said:  # (a killed writer's claim: a silent stall)
                log.warning(
                    "chunk %s is claimed by another writer that has not stored it for %.0f s "
                    "(its blob being written, or that writer killed): waiting up to %.0f s "
                    "before writing it here",
                    cache_id,
                    waited,
                    self.takeover_s,
                )
                said = True
            time.sleep(0.05)
        return False

    def _write(self, kv: ChunkKV, *, claimed: bool = True) -> ChunkKV:
        """Write kv's blob and commit its row; returns the KV that blob reads back as.
        `claimed`: the row is this writer's pending claim, withdrawn if the write fails; a
        repair (False) rewrites a stored chunk's blob, whose row a failed write must keep
        (it holds the chunk's text, from which the next request re-encodes it)."""
        data = to_blob(kv, self.compress)
        try:
            self.durable.put(kv.cache_id, data)
        except BaseException:  # a full disk, Redis gone, killed: nothing half-recorded
            # and our claim gone, so the next writer of this chunk need not wait it out
            if claimed:
                with contextlib.suppress(Exception):  # a catalog down too: gc drops it
                    self.catalog.remove_chunk(kv.cache_id)
            raise
        self.catalog.commit_chunk(kv.cache_id, len(data), checksum(data), self.durable.name)
        return as_stored(kv, self.compress)

    def _keep_hot(self, kv: ChunkKV, pinned: bool) -> None:
        for tier in self.hot:
            tier.put(kv, pinned)

    # ------------------------------------------------------------------ reading

    def get(self, cache_ids: list[str]) -> list[ChunkKV]:
        """The chunks, in order, from the fastest tier holding each (promoted on a miss)."""
        rows, found, misses = self._look_up(cache_ids)
        self._read_whole(rows, found, misses)
        return [found[cid] for cid in cache_ids]

    def fetch(self, cache_ids: list[str]) -> Fetched:
        """`get` for one request that links the chunks at once: chunks cold on disk arrive
        layer by layer while it computes (`storage.streaming`); the request calls
        `settle()` after its forward (see `Fetched`)."""
        rows, found, misses = self._look_up(cache_ids)
        blobs = []
        if self.stream_reads and isinstance(self.durable, DiskTier) and misses:
            disk = self.durable
            opened = self._readers.map(lambda c: open_blob(disk.path(c), rows[c]), misses)
            blobs = [b for b in opened if b is not None]
        streamed = {b.row.cache_id for b in blobs}
        # the others first: queued behind the layer reads, they would hold up the forward
        self._read_whole(rows, found, [c for c in misses if c not in streamed])
        reads = LayerReads(blobs, self._readers, lambda kv: self._keep_read(kv, rows))
        found.update((b.row.cache_id, replace(b.chunk, arrival=reads)) for b in blobs)
        if blobs:
            self._count(f"hits:{self.durable.name}", len(blobs))
        return Fetched([found[cid] for cid in cache_ids], reads.settle)

    def prefetch(self, cache_ids: list[str]) -> None:
        """Start reading the chunks no hot tier holds from the durable tier into the hot tiers
        (CPU memory, pinned where the store pins; the GPU tier), in the background. Retrieval
        calls it as it returns cache IDs, so the reads overlap whatever comes before the
        answer's `fetch`, which finds the chunks hot or waits for the reads in flight.
        Unknown, expired or damaged chunks are left for `fetch` to report; never raises."""
        named = [c for c in dict.fromkeys(cache_ids) if is_name("cache ID", c)]
        with self._prefetch_lock:
            named = [c for c in named if c not in self._prefetching]
        cold = [c for c in named if self._hot(c) is None]
        if not cold:
            return
        now = datetime.now(UTC)
        rows = {c: row for c, row in self.catalog.chunks(cold).items() if servable(row, now)}
        started: dict[str, Future[None]] = {}
        with self._prefetch_lock:
            for cid, row in rows.items():
                if cid in self._prefetching:
                    continue
                try:
                    started[cid] = self._prefetching[cid] = self._readers.submit(
                        self._read_ahead, row
                    )
                except RuntimeError:  # the store was closed meanwhile
                    break
        for cid, future in started.items():  # outside the lock: a read done already calls
            future.add_done_callback(partial(self._prefetched, cid))  # back in this thread

    def _read_ahead(self, row: ChunkRow) -> None:
        loaded = self._load(row)
        if isinstance(loaded, str):  # missing or corrupt: `fetch` repairs or reports it
            return
        # counted before it shows hot: a fetch that finds it hot sees the count too
        self._count(f"prefetched:{self.durable.name}")
        self._keep_hot(loaded, row.pinned)

    def _prefetched(self, cache_id: str, _done: Future[None]) -> None:
        with self._prefetch_lock:
            self._prefetching.pop(cache_id, None)

    def _await_prefetched(self, found: dict[str, ChunkKV], misses: list[str]) -> list[str]:
        """Wait for the reads `prefetch` has in flight for `misses`, then take from the hot
        tiers what they (or any read finished meanwhile) brought; the misses left."""
        with self._prefetch_lock:
            pending = [self._prefetching[c] for c in misses if c in self._prefetching]
        if pending:
            wait(pending)
        for cid in misses:
            if (kv := self._hot(cid)) is not None:
                found[cid] = kv
        return [c for c in misses if c not in found]

    def _hot(self, cache_id: str) -> ChunkKV | None:
        """The fastest hot tier's copy of the chunk (on the GPU, or pinned), or None."""
        return next((kv for t in self.hot if (kv := t.get(cache_id)) is not None), None)

    def _keep_read(self, kv: ChunkKV, rows: dict[str, ChunkRow]) -> None:
        """Keep a chunk `fetch` read hot: at once where the hot tiers hold it as it is (CPU);
        a copy to the GPU tier, or into pinned memory, off the first token's path."""
        if all(t.device.type == "cpu" and not t.pin_memory for t in self.hot):
            self._keep_hot(kv, rows[kv.cache_id].pinned)
            return
        with contextlib.suppress(RuntimeError):  # the store was closed meanwhile
            self._readers.submit(self._keep_hot, kv, rows[kv.cache_id].pinned)

    def _look_up(
        self, cache_ids: list[str]
    ) -> tuple[dict[str, ChunkRow], dict[str, ChunkKV], list[str]]:
        """The chunks' catalog rows, those found in a hot tier, and the misses (each once);
        unknown or expired IDs raise, all at once. Counts the hot tiers' hits."""
        malformed = [c for c in cache_ids if not is_name("cache ID", c)]
        if malformed:  # names no chunk: unknown, before any lookup
            raise UnknownCacheIdError(malformed)
        rows = self.catalog.chunks(cache_ids)
        now = datetime.now(UTC)
        unknown = [c for c in cache_ids if not servable(rows.get(c), now)]
        if unknown:
            raise UnknownCacheIdError(unknown)
        found: dict[str, ChunkKV] = {}
        hits = {t.name: 0 for t in self.hot}
        for cid in dict.fromkeys(cache_ids):
            for tier in self.hot:
                if (kv := tier.get(cid)) is not None:
                    found[cid] = kv
                    hits[tier.name] += 1
                    break
        self._count_use(cache_ids, hits)
        misses = [cid for cid in dict.fromkeys(cache_ids) if cid not in found]
        return rows, found, self._await_prefetched(found, misses)

    def _count_use(self, cache_ids: list[str], hits: dict[str, int]) -> None:
        """Record the chunks' use (LRU/LFU) and the hot tiers' hits (see `_count`)."""
        try:
            self.catalog.touch(cache_ids)
        except StoreFullError as err:
            log.warning("%s; this use of %d chunks is not counted", err, len(cache_ids))
        for tier_name, n in hits.items():
            if n:
                self._count(f"hits:{tier_name}", n)

    def _count(self, name: str, by: int = 1) -> None:
        """Add to a usage counter: bookkeeping, which a full catalog disk skips with a warning
        (reading chunks is no write: every answer failed, and `gc` freed nothing)."""
        try:
            self.catalog.count(name, by)
        except StoreFullError as err:
            log.warning("%s; counter %s not updated", err, name)

    def _read_whole(
        self, rows: dict[str, ChunkRow], found: dict[str, ChunkKV], misses: list[str]
    ) -> None:
        """Read `misses` from the durable tier into `found` (repaired if missing or corrupt)
        and keep them hot."""
        # reading and checksumming release the GIL: fetch cold chunks side by side
        for cid, loaded in zip(misses, self._readers.map(lambda c: self._load(rows[c]), misses)):
            # missing or corrupt (a reason): re-encode (needs the model)
            read = self._repair(rows[cid], loaded) if isinstance(loaded, str) else loaded
            self._keep_hot(read, rows[cid].pinned)
            # the fastest hot copy (on the GPU, or pinned) if it was kept, else the one read
            hot = self._hot(cid)
            found[cid] = read if hot is None else hot
        if misses:
            self._count(f"hits:{self.durable.name}", len(misses))

    def _load(self, row: ChunkRow) -> ChunkKV | str:
        """The chunk from the durable tier, or why it cannot be used ('missing', 'corrupt')."""
        data = self.durable.get(row.cache_id, row.nbytes)
        if data is None or row.checksum is None:
            return "missing"
        return _parsed(row, data)

    def _repair(self, row: ChunkRow, why: str) -> ChunkKV:
        if self.reencode is None:
            raise CorruptBlobError(
                f"blob of chunk {row.cache_id} is {why} and this store has no model to "
                "re-encode it: build it with TieredStore(..., reencode=reencoder(lm)) "
                "(rag_kvcache.engine.reencoder), or let RagKVCache open it from a StoreConfig"
            )
        self.catalog.count(f"reencoded:{why}")
        return self._write(self.reencode(row), claimed=False)

    def put_calibration(self, fingerprint: str, encode_settings: str, data: bytes) -> str:
        """Keep a model's link calibration in the catalog (shared by every worker on it)."""
        return self.catalog.put_calibration(fingerprint, encode_settings, data)

    def calibration(self, fingerprint: str, encode_settings: str) -> bytes | None:
        """The model's link calibration bytes, or None; damaged bytes are a StoreDamagedError."""
        found = self.catalog.calibration(fingerprint, encode_settings)
        return self._checked(found, f"the link calibration of model {fingerprint}", "")

    def put_adapter(self, fingerprint: str, data: bytes) -> str:
        """Keep the LoRA link calibration of base model `fingerprint` in the catalog."""
        return self.catalog.put_adapter(fingerprint, data)

    def adapter(self, fingerprint: str) -> bytes | None:
        """The base model's LoRA adapter bytes, or None; damaged bytes are a StoreDamagedError."""
        found = self.catalog.adapter(fingerprint)
        return self._checked(found, f"the LoRA adapter of model {fingerprint}", " --kind lora")

    def _checked(self, found: tuple[bytes, str] | None, what: str, kind: str) -> bytes | None:
        """A catalog file's bytes if they match their sha256; None if there are none."""
        if found is None:
            return None
        data, checksum = found
        if hashlib.sha256(data).hexdigest() != checksum:
            raise StoreDamagedError(
                f"{what} in {self.catalog.url} is damaged (checksum mismatch); run "
                f"`rag-kvcache calibrate{kind}` again"
            )
        return data

    def contains(self, cache_id: str) -> bool:
        return servable(self.catalog.chunk(checked_name("cache ID", cache_id)), datetime.now(UTC))

    # ------------------------------------------------------------------ upkeep

    def set_pinned(self, cache_id: str, pinned: bool) -> None:
        self.catalog.set_pinned(checked_name("cache ID", cache_id), pinned)
        for tier in self.hot:
            tier.set_pinned(cache_id, pinned)

    def remove(self, cache_id: str) -> bool:
        """Forget a chunk everywhere (expire_cache)."""
        checked_name("cache ID", cache_id)
        for tier in self.hot:
            tier.remove(cache_id)
        removed = self.catalog.remove_chunk(cache_id)
        self.durable.remove(cache_id)
        return removed

    def forget_orphan(self, cache_id: str) -> None:
        """Drop the hot copies and the blob of a chunk whose row a document's removal (or
        replacement) deleted in its transaction. Its row is not deleted again, and its blob
        is kept if a row names it again: another worker cached the chunk anew meanwhile
        (`remove` here deleted that worker's new row and blob)."""
        checked_name("cache ID", cache_id)
        for tier in self.hot:
            tier.remove(cache_id)
        if self.catalog.chunk(cache_id) is None:
            self.durable.remove(cache_id)

    def _remove_if(self, cache_id: str, **still: datetime) -> bool:
        """Forget a chunk everywhere if its row still matches `still` (Catalog.remove_chunk)."""
        if not self.catalog.remove_chunk(cache_id, **still):
            return False
        for tier in self.hot:
            tier.remove(cache_id)
        self.durable.remove(cache_id)
        return True

    def gc(self, pending_after_s: float = 600.0, force: bool = False) -> GcReport:
        """Remove expired chunks, dead writers' pending rows, orphan blobs and temporaries
        (a writer is taken for dead after `pending_after_s`; a live writer's temporary file is
        locked, and kept whatever its age).

        Orphan blobs are few (a writer killed at the wrong moment); when they outnumber the
        chunks the catalog lists, the catalog is more likely lost or another store's than the
        blobs garbage, so gc refuses (StoreDamagedError) unless `force`."""
        # each row deleted only if it still is what it was listed as: another process may
        # commit a pending row, or re-ingest an expired chunk, between the list and the delete
        now = datetime.now(UTC)
        expired = [c for c in self.catalog.expired(now) if self._remove_if(c, expired_by=now)]
        listed_pending = self.catalog.pending_older_than(pending_after_s)
        since = datetime.now(UTC) - timedelta(seconds=pending_after_s)  # (after: all listed)
        pending = [c for c in listed_pending if self._remove_if(c, pending_since=since)]
        # blobs first, then the catalog: a writer claims its row before writing its blob, so
        # every blob seen here whose writer is alive has a row in the catalog read after
        blobs = list(self.durable.ids())
        listed = self.catalog.chunk_ids()
        orphans = [cid for cid in blobs if cid not in listed]
        if not force and _wholesale(orphans, listed):
            raise StoreDamagedError(
                f"gc refused: {len(orphans)} blobs are not in the catalog, which lists "
                f"{len(listed)} chunks ({self.catalog.url}); is it the right catalog, or one "
                "restored from an old backup? Run gc with --force to delete them anyway"
            )
        removed = sum(self.durable.remove(cid) for cid in orphans)  # (gone meanwhile: not)
        temporaries = self.durable.remove_temporaries(older_than_s=pending_after_s)
        temporaries += _remove_index_temporaries(self.root, pending_after_s)
        return GcReport(len(expired), len(pending), removed, temporaries)

    def verify(
        self, repair: bool = True, on_checked: Callable[[], None] | None = None
    ) -> VerifyReport:
        """Re-read every stored blob and check it (its checksum, and that it holds the KV its
        row describes, in whichever encoding); re-encode bad ones when `repair`. A good
        blob still under an older store's sha256 gets its xxh3-128 checksum (faster reads).
        Orphan blobs (no row names them) are reported, and deleted when repairing unless
        they disagree with the catalog wholesale (see gc)."""
        blobs = list(self.durable.ids())  # before the catalog, as in gc
        listed = self.catalog.chunk_ids()
        orphans = [cid for cid in blobs if cid not in listed]
        rows, unreadable = self._readable_rows(self.catalog.chunk_ids("stored"))
        if repair:  # nothing can re-encode them: drop them (their documents re-ingest)
            for cid in unreadable:
                self.remove(cid)
            if not _wholesale(orphans, listed):
                for cid in orphans:
                    self.durable.remove(cid)
        corrupt: list[str] = []
        missing: list[str] = []
        other_model: list[str] = []
        repaired = upgraded = 0
        full: str | None = None  # why repairing stopped: each repair after would fail too
        for row in rows:
            data = self.durable.get(row.cache_id, row.nbytes)
            bad = _reads_bad(row, data)
            if bad and self._changed_since(row):  # removed or rewritten since the rows were
                if on_checked:  # listed (another process's document removal, gc, a re-encode,
                    on_checked()  # the chunk ingested again): not damage, nothing to repair
                continue
            if data is None:
                missing.append(row.cache_id)
            elif bad or row.checksum is None:  # (None is bad: said again for the type)
                corrupt.append(row.cache_id)  # its bytes, or the KV they hold (any encoding)
            else:
                if not row.checksum.startswith(XXH3):
                    with contextlib.suppress(UnknownCacheIdError):  # (its row gone meanwhile)
                        self.catalog.commit_chunk(
                            row.cache_id, len(data), checksum(data), self.durable.name
                        )
                        upgraded += 1
                if on_checked:
                    on_checked()
                continue
            if repair and self.reencode is not None and full is None:
                for tier in self.hot:
                    tier.remove(row.cache_id)
                try:
                    self._repair(row, "missing" if data is None else "corrupt")
                    repaired += 1
                except UnknownCacheIdError:  # its row removed while it was re-encoded: the
                    self.durable.remove(row.cache_id)  # blob just written is no one's, and
                    (missing if data is None else corrupt).remove(row.cache_id)  # no damage
                except FingerprintMismatchError:  # the rest are still checked and repaired
                    other_model.append(row.cache_id)
                except StoreFullError as err:  # the rest are still checked, and reported
                    full = str(err)
            if on_checked:
                on_checked()
        checked = len(rows) + len(unreadable)
        damaged = [f for f in self.catalog.model_files() if not f.intact]
        if repair:  # nothing but training makes them again: every use of them failed
            for file in damaged:
                self.catalog.drop_model_file(file)
        return VerifyReport(
            checked,
            corrupt,
            missing,
            repaired,
            upgraded,
            unreadable,
            orphans,
            other_model,
            full,
            damaged,
        )

    def _changed_since(self, row: ChunkRow) -> bool:
        """Has the chunk's row gone, or its blob changed, since `row` was read, or does its blob
        read well now (deleted and written again meanwhile)?"""
        now = self.catalog.chunk(row.cache_id)
        if now is None or (now.state, now.checksum, now.nbytes) != (
            row.state,
            row.checksum,
            row.nbytes,
        ):
            return True
        return not _reads_bad(row, self.durable.get(row.cache_id, row.nbytes))

    def _readable_rows(self, cache_ids: set[str]) -> tuple[list[ChunkRow], list[str]]:
        """The rows of these chunks, and the IDs of rows that cannot be read (damaged values)."""
        rows: list[ChunkRow] = []
        unreadable: list[str] = []
        ordered = sorted(cache_ids)
        for i in range(0, len(ordered), 1000):
            batch = ordered[i : i + 1000]
            try:
                rows.extend(self.catalog.chunks(batch).values())
                continue
            except (ValueError, TypeError):
                pass
            for cid in batch:  # one by one, to name the bad rows
                try:
                    row = self.catalog.chunk(cid)
                except (ValueError, TypeError):
                    unreadable.append(cid)
                    continue
                if row is not None:
                    rows.append(row)
        settled = []
        for row in rows:  # the encode settings are read with the blob: damage shows here
            try:
                EncodeSettings.from_key(row.encode_settings)
                settled.append(row)
            except (ValueError, TypeError):
                unreadable.append(row.cache_id)
        return settled, unreadable

    def nbytes(self) -> int:
        """Bytes of every stored blob (counted in SQL from the durable tier's placements)."""
        return self.catalog.stats().bytes_per_tier.get(self.durable.name, 0)

    def __len__(self) -> int:
        return self.catalog.stats().chunks_per_state.get("stored", 0)


if TYPE_CHECKING:  # mypy proves that TieredStore has everything of the KVStore protocol
    _satisfies_kvstore: type[KVStore] = TieredStore
