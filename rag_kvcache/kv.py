"""The cached KV of one chunk, the content hash that names it, and the protocol of its stores.

Layout (stated once, used everywhere): `keys` and `values` are `[layers, kv_heads, tokens,
head_dim]`, batch dimension dropped. Keys are stored after RoPE at positions
`start .. start + tokens - 1` (`start` > 0 only when sink tokens were prepended while encoding).

A chunk read cold from disk may still be arriving, layer by layer, when a request gets it
(`ChunkKV.arrival`, `KVStore.fetch`): its tensors have their shapes but not all their bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # plain records; storage itself imports this module
    from rag_kvcache.storage.records import CatalogStats, ChunkRow, DocumentRow, VerifyReport


@dataclass(frozen=True)
class EncodeSettings:
    """What, besides the tokens and the model, changes a chunk's KV."""

    sink_ids: tuple[int, ...] = ()

    def key(self) -> str:
        return "sinks=" + ",".join(map(str, self.sink_ids))

    @classmethod
    def from_key(cls, key: str) -> EncodeSettings:
        """Inverse of key(): the catalog keeps settings as this string."""
        sinks = key.removeprefix("sinks=")
        return cls(tuple(int(t) for t in sinks.split(",") if t))


def make_cache_id(fingerprint: str, settings: EncodeSettings, token_ids: list[int]) -> str:
    """Content hash of (model fingerprint, encode settings, token ids): stable across processes."""
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0" + settings.key().encode() + b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()[:32]


class Arrival(Protocol):
    """KV being read into chunks' tensors one layer at a time, in layer order: a reader of
    layer i waits for it first. Every chunk of one fetch shares one Arrival."""

    def wait(self, layer: int) -> None:
        """Return once layer `layer` of every chunk has arrived."""
        ...

    def wait_all(self) -> None:
        """Return once every layer has arrived."""
        ...

    def arrived(self) -> int:
        """How many layers, from the first, have arrived (in every chunk)."""
        ...


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's token ids and KV, encoded alone (see module docstring for the layout)."""

    cache_id: str
    fingerprint: str
    token_ids: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], RoPE'd at start + i
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    start: int = 0
    sink_ids: tuple[int, ...] = ()  # the sinks it was encoded after (start == len(sink_ids))
    # set while the KV is still being read (only `link`'s layer-by-layer placement waits on
    # it; anything else reading the tensors calls `whole()` first)
    arrival: Arrival | None = field(default=None, compare=False, repr=False)

    def whole(self) -> ChunkKV:
        """This chunk once every layer of its KV has arrived."""
        if self.arrival is not None:
            self.arrival.wait_all()
        return self

    @property
    def settings(self) -> EncodeSettings:
        return EncodeSettings(self.sink_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def to(self, device: torch.device | str) -> ChunkKV:
        if self.keys.device == torch.device(device):
            return self
        self.whole()
        return ChunkKV(
            self.cache_id,
            self.fingerprint,
            self.token_ids,
            self.keys.to(device, non_blocking=True),
            self.values.to(device, non_blocking=True),
            self.start,
            self.sink_ids,
        )


@dataclass(frozen=True)
class Fetched:
    """Chunks as a store hands them to one request (`KVStore.fetch`): some may still be
    arriving. `settle()`, once the request has computed with them, waits for every read and
    checks it: True when all checked out; False when a blob failed its checksum, and the
    request must be computed again from `get` (which repairs the blob)."""

    chunks: list[ChunkKV]
    settle: Callable[[], bool] = field(default=lambda: True)


# The catalog counter bumped whenever the set of documented chunks changes (a document set or
# removed, a listed chunk deleted): every process's vector index compares it with the value it
# last saw, and syncs when it moved.
DOCUMENTS_VERSION = "corpus-version"


class DocumentCatalog(Protocol):
    """The documents of a durable store, as its catalog keeps them: what the corpus, ingestion
    and the tools read and write (`rag_kvcache.storage.catalog.Catalog` is one)."""

    def documents(self) -> list[DocumentRow]: ...
    def document(self, source: str) -> DocumentRow | None: ...
    def document_chunks(self, source: str) -> list[str]: ...
    def document_models(self, source: str) -> set[str]: ...
    def documented_ids(self) -> set[str]: ...
    def set_document(
        self, source: str, content_hash: str, cache_ids: Sequence[str]
    ) -> tuple[DocumentRow, list[str]]: ...
    def remove_document(self, source: str) -> list[str]: ...
    def sources(self, cache_ids: Iterable[str]) -> dict[str, str]: ...
    def chunks(self, cache_ids: Iterable[str]) -> dict[str, ChunkRow]: ...
    def count(self, name: str, by: int = 1) -> None: ...
    def counters(self) -> dict[str, int]: ...
    def stats(self) -> CatalogStats: ...


class KVStore(Protocol):
    """What the engine, the corpus and ingestion need of a store (MemoryStore, TieredStore).

    `catalog` and `root` are a store's durable side: a store that keeps documents has both (the
    catalog, and the folder where the vector index is saved beside it); one that keeps only KV
    in memory has None for both, and documents and retrieval are then unavailable. How a lost
    or corrupt blob is re-encoded is given when a store is built (TieredStore's `reencode`).
    """

    def register_model(
        self, fingerprint: str, name: str, dtype: str, layers: int, kv_heads: int, head_dim: int
    ) -> None: ...
    def put(self, kv: ChunkKV, text: str = "") -> None: ...
    def get(self, cache_ids: list[str]) -> list[ChunkKV]: ...
    def fetch(self, cache_ids: list[str]) -> Fetched: ...
    def prefetch(self, cache_ids: list[str]) -> None: ...
    def put_calibration(self, fingerprint: str, encode_settings: str, data: bytes) -> str: ...
    def calibration(self, fingerprint: str, encode_settings: str) -> bytes | None: ...
    def put_adapter(self, fingerprint: str, data: bytes) -> str: ...
    def adapter(self, fingerprint: str) -> bytes | None: ...
    def contains(self, cache_id: str) -> bool: ...
    def remove(self, cache_id: str) -> bool: ...
    def forget_orphan(self, cache_id: str) -> None: ...
    def set_pinned(self, cache_id: str, pinned: bool) -> None: ...
    def verify(
        self, repair: bool = True, on_checked: Callable[[], None] | None = None
    ) -> VerifyReport: ...
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def catalog(self) -> DocumentCatalog | None: ...
    @property
    def root(self) -> Path | None: ...
