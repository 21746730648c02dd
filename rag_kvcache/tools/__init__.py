"""Tools apart from the library core: the `rag-kvcache` CLI, evaluation and benchmarks. They
use the public API (`RagKVCache`); nothing in the core imports them.
"""
