"""KV stores (imported as rag_kvcache.storage)."""

from rag_kvcache.storage.memory import MemoryStore

__all__ = ["MemoryStore"]
