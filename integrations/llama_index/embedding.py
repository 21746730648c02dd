"""MiniLMEmbedding: the engine's own sentence embedder as a LlamaIndex embed model, so a
VectorStoreIndex works offline and ranks chunks exactly as the engine's FAISS index does."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr

from rag_kvcache.retrieval.embedding import Embedder


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 unit vectors (cosine similarity = dot product). Queries and documents
    are embedded alike (the model is symmetric)."""

    _embedder: Embedder = PrivateAttr()

    def __init__(self, embedder: Embedder | None = None, **kwargs: Any):
        embedder = embedder or Embedder.shared()
        kwargs.setdefault("model_name", embedder.name)
        kwargs.setdefault("embed_batch_size", embedder.batch_size)
        super().__init__(**kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    @property
    def dim(self) -> int:
        return self._embedder.dim

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return [[float(x) for x in row] for row in self._embedder.embed(texts)]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._get_text_embeddings([query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)  # CPU-bound: nothing to await

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embedding(text)
