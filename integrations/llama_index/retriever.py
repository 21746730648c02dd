"""KVCacheRetriever: the engine's FAISS search as a LlamaIndex retriever. Its nodes carry their
cache IDs, so the synthesizer links the stored KV and never re-encodes retrieved text."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rag_kvcache.config import whole_number
from rag_kvcache.engine import RagKVCache
from rag_kvcache.integrations.llama_index.embedding import MiniLMEmbedding
from rag_kvcache.integrations.llama_index.pickling import PickledEngine, pickled
from rag_kvcache.integrations.llama_index.transform import attach_cache_id

SOURCE_KEY = "source"  # the document's name in the engine's corpus (a file's path, as ingested)
FILE_NAME_KEY = "file_name"  # its last part, as LlamaIndex's readers name a file


class KVCacheRetriever(BaseRetriever):
    """Top-k chunks for a query from `engine.retrieve`, best first, as TextNodes whose id is the
    cache ID (metadata: cache_id, source document and its file name, all hidden from embedding
    and LLM text: the chunk's text is what was embedded and cached). A QueryBundle's
    `custom_embedding_strs` (HyDE) are searched with, as LlamaIndex's own vector retrievers
    do; its `embedding` is not (it may be another retriever's, of another model)."""

    def __init__(self, engine: RagKVCache, similarity_top_k: int = 4, **kwargs: Any):
        similarity_top_k = whole_number("similarity_top_k", similarity_top_k)  # a ValueError
        super().__init__(**kwargs)
        self._engine = engine
        self.similarity_top_k = similarity_top_k

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its engine's configuration and its top-k, as KVCacheLLM is: unpickling
        opens an engine on it (`pickling`), as this class (a subclass stays one). Callbacks,
        verbosity and a subclass's own attributes are not carried."""
        return (_unpickled, (type(self), pickled(self._engine), self.similarity_top_k))

    def __copy__(self) -> KVCacheRetriever:
        """A copy over the same engine (`copy.copy` would otherwise go through `__reduce__`,
        whose reference to the engine only pickling turns back into one)."""
        return type(self)(self._engine, similarity_top_k=self.similarity_top_k)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # the bundle's embedding strings where they are not the query's own (HyDE's
        # hypothetical answer with the question), averaged as LlamaIndex's retrievers do; they
        # were ignored, and HyDE did nothing. Its `embedding` is not read: other retrievers
        # write theirs into a bundle they share (QueryFusionRetriever), of another model
        embedding = None
        if query_bundle.custom_embedding_strs:
            embed_model = MiniLMEmbedding(self._engine.corpus.embedder)
            embedding = embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs)
        hits = self._engine.retrieve(
            query_bundle.query_str, top_k=self.similarity_top_k, embedding=embedding
        )
        nodes = []
        for hit in hits:
            metadata = {SOURCE_KEY: hit.source}
            if hit.source:
                metadata[FILE_NAME_KEY] = PurePath(hit.source).name
            node = TextNode(
                id_=hit.cache_id,
                text=hit.text,
                metadata=metadata,
                # the chunk's text is what was embedded and cached: its facts stay beside it
                excluded_embed_metadata_keys=list(metadata),
                excluded_llm_metadata_keys=list(metadata),
            )
            nodes.append(NodeWithScore(node=attach_cache_id(node, hit.cache_id), score=hit.score))
        return nodes


def _unpickled(
    cls: type[KVCacheRetriever], engine: RagKVCache | PickledEngine, similarity_top_k: int
) -> KVCacheRetriever:
    if not isinstance(engine, RagKVCache):  # a PickledEngine unpickles as the engine it
        raise TypeError(f"a retriever needs an engine, not {type(engine).__name__}")  # names
    return cls(engine, similarity_top_k=similarity_top_k)
