"""LlamaIndex adapters for rag-kvcache: ingest nodes into the KV store, retrieve cache IDs, and
answer with an LLM that links the retrieved chunks' cached KV instead of prefilling them.

    engine = RagKVCache(EngineConfig(store=StoreConfig(root="kv")))  # durable: has retrieval
    pipeline = IngestionPipeline(
        transformations=[
            token_splitter(engine.lm.tokenizer, chunk_tokens=256),  # sized in the LM's tokens
            KVCacheTransform(engine, index_documents=True),
        ]
    )
    pipeline.run(documents=docs)
    as_query_engine(engine).query("...")  # or as_query_engine(engine, index=my_vector_index)

Only this package imports llama_index (the `llama-index` extra: `pip install
"rag-kvcache[llama-index]"`); the engine never does.
"""

from rag_kvcache.extras import missing_extra

try:
    import llama_index.core  # noqa: F401
except ModuleNotFoundError as err:  # the one place that tells a user without the extra
    if err.name not in ("llama_index", "llama_index.core"):
        raise
    raise missing_extra(err, "llama-index", "rag_kvcache.integrations.llama_index") from err

from rag_kvcache.integrations.llama_index.chat_engine import KVCacheChatEngine
from rag_kvcache.integrations.llama_index.embedding import MiniLMEmbedding
from rag_kvcache.integrations.llama_index.engines import as_chat_engine, as_query_engine
from rag_kvcache.integrations.llama_index.events import FirstTokenEvent, KVLinkEvent
from rag_kvcache.integrations.llama_index.llm import KVCacheLLM
from rag_kvcache.integrations.llama_index.retriever import KVCacheRetriever
from rag_kvcache.integrations.llama_index.splitter import token_splitter
from rag_kvcache.integrations.llama_index.synthesizer import KVCacheSynthesizer
from rag_kvcache.integrations.llama_index.transform import CACHE_ID_KEY, KVCacheTransform

__all__ = [
    "CACHE_ID_KEY",
    "FirstTokenEvent",
    "KVCacheChatEngine",
    "KVCacheLLM",
    "KVCacheRetriever",
    "KVCacheSynthesizer",
    "KVCacheTransform",
    "KVLinkEvent",
    "MiniLMEmbedding",
    "as_chat_engine",
    "as_query_engine",
    "token_splitter",
]
