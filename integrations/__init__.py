"""Adapters to other libraries (imported as rag_kvcache.integrations); each optional."""
