"""rag-kvcache: encode RAG document chunks' KV once, link them at answer time.

Public API: RagKVCache (the engine), its config records, Answer, and the error types.
"""

from rag_kvcache.config import EncodeConfig, EngineConfig, GenerationConfig, ModelConfig
from rag_kvcache.engine import Answer, AnswerStream, RagKVCache
from rag_kvcache.errors import (
    ConfigError,
    ContextTooLongError,
    DtypeMismatchError,
    EmptyChunkError,
    FingerprintMismatchError,
    RagKVCacheError,
    StrategyError,
    UnknownCacheIdError,
    UnsupportedModelError,
)

__all__ = [
    "Answer",
    "AnswerStream",
    "ConfigError",
    "ContextTooLongError",
    "DtypeMismatchError",
    "EmptyChunkError",
    "EncodeConfig",
    "EngineConfig",
    "FingerprintMismatchError",
    "GenerationConfig",
    "ModelConfig",
    "RagKVCache",
    "RagKVCacheError",
    "StrategyError",
    "UnknownCacheIdError",
    "UnsupportedModelError",
]
