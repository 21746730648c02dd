"""One-call builders: a LlamaIndex query engine or chat engine whose answers link cached KV."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.indices.base import BaseIndex
from llama_index.core.query_engine import RetrieverQueryEngine

from rag_kvcache.engine import RagKVCache
from rag_kvcache.integrations.llama_index.chat_engine import KVCacheChatEngine
from rag_kvcache.integrations.llama_index.llm import KVCacheLLM
from rag_kvcache.integrations.llama_index.retriever import KVCacheRetriever
from rag_kvcache.integrations.llama_index.synthesizer import KVCacheSynthesizer


def pick_retriever(
    engine: RagKVCache,
    retriever: BaseRetriever | None,
    index: BaseIndex | None,
    similarity_top_k: int,
) -> BaseRetriever:
    """The caller's retriever, else the index's (its nodes should carry cache IDs, e.g. built
    through KVCacheTransform; untagged ones get encoded at answer time), else the engine's."""
    if retriever is not None and index is not None:
        raise ValueError("pass a retriever or an index, not both")
    if retriever is not None:
        return retriever
    if index is not None:
        return index.as_retriever(similarity_top_k=similarity_top_k)
    return KVCacheRetriever(engine, similarity_top_k=similarity_top_k)


def as_query_engine(
    engine: RagKVCache,
    retriever: BaseRetriever | None = None,
    index: BaseIndex | None = None,
    similarity_top_k: int = 4,
    strategy: str | None = None,
    streaming: bool = False,
    max_new_tokens: int | None = None,
    **kwargs: Any,
) -> RetrieverQueryEngine:
    """A RetrieverQueryEngine that answers by linking the retrieved chunks' cached KV.

    kwargs go to RetrieverQueryEngine (e.g. node_postprocessors, callback_manager).
    """
    llm = KVCacheLLM(engine, strategy=strategy, max_new_tokens=max_new_tokens)
    return RetrieverQueryEngine(
        retriever=pick_retriever(engine, retriever, index, similarity_top_k),
        response_synthesizer=KVCacheSynthesizer(llm, streaming=streaming),
        **kwargs,
    )


def as_chat_engine(
    engine: RagKVCache,
    retriever: BaseRetriever | None = None,
    index: BaseIndex | None = None,
    similarity_top_k: int = 4,
    strategy: str | None = None,
    max_new_tokens: int | None = None,
    condense: bool = False,
    **kwargs: Any,
) -> KVCacheChatEngine:
    """A chat engine over cached chunks (see KVCacheChatEngine for how turns are answered).

    `condense` (off by default) has the LLM rewrite each follow-up as a standalone question
    before retrieval. Worth it with a capable model; the default SmolLM2-135M answers the
    condense prompt instead of rephrasing it, which sends retrieval astray, while retrieving on
    the raw follow-up still finds the right chunk and the history reaches the answer anyway.
    kwargs go to KVCacheChatEngine (e.g. memory, chat_history, node_postprocessors, verbose).
    """
    return KVCacheChatEngine(
        pick_retriever(engine, retriever, index, similarity_top_k),
        KVCacheLLM(engine, strategy=strategy, max_new_tokens=max_new_tokens),
        skip_condense=not condense,
        **kwargs,
    )
