"""rag-kvcache's retriever (the engine's FAISS search; nodes carry their chunks' cache IDs) where
LlamaIndex users look for one: re-exported from rag_kvcache.integrations.llama_index, the code's
one home.

    RetrieverQueryEngine.from_args(KVCacheRetriever(engine), llm=KVCacheLLM(engine))
"""

from rag_kvcache.integrations.llama_index import KVCacheRetriever

__all__ = ["KVCacheRetriever"]
