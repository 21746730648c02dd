"""Vector search over chunk embeddings: a FAISS inner-product index keyed by cache ID.

Embeddings are unit vectors, so inner product is cosine similarity. FAISS keys are int64, so a
cache ID (hex content hash) maps to the integer of its first 15 hex digits; the reverse map is
kept beside the index. An ID map (`IndexIDMap2`) lets chunks be removed one by one. The file is
FAISS's own binary format (never pickle), written to a temporary name and renamed. FAISS is
imported when an index is first made or read, so paths without retrieval never load it.

The sha256 of both files is written last, beside them (`index.faiss.sha256`); an index whose
files do not match it (damaged, changed by hand, or half written by a killed process) loads
as empty, and the corpus rebuilds it from the catalog's chunk texts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rag_kvcache.errors import RagKVCacheError, StoreError, StoreFullError


@dataclass(frozen=True)
class Retrieved:
    """One retrieval hit: the chunk to link, how similar it is, and where it came from."""

    cache_id: str
    score: float  # cosine similarity to the query
    text: str
    source: str | None


def _faiss() -> Any:
    import faiss

    return faiss


def faiss_id(cache_id: str) -> int:
    """The int64 FAISS key of a cache ID (60 bits of its hash)."""
    try:
        return int(cache_id[:15], 16)
    except ValueError:
        raise RagKVCacheError(f"cache ID {cache_id!r} is not a hex content hash") from None


class VectorIndex:
    """Cache IDs -> unit vectors; `search(vector, k)` -> [(cache_id, score)], best first."""

    def __init__(self, dim: int):
        self.dim = dim
        faiss = _faiss()
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._ids: dict[int, str] = {}

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def cache_ids(self) -> set[str]:
        return set(self._ids.values())

    def add(self, cache_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Add (or replace) vectors [n, dim]."""
        if vectors.shape != (len(cache_ids), self.dim):
            raise RagKVCacheError(
                f"expected {len(cache_ids)} vectors of size {self.dim}, got {vectors.shape}"
            )
        self.remove(cache_ids)
        keys = np.array([faiss_id(c) for c in cache_ids], dtype=np.int64)
        for key, cache_id in zip(keys.tolist(), cache_ids):
            other = self._ids.setdefault(key, cache_id)
            if other != cache_id:
                raise RagKVCacheError(f"cache IDs {other} and {cache_id} share a FAISS key")
        if len(keys):
            self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), keys)

    def remove(self, cache_ids: Iterable[str]) -> int:
        keys = [k for k in (faiss_id(c) for c in cache_ids) if k in self._ids]
        for key in keys:
            del self._ids[key]
        if not keys:
            return 0
        return int(self._index.remove_ids(np.array(keys, dtype=np.int64)))

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        if k < 1:
            raise RagKVCacheError(f"top_k must be >= 1, got {k}")
        if not len(self):
            return []
        query = np.ascontiguousarray(vector.reshape(1, self.dim), dtype=np.float32)
        scores, keys = self._index.search(query, min(k, len(self)))
        return [
            (self._ids[key], float(score))
            for key, score in zip(keys[0].tolist(), scores[0].tolist())
            if key in self._ids
        ]

    def save(self, path: Path, cache_ids_path: Path) -> None:
        """Write the index, its key -> cache ID list and then their checksums (each
        atomically; a kill between two leaves checksums that do not match: rebuilt). Each
        writer has its own temporary names, so processes saving into one folder at once
        never take each other's file."""
        mine = f".{os.getpid()}-{threading.get_ident()}.tmp"
        sums = checksum_path(path)
        tmp, tmp_ids, tmp_sums = (p.with_name(p.name + mine) for p in (path, cache_ids_path, sums))
        try:
            _faiss().write_index(self._index, str(tmp))
            os.replace(tmp, path)
            tmp_ids.write_text("\n".join(self._ids.values()) + "\n", encoding="ascii")
            os.replace(tmp_ids, cache_ids_path)
            tmp_sums.write_text(json.dumps(file_checksums(path, cache_ids_path)), encoding="ascii")
            os.replace(tmp_sums, sums)
        except (OSError, RuntimeError) as err:  # (faiss says RuntimeError, naming the errno)
            for half_written in (tmp, tmp_ids, tmp_sums):  # (they filled the last free space)
                half_written.unlink(missing_ok=True)
            if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
                os.strerror(errno.ENOSPC) in str(err)
            ):
                raise StoreFullError(
                    f"disk full while saving the vector index in {path.parent}: free space"
                ) from err
            raise StoreError(
                f"cannot save the vector index in {path.parent}: {str(err).strip()}"
            ) from err

    @classmethod
    def load(cls, path: Path, cache_ids_path: Path, dim: int) -> VectorIndex:
        """Read a saved index; a missing, unreadable or mismatched file gives an empty one
        (the corpus rebuilds it from the catalog: the index is only a cache of it)."""
        index, faiss = cls(dim), _faiss()
        if not checksums_match(path, cache_ids_path):
            return index
        try:
            loaded = faiss.read_index(str(path))
            ids = cache_ids_path.read_text(encoding="ascii").split()
        except (OSError, RuntimeError, UnicodeDecodeError):
            return index
        try:
            keys = {faiss_id(c): c for c in ids}
        except RagKVCacheError:  # a damaged ID file: rebuilt from the catalog, not fatal
            return index
        if not isinstance(loaded, faiss.IndexIDMap2) or loaded.d != dim:
            return index
        stored = faiss.vector_to_array(loaded.id_map)
        if set(stored.tolist()) != set(keys) or len(keys) != len(ids):
            return index
        index._index = loaded
        index._ids = keys
        return index


def checksum_path(path: Path) -> Path:
    """Where the checksums of an index saved at `path` (and its ID list) are kept."""
    return path.with_name(path.name + ".sha256")


def file_checksums(path: Path, cache_ids_path: Path) -> dict[str, str]:
    return {
        "index": hashlib.sha256(path.read_bytes()).hexdigest(),
        "ids": hashlib.sha256(cache_ids_path.read_bytes()).hexdigest(),
    }


def checksums_match(path: Path, cache_ids_path: Path) -> bool:
    """Whether both files are there and are exactly what `save` wrote last."""
    try:
        recorded = json.loads(checksum_path(path).read_text(encoding="ascii"))
        return bool(recorded == file_checksums(path, cache_ids_path))
    except (OSError, ValueError):
        return False
