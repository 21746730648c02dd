"""The cached KV of one chunk, and the content hash that names it.

Layout (stated once, used everywhere): `keys` and `values` are `[layers, kv_heads, tokens,
head_dim]`, batch dimension dropped. Keys are stored after RoPE at positions
`start .. start + tokens - 1` (`start` > 0 only when sink tokens were prepended while encoding).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

import torch


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
        return ChunkKV(
            self.cache_id,
            self.fingerprint,
            self.token_ids,
            self.keys.to(device, non_blocking=True),
            self.values.to(device, non_blocking=True),
            self.start,
            self.sink_ids,
        )


class KVStore(Protocol):
    """What the engine needs of a store (MemoryStore, TieredStore)."""

    def register_model(
        self, fingerprint: str, name: str, dtype: str, layers: int, kv_heads: int, head_dim: int
    ) -> None: ...
    def put(self, kv: ChunkKV, text: str = "") -> None: ...
    def get(self, cache_ids: list[str]) -> list[ChunkKV]: ...
    def contains(self, cache_id: str) -> bool: ...
    def remove(self, cache_id: str) -> bool: ...
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
