"""The KVStore protocol, checked by mypy in `make lint` (not a test: pytest never collects this).

Both stores and the catalog satisfy the protocols; a store without `verify`, or whose `get`
takes one ID, does not. Those two assignments carry `type: ignore[assignment]`, and with
`warn_unused_ignores` mypy fails if one of them ever stops being an error (a weakened protocol).
"""

from pathlib import Path

from rag_kvcache.kv import ChunkKV, DocumentCatalog, KVStore
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.storage.store import TieredStore

memory: KVStore = MemoryStore()
tiered: KVStore = TieredStore(Path("kv"))
catalog: DocumentCatalog = Catalog(path=Path("catalog.sqlite"))


class WithoutVerify(MemoryStore):
    verify = None  # type: ignore[assignment]


class GetOfOneId(MemoryStore):
    def get(self, cache_id: str) -> list[ChunkKV]:  # type: ignore[override]
        return []


no_verify: KVStore = WithoutVerify()  # type: ignore[assignment]
one_id: KVStore = GetOfOneId()  # type: ignore[assignment]
