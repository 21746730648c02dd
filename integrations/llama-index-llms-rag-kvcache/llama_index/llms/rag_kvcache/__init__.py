"""rag-kvcache's LlamaIndex LLM, where LlamaIndex users look for one, with the pieces that feed
it (ingestion, synthesis, engines, events): names re-exported from
rag_kvcache.integrations.llama_index, the code's one home.

    Settings.llm = KVCacheLLM(RagKVCache())  # index.as_query_engine() links retrieved chunks
"""

from rag_kvcache.integrations.llama_index import (
    CACHE_ID_KEY,
    FirstTokenEvent,
    KVCacheChatEngine,
    KVCacheLLM,
    KVCacheSynthesizer,
    KVCacheTransform,
    KVLinkEvent,
    as_chat_engine,
    as_query_engine,
    token_splitter,
)

__all__ = [
    "CACHE_ID_KEY",
    "FirstTokenEvent",
    "KVCacheChatEngine",
    "KVCacheLLM",
    "KVCacheSynthesizer",
    "KVCacheTransform",
    "KVLinkEvent",
    "as_chat_engine",
    "as_query_engine",
    "token_splitter",
]
