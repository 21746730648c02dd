"""rag-kvcache's embedding model (all-MiniLM-L6-v2, the one its retrieval uses) where LlamaIndex
users look for one: re-exported from rag_kvcache.integrations.llama_index, the code's one home.

    Settings.embed_model = MiniLMEmbedding()
"""

from rag_kvcache.integrations.llama_index import MiniLMEmbedding

__all__ = ["MiniLMEmbedding"]
