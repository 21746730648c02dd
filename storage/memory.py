"""In-process KV store: a dict from cache ID to ChunkKV. Nothing survives the process."""

from __future__ import annotations

from rag_kvcache.errors import UnknownCacheIdError
from rag_kvcache.kv import ChunkKV


class MemoryStore:
    def __init__(self) -> None:
        self._chunks: dict[str, ChunkKV] = {}

    def register_model(
        self, fingerprint: str, name: str, dtype: str, layers: int, kv_heads: int, head_dim: int
    ) -> None:
        """Nothing to record: the fingerprint travels with each ChunkKV."""

    def put(self, kv: ChunkKV, text: str = "") -> None:
        self._chunks[kv.cache_id] = kv

    def get(self, cache_ids: list[str]) -> list[ChunkKV]:
        """The chunks in order; all missing IDs reported at once."""
        missing = [c for c in cache_ids if c not in self._chunks]
        if missing:
            raise UnknownCacheIdError(missing)
        return [self._chunks[c] for c in cache_ids]

    def contains(self, cache_id: str) -> bool:
        return cache_id in self._chunks

    def remove(self, cache_id: str) -> bool:
        return self._chunks.pop(cache_id, None) is not None

    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)
