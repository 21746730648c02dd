"""RagKVCache: encode document chunks once, then answer questions over their cached KV."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from functools import cached_property

from rag_kvcache.batch import BatchAnswer, BatchDecoder, BatchRequest, BatchStats
from rag_kvcache.config import EngineConfig, GenerationConfig, StoreConfig
from rag_kvcache.corpus import Corpus
from rag_kvcache.decoding import decode, prefill
from rag_kvcache.embedding import Embedder
from rag_kvcache.encoder import encode_chunks
from rag_kvcache.errors import ConfigError, EmptyChunkError, FingerprintMismatchError
from rag_kvcache.kv import ChunkKV, EncodeSettings, KVStore, make_cache_id
from rag_kvcache.linker import link
from rag_kvcache.model import LoadedModel, load_model
from rag_kvcache.prefix_tree import PrefixTree
from rag_kvcache.prompt import PromptTemplate
from rag_kvcache.retrieval import Retrieved
from rag_kvcache.storage.catalog import ChunkRow
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import LinkStrategy, parse_strategy

PREFILL = "prefill"  # not a link strategy: the plain full-prompt baseline, no cached KV used


@dataclass(frozen=True)
class Answer:
    """A generated answer and what it cost."""

    text: str
    token_ids: tuple[int, ...]
    strategy: str
    prompt_tokens: int  # context + question
    context_tokens: int
    recomputed_tokens: int  # context tokens recomputed while linking
    ttft_s: float  # request start -> first token chosen (store fetch + link + first forward)
    decode_tokens_per_s: float
    total_s: float


@dataclass(frozen=True)
class DocumentIngest:
    """What ingesting one document did."""

    source: str
    cache_ids: tuple[str, ...]  # its chunks, in order
    encoded: int  # chunks whose KV was computed now (the rest were already cached)
    removed: int  # chunks it no longer has, deleted from the store
    encode_s: float  # seconds spent encoding and storing KV (the rest: embedding, indexing)


@dataclass(frozen=True)
class BatchResult:
    answers: list[BatchAnswer]  # in request order
    stats: BatchStats


class AnswerStream:
    """Iterates over text pieces as they are generated; `.answer` is set once exhausted."""

    def __init__(self, steps: Generator[str, None, Answer]):
        self._steps = steps
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        self.answer = yield from self._steps


def open_store(config: StoreConfig) -> KVStore:
    """The store a StoreConfig describes: in memory, or tiered under config.root."""
    if config.root is None:
        return MemoryStore()
    return TieredStore(
        config.root,
        catalog_url=config.catalog_url,
        redis_url=config.redis_url,
        cpu_bytes=config.cpu_bytes,
        gpu_bytes=config.gpu_bytes,
        policy=config.policy,
        compress=config.compress,
    )


class RagKVCache:
    """The engine. `generate_context_cache(texts) -> cache_ids`, `generate(query, cache_ids)`."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        lm: LoadedModel | None = None,
        store: KVStore | None = None,
    ):
        self.config = config or EngineConfig()
        self.lm = lm or load_model(self.config.model)
        self.store = store if store is not None else open_store(self.config.store)
        if isinstance(self.store, TieredStore):
            self.store.reencode = self._reencode
        facts = (self.lm.num_layers, self.lm.num_kv_heads, self.lm.head_dim)
        self.store.register_model(self.lm.fingerprint, self.lm.name, str(self.lm.dtype), *facts)
        self.template = PromptTemplate.from_tokenizer(self.lm.tokenizer, self.config.system_prompt)
        prefix = self.template.prefix_ids(self.lm.tokenizer)
        self.doc_settings = EncodeSettings(tuple(prefix[: self.config.encode.sink_tokens]))
        self.prefix_trees: dict[str, PrefixTree] = {}  # linked prefixes, per link strategy
        self.prefix_id = self.cache_token_ids([prefix], EncodeSettings(), [self.template.prefix])[
            0
        ][0]

    # ------------------------------------------------------------------ ingestion

    def generate_context_cache(
        self, texts: list[str], on_encoded: Callable[[int], None] | None = None
    ) -> list[str]:
        """Encode each text as one chunk (skipping any already cached); return their cache IDs.

        `on_encoded(n)` reports progress: n more chunks encoded.
        """
        return self._cache_texts(texts, on_encoded)[0]

    def _cache_texts(
        self, texts: list[str], on_encoded: Callable[[int], None] | None, source: str = ""
    ) -> tuple[list[str], int]:
        """Document chunk texts -> (cache IDs, how many were encoded now)."""
        for i, text in enumerate(texts):
            if not text.strip():
                where = f"text {i}" + (f" of {source}" if source else "")
                raise EmptyChunkError(f"{where} is empty or whitespace; nothing to cache")
        chunks = [self.template.chunk_ids(self.lm.tokenizer, t) for t in texts]
        return self.cache_token_ids(chunks, self.doc_settings, texts, on_encoded)

    def cache_token_ids(
        self,
        chunks: list[list[int]],
        settings: EncodeSettings,
        texts: list[str],
        on_encoded: Callable[[int], None] | None = None,
    ) -> tuple[list[str], int]:
        """Cache exact token lists (each one chunk, encoded with `settings`, skipping those
        already stored): their cache IDs, and how many were encoded now. `texts` go to the
        catalog (re-encoding needs the token ids only). Text callers want
        generate_context_cache; this is for callers that own the tokenization (Prompt Cache
        units, benchmarks)."""
        ids = [make_cache_id(self.lm.fingerprint, settings, c) for c in chunks]
        todo = {
            cid: (c, t) for cid, c, t in zip(ids, chunks, texts) if not self.store.contains(cid)
        }
        batch = self.config.encode.batch_size
        if on_encoded and len(todo) < len(ids):
            on_encoded(len(ids) - len(todo))  # already cached: done at once
        encoded = encode_chunks(self.lm, [c for c, _ in todo.values()], settings, batch, on_encoded)
        for kv, (_, text) in zip(encoded, todo.values()):
            self.store.put(kv, text)
        return ids, len(todo)

    # ------------------------------------------------------------------ documents and retrieval

    @cached_property
    def corpus(self) -> Corpus:
        """Documents and their vector index; needs a durable store (StoreConfig.root)."""
        if not isinstance(self.store, TieredStore):
            raise ConfigError(
                "documents and retrieval need a durable store: "
                "EngineConfig(store=StoreConfig(root=...))"
            )
        return Corpus(self.store, Embedder())

    def ingest_document(
        self,
        source: str,
        chunks: list[str],
        content_hash: str | None = None,
        on_encoded: Callable[[int], None] | None = None,
    ) -> DocumentIngest:
        """Cache a document's chunk texts, record them as `source`'s chunks (replacing what it
        had: stale chunks are removed) and index them for retrieval. Re-ingesting is cheap:
        chunks already cached are not encoded again."""
        if content_hash is None:
            content_hash = hashlib.sha256("\x00".join(chunks).encode()).hexdigest()
        start = time.perf_counter()
        ids, encoded = self._cache_texts(chunks, on_encoded, source)
        encode_s = time.perf_counter() - start
        removed = self.corpus.set_document(source, content_hash, ids)
        return DocumentIngest(source, tuple(ids), encoded, len(removed), encode_s)

    def remove_document(self, source: str) -> int:
        """Forget a document; returns how many chunks (listed by no other document) went."""
        return len(self.corpus.remove_document(source))

    def retrieve(self, query: str, top_k: int = 4) -> list[Retrieved]:
        """The ingested chunks most similar to `query` (cosine, best first), with cache IDs."""
        return self.corpus.search(query, top_k)

    def _reencode(self, row: ChunkRow) -> ChunkKV:
        """Rebuild a lost or corrupt blob from the token ids the catalog keeps."""
        if row.fingerprint != self.lm.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {row.cache_id} belongs to model {row.fingerprint}; only that model "
                f"can re-encode it (loaded: {self.lm.fingerprint})"
            )
        settings = EncodeSettings.from_key(row.encode_settings)
        return encode_chunks(self.lm, [list(row.token_ids)], settings)[0]

    def expire_cache(self, cache_id: str) -> bool:
        """Forget a chunk's KV; later requests naming it get UnknownCacheIdError."""
        return self.store.remove(cache_id)

    # ------------------------------------------------------------------ answering

    def prompt_ids(self, query: str, cache_ids: list[str]) -> list[int]:
        """The full prompt, token for token, that linking reproduces (for the baseline)."""
        chunks = self.store.get([self.prefix_id, *cache_ids])
        context = [t for c in chunks for t in c.token_ids]
        return context + self.template.question_ids(self.lm.tokenizer, query)

    def generate(
        self,
        query: str,
        cache_ids: list[str],
        *,
        strategy: str | LinkStrategy | None = None,
        max_new_tokens: int | None = None,
        stream: bool = False,
    ) -> Answer | AnswerStream:
        """Answer `query` over the cached chunks, in order, after the system prompt.

        strategy: a link strategy (default: the config's) or "prefill" for the plain baseline.
        """
        name = str(strategy or self.config.strategy)
        if name != PREFILL:
            name = str(parse_strategy(name))
        gen = self.config.generation
        if max_new_tokens is not None:
            gen = replace(gen, max_new_tokens=max_new_tokens)
        steps = self._steps(query, list(cache_ids), name, gen)
        return self._finish(AnswerStream(steps), stream)

    def complete(
        self, prompt: str, *, max_new_tokens: int | None = None, stream: bool = False
    ) -> Answer | AnswerStream:
        """Plain generation from an already formatted prompt (no cached chunks): what any LLM
        does. The prompt is tokenized as is (no special tokens added), prefilled, and decoded."""
        gen = self.config.generation
        if max_new_tokens is not None:
            gen = replace(gen, max_new_tokens=max_new_tokens)
        steps = self._steps(prompt, None, PREFILL, gen)
        return self._finish(AnswerStream(steps), stream)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages ({"role", "content"}) with the model's own chat template."""
        return self.template.render_chat(self.lm.tokenizer, messages)

    def generate_batch(
        self,
        requests: list[BatchRequest],
        *,
        strategy: str | LinkStrategy | None = None,
        max_batch: int = 32,
    ) -> BatchResult:
        """Answer many requests together, sharing linked prefixes (system prompt + leading
        chunks in common) in a prefix tree and decoding them as one batch. Each answer equals
        `generate(request.query, request.cache_ids)` alone (greedy: token for token)."""
        name = str(parse_strategy(strategy or self.config.strategy))
        tree = self.prefix_trees.setdefault(name, PrefixTree(self.config.prefix_tree_bytes))
        gen, tok = self.config.generation, self.lm.tokenizer
        work = [
            (
                [self.prefix_id, *r.cache_ids],
                self.template.question_ids(tok, r.query),
                replace(gen, max_new_tokens=r.max_new_tokens or gen.max_new_tokens),
            )
            for r in requests
        ]
        done, stats = BatchDecoder(self.lm, tree, name, self.store.get).run(work, max_batch)
        answers = []
        for request in done:
            tokens = [t for t in request.tokens if t not in self.lm.eos_ids]
            answers.append(
                BatchAnswer(
                    text=tok.decode(tokens, skip_special_tokens=True).strip(),
                    token_ids=tuple(tokens),
                    prompt_tokens=request.prompt_tokens,
                    reused_tokens=request.reused,
                    recomputed_tokens=request.recomputed,
                    ttft_s=request.ttft_s,
                )
            )
        return BatchResult(answers, stats)

    @staticmethod
    def _finish(answer_stream: AnswerStream, stream: bool) -> Answer | AnswerStream:
        if stream:
            return answer_stream
        for _ in answer_stream:
            pass
        assert answer_stream.answer is not None
        return answer_stream.answer

    def _steps(
        self, query: str, cache_ids: list[str] | None, strategy: str, gen: GenerationConfig
    ) -> Generator[str, None, Answer]:
        """cache_ids None: `query` is a whole formatted prompt, prefilled as is."""
        tok = self.lm.tokenizer
        start = time.perf_counter()
        if cache_ids is None:
            ids = self.template.tokenize(tok, query)
            cache, logits = prefill(self.lm, ids, reserve=gen.max_new_tokens)
            context_tokens = recomputed = 0
            question = ids
        else:
            question = self.template.question_ids(tok, query)
            chunks = self.store.get([self.prefix_id, *cache_ids])
            context_tokens = sum(c.num_tokens for c in chunks)
            if strategy == PREFILL:
                ids = [t for c in chunks for t in c.token_ids] + question
                cache, logits = prefill(self.lm, ids, reserve=gen.max_new_tokens)
                recomputed = context_tokens
            else:
                linked = link(self.lm, chunks, question, strategy, reserve=gen.max_new_tokens)
                cache, logits, recomputed = linked.cache, linked.next_logits, linked.recomputed
        position = context_tokens + len(question)
        tokens: list[int] = []
        text, ttft = "", 0.0
        for token in decode(self.lm, cache, logits, position, gen):
            if not tokens:
                ttft = time.perf_counter() - start
            tokens.append(token)
            if token in self.lm.eos_ids:
                break
            full = tok.decode(tokens, skip_special_tokens=True)
            if not full.endswith("\ufffd"):  # hold back half a UTF-8 character
                yield full[len(text) :]
                text = full
        total = time.perf_counter() - start
        answer_tokens = [t for t in tokens if t not in self.lm.eos_ids]
        final = tok.decode(answer_tokens, skip_special_tokens=True)
        if final != text:
            yield final[len(text) :]
        decode_s = total - ttft
        return Answer(
            text=final.strip(),
            token_ids=tuple(answer_tokens),
            strategy=strategy,
            prompt_tokens=context_tokens + len(question),
            context_tokens=context_tokens,
            recomputed_tokens=recomputed,
            ttft_s=ttft,
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
            total_s=total,
        )
