"""A hot tier: ready-to-use ChunkKV in CPU or GPU memory under a byte budget.

Hot tiers are caches over the durable tier, so evicting loses nothing. Pinned chunks are
never evicted; a chunk bigger than the budget (after pins) is simply not cached. A tier is
shared by the engine loop's thread and the threads that encode or fetch beside it, so every
method holds the tier's lock (reads are a dict lookup: the lock costs next to nothing).
On a CUDA machine the CPU tier keeps pinned host memory, so copies to the GPU can overlap.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from rag_kvcache.errors import ConfigError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.storage.policy import POLICIES, EvictionPolicy


class MemoryTier:
    def __init__(self, name: str, budget_bytes: int, device: str = "cpu", policy: str = "lru"):
        if budget_bytes < 0:
            raise ConfigError(f"tier {name}: budget_bytes must be >= 0, got {budget_bytes}")
        if policy not in POLICIES:
            raise ConfigError(f"tier {name}: policy {policy!r} is not one of {sorted(POLICIES)}")
        self.name, self.budget, self.device = name, budget_bytes, torch.device(device)
        self._policy: EvictionPolicy = POLICIES[policy]()
        self._chunks: dict[str, ChunkKV] = {}
        self._pinned: set[str] = set()
        self._bytes = 0
        self.pin_memory = self.device.type == "cpu" and torch.cuda.is_available()
        self._lock = threading.RLock()

    def get(self, cache_id: str) -> ChunkKV | None:
        with self._lock:
            kv = self._chunks.get(cache_id)
            if kv is not None:
                self._policy.touch(cache_id)
            return kv

    def put(self, kv: ChunkKV, pinned: bool = False) -> list[str]:
        """Hold kv (moved to this tier's device); returns the IDs evicted to make room."""
        with self._lock:
            return self._put(kv, pinned)

    def _put(self, kv: ChunkKV, pinned: bool) -> list[str]:
        if kv.cache_id in self._chunks:
            self._policy.touch(kv.cache_id)
            if pinned:
                self._pinned.add(kv.cache_id)
            return []
        evicted = self._make_room(kv.nbytes)
        if evicted is None:
            return []  # cannot fit beside the pinned chunks
        local = kv.to(self.device)
        if self.pin_memory:
            local = replace(local, keys=local.keys.pin_memory(), values=local.values.pin_memory())
        self._chunks[kv.cache_id] = local
        self._bytes += kv.nbytes
        self._policy.touch(kv.cache_id)
        if pinned:
            self._pinned.add(kv.cache_id)
        return evicted

    def _make_room(self, nbytes: int) -> list[str] | None:
        pinned_bytes = sum(self._chunks[k].nbytes for k in self._pinned if k in self._chunks)
        if nbytes > self.budget - pinned_bytes:
            return None
        evicted = []
        for key in self._policy.order():
            if self._bytes + nbytes <= self.budget:
                break
            if key not in self._pinned:
                self.remove(key)
                evicted.append(key)
        return evicted

    def set_pinned(self, cache_id: str, pinned: bool) -> None:
        with self._lock:
            (self._pinned.add if pinned else self._pinned.discard)(cache_id)

    def contains(self, cache_id: str) -> bool:
        return cache_id in self._chunks

    def remove(self, cache_id: str) -> bool:
        with self._lock:
            kv = self._chunks.pop(cache_id, None)
            if kv is None:
                return False
            self._bytes -= kv.nbytes
            self._policy.forget(cache_id)
            self._pinned.discard(cache_id)
            return True

    def nbytes(self) -> int:
        return self._bytes

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._chunks)
