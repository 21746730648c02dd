"""LlamaIndex's sentence-aware node parser, sized in the language model's own tokens.

Chunk sizes are what the KV cache costs and what the context window holds, so they are counted
with the LM's tokenizer, not the embedding model's or tiktoken's.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.node_parser import SentenceSplitter


def token_splitter(tokenizer: Any, chunk_tokens: int = 256, overlap_tokens: int = 0) -> Any:
    """A SentenceSplitter whose chunks hold at most `chunk_tokens` of the LM's tokens."""
    return SentenceSplitter(
        chunk_size=chunk_tokens,
        chunk_overlap=overlap_tokens,
        tokenizer=lambda text: tokenizer.encode(text, add_special_tokens=False),
    )


def split_text(tokenizer: Any, chunk_tokens: int = 256, overlap_tokens: int = 0) -> Any:
    """A plain `str -> list[str]` splitter for `rag_kvcache.ingest`."""
    return token_splitter(tokenizer, chunk_tokens, overlap_tokens).split_text
