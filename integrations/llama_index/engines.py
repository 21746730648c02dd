"""One-call builders: a LlamaIndex query engine or chat engine whose answers link cached KV."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.indices.base import BaseIndex
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import (
    BaseSynthesizer,
    ResponseMode,
    get_response_synthesizer,
)

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
    response_mode: str | ResponseMode | None = None,
    text_qa_template: BasePromptTemplate | None = None,
    **kwargs: Any,
) -> RetrieverQueryEngine:
    """A RetrieverQueryEngine that answers by linking the retrieved chunks' cached KV.

    `response_mode` None or "compact": one linked call over all the retrieved chunks
    (KVCacheSynthesizer; `text_qa_template` sets its question). Another mode ("refine",
    "tree_summarize", ...) is LlamaIndex's own synthesizer for it, whose LLM calls link the
    chunks they hold (KVCacheLLM's `link_retrieved`); LlamaIndex's template arguments
    (`refine_template`, `summary_template`, ...) go to it. Other kwargs go to
    RetrieverQueryEngine (e.g. node_postprocessors, callback_manager).
    """
    llm = KVCacheLLM(engine, strategy=strategy, max_new_tokens=max_new_tokens)
    templates = {k: kwargs.pop(k) for k in SYNTHESIZER_TEMPLATES if k in kwargs}
    synthesizer: BaseSynthesizer
    if response_mode in (None, ResponseMode.COMPACT, "compact") and not templates:
        synthesizer = KVCacheSynthesizer(
            llm, streaming=streaming, text_qa_template=text_qa_template
        )
    else:
        if text_qa_template is not None:
            templates["text_qa_template"] = text_qa_template
        synthesizer = get_response_synthesizer(
            llm=llm,
            response_mode=ResponseMode(response_mode or ResponseMode.COMPACT),
            streaming=streaming,
            **templates,
        )
    return RetrieverQueryEngine(
        retriever=pick_retriever(engine, retriever, index, similarity_top_k),
        response_synthesizer=synthesizer,
        **kwargs,
    )


# get_response_synthesizer's prompt arguments, passed through by as_query_engine
SYNTHESIZER_TEMPLATES = (
    "refine_template",
    "summary_template",
    "simple_template",
    "output_cls",
    "structured_answer_filtering",
    "use_async",
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
