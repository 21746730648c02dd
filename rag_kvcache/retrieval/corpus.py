"""The documents of a durable store and the vector index over their chunks, kept consistent.

The catalog is the truth (which documents exist, which chunks each lists); the FAISS index is a
cache of it, saved beside the catalog. It is checked against the catalog when opened and
whenever another process changed the corpus (a version counter in the catalog), so a search
never returns a chunk that no document lists any more, and a lost index file is rebuilt from
the chunk texts the catalog keeps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag_kvcache.errors import ConfigError, FingerprintMismatchError, StoreError
from rag_kvcache.kv import DOCUMENTS_VERSION, DocumentCatalog, KVStore
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.retrieval.index import Retrieved, VectorIndex

if TYPE_CHECKING:
    from rag_kvcache.storage.records import ChunkRow

EMBED_CHUNKS = 512  # chunk rows read and embedded at a time
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncReport:
    added: int  # chunks embedded into the index because the catalog lists them
    removed: int  # index entries dropped because no document lists them


class Corpus:
    """Documents -> chunks (catalog) and chunk -> embedding (FAISS), for one durable store:
    `catalog` is its catalog, `folder` where the index files are saved (its `root`)."""

    def __init__(self, store: KVStore, catalog: DocumentCatalog, folder: Path, embedder: Embedder):
        self.store = store
        self.catalog = catalog
        self.embedder = embedder
        self.index_path = folder / "index.faiss"
        self.ids_path = folder / "index.ids"
        self.index = VectorIndex.load(self.index_path, self.ids_path, embedder.dim)
        self._version = -1
        # one thread at a time changes or reads the index (threads ingesting one document at
        # once failed with a KeyError); other processes are followed by the version counter
        self._lock = threading.RLock()
        self.sync()

    def sync(self) -> SyncReport:
        """Make the index hold exactly the chunks some document lists."""
        with self._lock:
            return self._sync()

    def _sync(self) -> SyncReport:
        version = self._current_version()
        wanted = self.catalog.documented_ids()
        have = self.index.cache_ids()
        missing = sorted(wanted - have)
        extra = have - wanted
        self.index.remove(extra)
        self._embed(missing)
        if missing or extra:
            self._save()
        self._version = version
        return SyncReport(len(missing), len(extra))

    def set_document(self, source: str, content_hash: str, cache_ids: list[str]) -> list[str]:
        """Record a document's chunks (already in the store) and index them; drop the chunks it
        no longer has (unless another document lists them). Returns the dropped cache IDs.
        Its new chunks are embedded before the lock is taken: the slow part, which held up
        every retrieval of the process meanwhile."""
        with self._lock:
            have = self.index.cache_ids()
        ready = self._vectors([c for c in dict.fromkeys(cache_ids) if c not in have])
        with self._lock:
            _, orphans = self.catalog.set_document(source, content_hash, cache_ids)
            self._changed(cache_ids, orphans, ready)
        return orphans

    def remove_document(self, source: str) -> list[str]:
        """Forget a document and the chunks only it listed. Returns those cache IDs."""
        with self._lock:
            orphans = self.catalog.remove_document(source)
            self._changed([], orphans)
        return orphans

    def _changed(
        self, listed: list[str], orphans: list[str], ready: dict[str, np.ndarray] | None = None
    ) -> None:
        for cache_id in orphans:  # (their rows went in the catalog's transaction)
            self.store.forget_orphan(cache_id)
        version = self._current_version()
        if version != self._version:
            self._sync()  # another process changed the corpus since we last looked
        have = self.index.cache_ids()
        self._embed([c for c in dict.fromkeys(listed) if c not in have], ready)
        self.index.remove(orphans)
        self._save()
        self.catalog.count(DOCUMENTS_VERSION)
        self._version = version + 1  # a later mismatch means someone else wrote meanwhile

    def _save(self) -> None:
        """Save the index beside the catalog. It is a cache of the catalog, so a full disk (or
        another failed write) costs only the saved copy (other processes sync theirs from the
        catalog, or rebuild it): a warning, and retrieval goes on from this one, where a query
        used to fail."""
        try:
            self.index.save(self.index_path, self.ids_path)
        except StoreError as err:
            log.warning("%s; retrieval goes on from the index in memory", err)

    def _embed(self, cache_ids: list[str], ready: dict[str, np.ndarray] | None = None) -> None:
        """Add these chunks to the index: the vectors `ready` holds, the others embedded."""
        ready = ready or {}
        vectors = ready | self._vectors([c for c in cache_ids if c not in ready])
        batch = [c for c in cache_ids if c in vectors]
        if batch:
            self.index.add(batch, np.stack([vectors[c] for c in batch]))

    def _vectors(self, cache_ids: list[str]) -> dict[str, np.ndarray]:
        """The embeddings of the texts the catalog keeps for these chunks, read EMBED_CHUNKS at
        a time (a big file's rows, token IDs included, are never all in memory at once). A
        chunk another process's replacement of its document removed meanwhile is gone from
        the catalog: none (that process's version bump is seen next)."""
        out: dict[str, np.ndarray] = {}
        for i in range(0, len(cache_ids), EMBED_CHUNKS):
            rows = self.catalog.chunks(cache_ids[i : i + EMBED_CHUNKS])
            batch = [c for c in cache_ids[i : i + EMBED_CHUNKS] if c in rows]
            if batch:
                out.update(
                    zip(batch, self.embedder.embed([rows[c].text for c in batch]), strict=True)
                )
        return out

    def _current_version(self) -> int:
        return self.catalog.counters().get(DOCUMENTS_VERSION, 0)

    def search(
        self,
        query: str,
        top_k: int = 4,
        fingerprint: str | None = None,
        embedding: Sequence[float] | None = None,
    ) -> list[Retrieved]:
        """The top_k chunks most similar to `query` (or to `embedding`, a vector of the
        embedder's, where given), best first. With `fingerprint` (the model asking), a hit
        encoded by another model is a FingerprintMismatchError naming its documents: a
        document's chunks are one model's (the last that ingested it), and the error says
        what to do, where linking would only name a chunk."""
        if embedding is None:
            vector = self.embedder.embed([query])[0]
        else:
            vector = self.query_vector(embedding)
        with self._lock:
            if self._current_version() != self._version:
                self._sync()
            hits, rows = self._servable_hits(vector, top_k)
        sources = self.catalog.sources(rows)
        others = {r.fingerprint for r in rows.values() if fingerprint not in (None, r.fingerprint)}
        if others:
            documents = sorted(
                {sources.get(c, c) for c, r in rows.items() if r.fingerprint in others}
            )
            raise FingerprintMismatchError(
                f"retrieval found {', '.join(map(repr, documents))}, last ingested with another "
                f"model ({', '.join(sorted(others))}), not the one asking ({fingerprint}): a "
                "store keeps one model's KV per document; ingest them again with this model "
                "(which replaces the other's copies), or give each model its own store"
            )
        return [Retrieved(c, score, rows[c].text, sources.get(c)) for c, score in hits]

    def query_vector(self, embedding: object) -> np.ndarray:
        """A caller's query embedding as the unit vector the index compares (cosine), or a
        ConfigError: another length is another embedding model's (FAISS would crash, or read
        it wrongly), text or booleans are no vector, and a zero or non-finite one ranks
        nothing. Any scale of a vector is that vector."""
        dim = self.embedder.dim
        try:
            vector = np.asarray(embedding)
        except (TypeError, ValueError, RuntimeError):  # ragged, a tensor numpy cannot read
            vector = np.asarray(None)
        given = f"got {type(embedding).__name__}"
        if vector.dtype.kind in "iuf":
            given += f" of shape {vector.shape}"
        norm = 0.0
        if vector.dtype.kind in "iuf" and vector.shape == (dim,):
            vector = vector.astype(np.float64)
            largest = float(np.max(np.abs(vector)))  # (scaled by it first: 1e200 or 1e-320
            if np.isfinite(largest) and largest > 0:  # times a vector is that vector)
                vector = vector / largest
            norm = float(np.linalg.norm(vector))
            given += " that is zero or not finite"
        if not (np.isfinite(norm) and norm > 0):
            raise ConfigError(
                f"a query embedding must be {dim} finite numbers, not all zero, from the "
                f"engine's embedding model ({self.embedder.name}); {given}"
            )
        return (vector / norm).astype(np.float32)

    def _servable_hits(
        self, vector: np.ndarray, top_k: int
    ) -> tuple[list[tuple[str, float]], dict[str, ChunkRow]]:
        """The top_k nearest chunks a request can use, and their rows. A documented chunk past
        its time to live (`TieredStore.put(ttl_s=...)`) stays in the index, as it does once gc
        has removed it: it is skipped and the index asked for more, not handed out for the
        answer to refuse."""
        asked = top_k
        rows: dict[str, ChunkRow] = {}
        while True:
            hits = self.index.search(vector, asked)
            now = datetime.now(UTC)
            rows |= self.catalog.chunks([c for c, _ in hits if c not in rows])  # the new ones
            kept = [(c, score) for c, score in hits if c in rows and rows[c].servable(now)]
            if len(kept) >= top_k or len(hits) < asked:  # enough, or the index has no more
                return kept[:top_k], {c: rows[c] for c, _ in kept[:top_k]}
            asked *= 2
