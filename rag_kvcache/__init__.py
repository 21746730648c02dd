"""rag-kvcache: encode RAG document chunks' KV once, link them at answer time.

Public API: RagKVCache (the engine), its config records, Answer, and the error types.
The engine-backed names load torch and transformers on first use (PEP 562), so importing
the package, or a light module in it, stays fast (the command line's `--help`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rag_kvcache.config import EncodeConfig, EngineConfig, GenerationConfig, ModelConfig
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

if TYPE_CHECKING:
    from rag_kvcache.engine import Answer, AnswerStream, RagKVCache

_FROM_ENGINE = ("Answer", "AnswerStream", "RagKVCache")


def __getattr__(name: str) -> Any:
    if name in _FROM_ENGINE:
        value = getattr(importlib.import_module("rag_kvcache.engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rag_kvcache' has no attribute {name!r}")


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
