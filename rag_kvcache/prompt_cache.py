"""Serving markup prompts (Prompt Cache) from cached module KV.

Every unit of a schema (a run of a module's text, the anonymous text, a scaffold) is encoded
once, alone, and kept in the engine's store under its content hash, like a RAG chunk: a schema
edit re-encodes only the units whose tokens changed. Serving a prompt places the imported
units' KV at their schema positions (keys rotated there: the same as encoding them there),
computes the parameter arguments and the prompt's text at their positions in one forward
(each new token sees every token at an earlier position), and decodes. The second mode links
the imported units back to back with a link strategy instead, so modules can be reordered and
no positions are left empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rag_kvcache.decoding import decode, prefill
from rag_kvcache.engine import PREFILL, RagKVCache
from rag_kvcache.kv import ChunkKV, EncodeSettings
from rag_kvcache.linker import link
from rag_kvcache.markup import (
    CompiledPrompt,
    MarkupError,
    Schema,
    Unit,
    compile_prompt,
    compile_schema,
    scaffold_unit,
)
from rag_kvcache.model import Cache, additive_mask, buffered_cache, forward, new_buffers
from rag_kvcache.rope import rotate_into

POSITIONS = "positions"  # serve at schema positions (Prompt Cache); else a link strategy


@dataclass(frozen=True)
class SchemaAdded:
    name: str
    modules: int
    units: int
    encoded: int  # units encoded now (the rest were cached: unchanged since last time)


@dataclass(frozen=True)
class PromptAnswer:
    text: str
    token_ids: tuple[int, ...]
    mode: str  # "positions", a link strategy, or "prefill" (the baseline)
    ttft_s: float
    cached_tokens: int  # taken from the cache
    computed_tokens: int  # computed for this prompt (arguments, text; prefill: all)


class PromptCache:
    """Schemas compiled for one engine's model; their units live in the engine's store."""

    def __init__(self, engine: RagKVCache):
        self.engine = engine
        self.schemas: dict[str, Schema] = {}

    def add_schema(self, source: str) -> SchemaAdded:
        """Compile a schema and encode its units (and scaffolds) that are not cached yet."""
        schema = compile_schema(source, self.engine.lm.tokenizer)
        units = list(schema.units)
        for names in schema.scaffolds:
            covered = [u for u in schema.units if u.module is None or u.module in names]
            units.append(scaffold_unit(covered))
        _, encoded = self._cache(units)
        self.schemas[schema.name] = schema
        return SchemaAdded(schema.name, len(schema.modules), len(units), encoded)

    def load_folder(self, folder: Path) -> list[SchemaAdded]:
        """Add every `*.xml` schema in a folder (the CLI keeps them under the store root)."""
        return [
            self.add_schema(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.xml"))
        ]

    def compile(self, prompt: str) -> CompiledPrompt:
        return compile_prompt(prompt, self.schemas, self.engine.lm.tokenizer)

    def serve(
        self, prompt: str | CompiledPrompt, mode: str = POSITIONS, max_new_tokens: int | None = None
    ) -> PromptAnswer:
        """Answer a prompt: at schema positions, with a link strategy, or (mode "prefill") by a
        plain prefill of the same tokens in position order, for comparison."""
        compiled = self.compile(prompt) if isinstance(prompt, str) else prompt
        lm, gen = self.engine.lm, self.engine.config.generation
        if max_new_tokens is not None:
            gen = replace(gen, max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        cached = sum(len(u.token_ids) for u in compiled.units)
        if mode == PREFILL:
            ids = prompt_token_ids(compiled)
            cache, logits = prefill(lm, ids, reserve=gen.max_new_tokens)
            position, cached, computed = len(ids), 0, len(ids)
        elif mode == POSITIONS:
            chunks = self._chunks(compiled.units)
            cache, logits, position = at_positions(
                self.engine, compiled, chunks, gen.max_new_tokens
            )
            computed = len(compiled.new_ids)
        else:
            if compiled.arguments:
                raise MarkupError(
                    "parameters need their schema positions; serve with mode='positions'"
                )
            chunks = self._chunks(linked_order(compiled))
            linked = link(lm, chunks, list(compiled.new_ids), mode, reserve=gen.max_new_tokens)
            cache, logits, position = linked.cache, linked.next_logits, linked.length
            computed = linked.recomputed + len(compiled.new_ids)
        tokens: list[int] = []
        ttft = 0.0
        for token in decode(lm, cache, logits, position, gen):
            if not tokens:
                ttft = time.perf_counter() - start
            if token in lm.eos_ids:
                break
            tokens.append(token)
        text = lm.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        return PromptAnswer(text, tuple(tokens), mode, ttft, cached, computed)

    def _cache(self, units: list[Unit]) -> tuple[list[str], int]:
        token_lists = [list(u.token_ids) for u in units]
        texts = [self.engine.lm.tokenizer.decode(t) for t in token_lists]
        return self.engine.cache_token_ids(token_lists, EncodeSettings(), texts)

    def _chunks(self, units: tuple[Unit, ...]) -> list[ChunkKV]:
        ids, _ = self._cache(list(units))  # encodes only what is missing (e.g. expired)
        return self.engine.store.get(ids)


def prompt_token_ids(compiled: CompiledPrompt) -> list[int]:
    """Cached and new tokens merged in position order: the plain prompt."""
    pairs = [(u.start + i, t) for u in compiled.units for i, t in enumerate(u.token_ids)]
    pairs += list(zip(compiled.new_positions, compiled.new_ids))
    return [t for _, t in sorted(pairs)]


def linked_order(compiled: CompiledPrompt) -> tuple[Unit, ...]:
    """Units for position-independent linking: the anonymous text before the first module,
    then each imported module's units in the prompt's order, then the other anonymous text."""
    units = compiled.units
    if any(u.module == "#scaffold" for u in units):
        return units
    first = min((u.start for u in units if u.module is not None), default=None)
    head = [u for u in units if u.module is None and (first is None or u.start < first)]
    rest = [u for u in units if u.module is None and u not in head]
    modules = [u for name in compiled.imported for u in units if u.module == name]
    return tuple(head + modules + rest)


def at_positions(
    engine: RagKVCache, compiled: CompiledPrompt, chunks: list[ChunkKV], reserve: int
) -> tuple[Cache, torch.Tensor, int]:
    """Place cached units at their schema positions and compute the new tokens at theirs.

    The buffer holds only real tokens, back to back; positions live in the keys' rotation and
    in the mask (a new token sees every token at an earlier or equal position), so empty
    positions (unimported union members, short arguments) cost nothing and are never read.
    """
    lm = engine.lm
    n = sum(c.num_tokens for c in chunks)
    keys, values = new_buffers(lm, n + len(compiled.new_ids) + reserve)
    index, cached_positions = 0, list[int]()
    for unit, kv in zip(compiled.units, chunks, strict=True):
        span = slice(index, index + kv.num_tokens)
        rotate_into(keys[:, 0, :, span], kv.keys, unit.start - kv.start, lm.inv_freq)
        values[:, 0, :, span] = kv.values
        cached_positions += range(unit.start, unit.end)
        index += kv.num_tokens
    new = torch.tensor(compiled.new_positions, device=lm.device)
    old = torch.tensor(cached_positions, dtype=torch.long, device=lm.device)
    allowed = torch.cat((old[None, :] <= new[:, None], new[None, :] <= new[:, None]), dim=1)
    ids = torch.tensor([compiled.new_ids], device=lm.device)
    cache = buffered_cache(lm, keys, values, n)
    logits, cache = forward(
        lm,
        ids,
        positions=new[None],
        cache=cache,
        mask=additive_mask(allowed, lm.dtype),
        logits_to_keep=1,
    )
    return cache, logits[0, -1], int(new.max()) + 1
