"""KV stores: the SQL catalog, the blob tiers (GPU, CPU, disk, Redis) and the tiered store over
them. Imported as `rag_kvcache.storage` only."""

if __name__ != "rag_kvcache.storage":  # the folder is reached through the link rag_kvcache/storage
    raise ImportError(f"import this package as rag_kvcache.storage, not {__name__}")

from rag_kvcache.storage.memory import MemoryStore

__all__ = ["MemoryStore"]
