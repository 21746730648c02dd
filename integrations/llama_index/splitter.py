"""LlamaIndex's sentence-aware node parser, sized in the language model's own tokens.

Chunk sizes are what the KV cache costs and what the context window holds, so they are counted
with the LM's tokenizer, not the embedding model's or tiktoken's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from llama_index.core.node_parser import SentenceSplitter


def token_splitter(tokenizer: Any, chunk_tokens: int = 256, overlap_tokens: int = 0) -> Any:
    """A SentenceSplitter whose chunks hold at most `chunk_tokens` of the LM's tokens."""
    return SentenceSplitter(
        chunk_size=chunk_tokens,
        chunk_overlap=overlap_tokens,
        tokenizer=lambda text: tokenizer.encode(text, add_special_tokens=False),
    )


# a run of this many characters with no whitespace is cut by tokens here: SentenceSplitter
# splits it character by character, tokenizing as it goes (a 50 MB line ran for minutes)
LONG_RUN = 1000
_LONG = re.compile(rf"\S{{{LONG_RUN},}}")


def split_text(
    tokenizer: Any, chunk_tokens: int = 256, overlap_tokens: int = 0
) -> Callable[[str], list[str]]:
    """A plain `str -> list[str]` splitter for `rag_kvcache.ingest`: SentenceSplitter's, but
    for runs of LONG_RUN characters or more without whitespace (a base64 blob, a line of one
    character), which are cut every `chunk_tokens` tokens. Text with none is split as
    SentenceSplitter splits it."""
    sentences = token_splitter(tokenizer, chunk_tokens, overlap_tokens).split_text

    def split(text: str) -> list[str]:
        chunks, at = [], 0
        for run in _LONG.finditer(text):
            if text[at : run.start()].strip():
                chunks += sentences(text[at : run.start()])
            chunks += _by_tokens(tokenizer, run.group(), chunk_tokens)
            at = run.end()
        if text[at:].strip() or at == 0:
            chunks += sentences(text[at:])
        return chunks

    return split


def _by_tokens(tokenizer: Any, run: str, chunk_tokens: int) -> list[str]:
    """`run` cut where every `chunk_tokens`-th token starts (the tokenizer's offsets: pieces of
    the text itself, never a character cut in two), in one tokenizer pass."""
    offsets = tokenizer(run, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in offsets["offset_mapping"][::chunk_tokens]]
    bounds = [0, *starts[1:], len(run)]
    return [run[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if a < b]
