"""In-process KV store: a dict from cache ID to ChunkKV. Nothing survives the process.

It has no catalog and no folder (`catalog` and `root` are None), so it holds no documents:
retrieval needs a durable store (TieredStore).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from rag_kvcache.errors import UnknownCacheIdError
from rag_kvcache.kv import ChunkKV, Fetched
from rag_kvcache.storage.layout import checked_name, is_name
from rag_kvcache.storage.records import VerifyReport

if TYPE_CHECKING:
    from rag_kvcache.kv import KVStore


class MemoryStore:
    catalog: None = None  # no documents kept
    root: None = None  # no files kept

    def __init__(self) -> None:
        self._chunks: dict[str, ChunkKV] = {}
        self._calibrations: dict[tuple[str, str], bytes] = {}
        self._adapters: dict[str, bytes] = {}

    def register_model(
        self, fingerprint: str, name: str, dtype: str, layers: int, kv_heads: int, head_dim: int
    ) -> None:
        """Nothing to record: the fingerprint travels with each ChunkKV."""

    def put(self, kv: ChunkKV, text: str = "") -> None:
        self._chunks[kv.cache_id] = kv

    def get(self, cache_ids: list[str]) -> list[ChunkKV]:
        """The chunks in order; all missing IDs reported at once."""
        malformed = [c for c in cache_ids if not is_name("cache ID", c)]
        missing = malformed or [c for c in cache_ids if c not in self._chunks]
        if missing:
            raise UnknownCacheIdError(missing)
        return [self._chunks[c] for c in cache_ids]

    def fetch(self, cache_ids: list[str]) -> Fetched:
        """`get`: everything is in memory already."""
        return Fetched(self.get(cache_ids))

    def prefetch(self, cache_ids: list[str]) -> None:
        """Nothing to read ahead: everything is in memory already."""

    def put_calibration(self, fingerprint: str, encode_settings: str, data: bytes) -> str:
        self._calibrations[fingerprint, encode_settings] = bytes(data)
        return hashlib.sha256(data).hexdigest()

    def calibration(self, fingerprint: str, encode_settings: str) -> bytes | None:
        return self._calibrations.get((fingerprint, encode_settings))

    def put_adapter(self, fingerprint: str, data: bytes) -> str:
        self._adapters[fingerprint] = bytes(data)
        return hashlib.sha256(data).hexdigest()

    def adapter(self, fingerprint: str) -> bytes | None:
        return self._adapters.get(fingerprint)

    def contains(self, cache_id: str) -> bool:
        return checked_name("cache ID", cache_id) in self._chunks

    def remove(self, cache_id: str) -> bool:
        return self._chunks.pop(checked_name("cache ID", cache_id), None) is not None

    def forget_orphan(self, cache_id: str) -> None:
        """`TieredStore.forget_orphan`: here, one process and no rows: `remove`."""
        self.remove(cache_id)

    def set_pinned(self, cache_id: str, pinned: bool) -> None:
        """Nothing here is ever evicted, so a pin changes nothing; an unknown ID is an error."""
        if checked_name("cache ID", cache_id) not in self._chunks:
            raise UnknownCacheIdError([cache_id])

    def verify(
        self, repair: bool = True, on_checked: Callable[[], None] | None = None
    ) -> VerifyReport:
        """Nothing can be corrupt or missing: the chunks are live tensors, never serialized."""
        for _ in self._chunks:
            if on_checked:
                on_checked()
        return VerifyReport(len(self._chunks), [], [], 0)

    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)


if TYPE_CHECKING:  # mypy proves that MemoryStore has everything of the KVStore protocol
    _satisfies_kvstore: type[KVStore] = MemoryStore
