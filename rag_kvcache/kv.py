"""The cached KV of one chunk, and the content hash that names it.

Layout (stated once, used everywhere): `keys` and `values` are `[layers, kv_heads, tokens,
head_dim]`, batch dimension dropped. Keys are stored after RoPE at positions
`start .. start + tokens - 1` (`start` > 0 only when sink tokens were prepended while encoding).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncodeSettings:
    """What, besides the tokens and the model, changes a chunk's KV."""

    sink_ids: tuple[int, ...] = ()

    def key(self) -> str:
        return "sinks=" + ",".join(map(str, self.sink_ids))


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
        )
