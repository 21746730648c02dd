"""Eviction policies for the hot tiers: which unpinned chunk leaves first.

Each policy only orders keys; the tier enforces budgets and pins.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Protocol


class EvictionPolicy(Protocol):
    def touch(self, key: str) -> None: ...
    def forget(self, key: str) -> None: ...
    def order(self) -> list[str]:
        """Keys, the first to evict first."""
        ...


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._recency: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)

    def forget(self, key: str) -> None:
        self._recency.pop(key, None)

    def order(self) -> list[str]:
        return list(self._recency)


class LFU:
    """Least frequently used first; ties broken by least recent use."""

    def __init__(self) -> None:
        self._hits: Counter[str] = Counter()
        self._lru = LRU()

    def touch(self, key: str) -> None:
        self._hits[key] += 1
        self._lru.touch(key)

    def forget(self, key: str) -> None:
        self._hits.pop(key, None)
        self._lru.forget(key)

    def order(self) -> list[str]:
        rank = {k: i for i, k in enumerate(self._lru.order())}
        return sorted(rank, key=lambda k: (self._hits[k], rank[k]))


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "lfu": LFU}
