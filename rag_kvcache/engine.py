"""RagKVCache: encode document chunks once, then answer questions over their cached KV."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeVar

import torch

from rag_kvcache.answer import (
    Answer,
    AnswerStream,
    Prepared,
    answer_steps,
    forced_logits,
    make_answer,
    prepare,
    prompt_in_position_order,
)
from rag_kvcache.chat import HISTORY_TURNS, Message, chat_question
from rag_kvcache.chat_text import ChatText
from rag_kvcache.config import (
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
    StoreConfig,
    whole_number,
)
from rag_kvcache.errors import (
    CalibrationError,
    ConfigError,
    ContextTooLongError,
    EmptyChunkError,
    EngineClosedError,
    FingerprintMismatchError,
    InvalidNameError,
    UnknownCacheIdError,
)
from rag_kvcache.kv import ChunkKV, EncodeSettings, Fetched, KVStore, make_cache_id
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.model.adapter import release_buffers
from rag_kvcache.model.loading import LoadedModel, check_model_source, load_model
from rag_kvcache.progress import PlannedShare
from rag_kvcache.prompt import PromptTemplate, check_text
from rag_kvcache.retrieval.corpus import Corpus
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.retrieval.index import Retrieved
from rag_kvcache.serving.batch import (
    BatchDecoder,
    BatchLoad,
    BatchRequest,
    BatchStats,
    Finished,
    check_batchable,
)
from rag_kvcache.serving.loop import AsyncTokenStream, EngineLoop, LoopRequest
from rag_kvcache.serving.prefix_tree import PrefixTree
from rag_kvcache.storage.layout import checked_name
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.storage.records import ChunkRow, ChunksGoneError
from rag_kvcache.storage.store import Reencode, TieredStore
from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.timing import STAGE_FETCH, stage


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
    answers: list[Answer]  # in request order
    stats: BatchStats


def open_store(config: StoreConfig, reencode: Reencode | None = None) -> KVStore:
    """The store a StoreConfig describes: in memory, or tiered under config.root. `reencode`
    (see `reencoder`) rebuilds a tiered store's lost or corrupt blobs; memory loses none."""
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
        reencode=reencode,
    )


def reencoder(lm: LoadedModel) -> Reencode:
    """The re-encode hook a durable store is built with: rebuilds a lost or corrupt blob with
    `lm` from the token ids the catalog keeps (only chunks of that model)."""

    def reencode(row: ChunkRow) -> ChunkKV:
        if row.fingerprint != lm.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {row.cache_id} belongs to model {row.fingerprint}; only that model "
                f"can re-encode it (loaded: {lm.fingerprint})"
            )
        settings = EncodeSettings.from_key(row.encode_settings)
        return encode_chunks(lm, [list(row.token_ids)], settings)[0]

    return reencode


def default_kv_cache_bytes(lm: LoadedModel) -> int:
    """The KV budget of batched answering when the config leaves it out: half the memory
    free on the model's GPU once it is loaded, or a quarter of the machine's memory (4 GiB
    where the system does not say)."""
    if lm.device.type == "cuda":
        return torch.cuda.mem_get_info(lm.device)[0] // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return 4 << 30


def listed(items: object, what: str, *, strings: bool = True) -> list[str]:
    """`items` (a list, tuple or other ordered iterable) as a list, or a ConfigError saying
    what was given instead: a lone string would be read as one item per character (a chunk or
    an unknown cache ID each), and a set or dict has no order for the chunks. With `strings`,
    an item that is not a string is one too; cache IDs leave that to the store, which names
    any ID that is not one as unknown."""
    unordered = isinstance(items, Mapping | AbstractSet)
    if isinstance(items, str | bytes) or unordered or not isinstance(items, Iterable):
        raise ConfigError(
            f"{what} must be a list of strings, got {type(items).__name__}"
            + (": for one, pass [it]" if isinstance(items, str) else "")
        )
    items = list(items)
    for i, item in enumerate(items):
        if strings and not isinstance(item, str):
            raise ConfigError(f"{what}[{i}] must be a string, got {type(item).__name__}")
    return items


RECORD_TRIES = 3  # tries of `recorded_again`
Recorded = TypeVar("Recorded")


def recorded_again(record: Callable[[], Recorded]) -> Recorded:
    """`record()` (cache a document's chunks, then record it), tried again while it raises
    ChunksGoneError, RECORD_TRIES times in all: another process may drop chunks this one found
    stored before it records them, and caching them again mends it."""
    for _ in range(RECORD_TRIES - 1):
        with contextlib.suppress(ChunksGoneError):
            return record()
    return record()


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
        opened = store is None  # a store given here was built with its own hook (reencode=...)
        if store is None:  # opened first: the model's LoRA adapter may be kept in it
            if lm is None:  # a mistyped model fails before its store is made
                check_model_source(self.config.model)
            store = open_store(self.config.store, lambda row: reencoder(self.lm)(row))
        self.store = store
        try:
            self.lm = lm or load_model(self.config.model, stored_adapter=store.adapter)
            self.template = PromptTemplate.from_tokenizer(
                self.lm.tokenizer, self.config.system_prompt
            )
            prefix = self.template.prefix_ids(self.lm.tokenizer)
            if len(prefix) >= self.lm.max_context:  # (it was "chunk 0 has N tokens")
                raise ContextTooLongError(
                    f"the system prompt is {len(prefix)} tokens with its chat template; the "
                    f"model's window is {self.lm.max_context}: give a shorter system_prompt"
                )
        except BaseException:
            if opened and isinstance(store, TieredStore):
                store.close()
            raise
        facts = (self.lm.num_layers, self.lm.num_kv_heads, self.lm.head_dim)
        self.store.register_model(self.lm.fingerprint, self.lm.name, str(self.lm.dtype), *facts)
        self.doc_settings = EncodeSettings(tuple(prefix[: self.config.encode.sink_tokens]))
        # linked prefixes of every strategy (each keyed by it) and the batches' rows, under one
        # byte budget
        budget = self.config.kv_cache_bytes
        self.prefix_tree = PrefixTree(default_kv_cache_bytes(self.lm) if budget is None else budget)
        self._tree_lock = threading.Lock()  # held by whoever decodes over the tree
        self._loop: EngineLoop | None = None  # started by the first agenerate / astream
        self._loop_guard = threading.Lock()
        self._closed = False
        self._calibration: tuple[bytes, Calibration] | None = None  # parsed, with its bytes
        self._corpus: Corpus | None = None  # built by the first use of `corpus`
        self._encoding: dict[str, threading.Event] = {}  # chunks being encoded: set when stored
        self._encoding_lock = threading.Lock()
        self._corpus_lock = threading.Lock()
        self.prefix_id = self.cache_token_ids([prefix], EncodeSettings(), [self.template.prefix])[
            0
        ][0]

    def with_encoding(self, encode: EncodeConfig) -> RagKVCache:
        """An engine on the same model and store that encodes chunks with other settings (e.g.
        sink tokens for legolink0). Chunks of both live side by side: settings are part of
        the cache ID."""
        return RagKVCache(replace(self.config, encode=encode), lm=self.lm, store=self.store)

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
        # NUL, no text's character (PDF extraction leaves some), is dropped: a PostgreSQL
        # catalog cannot keep it, and the KV must be of the text the catalog keeps
        texts = [text.replace("\x00", "") for text in listed(texts, "texts")]
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
        wanted = dict(zip(ids, zip(chunks, texts, strict=True), strict=True))  # (each once)
        # a chunk another thread of this engine is encoding (the same document uploaded twice
        # at once) is waited for, not encoded again; the store is asked after the claim, so a
        # thread that stored a chunk meanwhile is seen
        with self._encoding_lock:
            theirs = {cid: self._encoding[cid] for cid in wanted if cid in self._encoding}
            mine = {cid: job for cid, job in wanted.items() if cid not in theirs}
            self._encoding.update((cid, threading.Event()) for cid in mine)
        try:  # (whatever happens, the events of `mine` are set: no waiter is left waiting)
            stored = [cid for cid in mine if self.store.contains(cid)]
            with self._encoding_lock:
                for cid in stored:
                    self._encoding.pop(cid).set()
                    del mine[cid]
            if on_encoded and len(mine) + len(theirs) < len(ids):
                on_encoded(len(ids) - len(mine) - len(theirs))  # already cached: done at once
            if mine:
                batch = self.config.encode.batch_size
                chunk_ids = [c for c, _ in mine.values()]
                encoded = encode_chunks(self.lm, chunk_ids, settings, batch, on_encoded)
                for kv, (_, text) in zip(encoded, mine.values()):
                    self.store.put(kv, text)
        finally:
            with self._encoding_lock:
                for cid in mine:
                    self._encoding.pop(cid).set()
        for done in theirs.values():
            done.wait()
        if on_encoded and theirs:
            on_encoded(len(theirs))
        lost = [cid for cid in theirs if not self.store.contains(cid)]  # (their encode failed)
        if not lost:
            return ids, len(mine)
        at = {cid: i for i, cid in enumerate(ids)}
        _, again = self.cache_token_ids(
            [chunks[at[c]] for c in lost], settings, [texts[at[c]] for c in lost]
        )
        return ids, len(mine) + again

    # ------------------------------------------------------------------ documents and retrieval

    @property
    def corpus(self) -> Corpus:
        """Documents and their vector index; needs a durable store (StoreConfig.root). Built
        once, on first use, under this engine's lock (`cached_property` has none from Python
        3.12): two threads asking at once share one corpus (two would each hold an index, and
        the one saved last would drop the other's chunks)."""
        with self._corpus_lock:
            if self._corpus is None:
                catalog, folder = self.store.catalog, self.store.root
                if catalog is None or folder is None:
                    raise ConfigError(
                        "documents and retrieval need a durable store: "
                        "EngineConfig(store=StoreConfig(root=...))"
                    )
                self._corpus = Corpus(self.store, catalog, folder, Embedder.shared())
            return self._corpus

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
        checked_name("document source", source)  # before anything is encoded
        start, encoded = time.perf_counter(), 0
        share = PlannedShare(len(chunks), on_encoded)  # a try again reports no chunk twice

        def record() -> DocumentIngest:
            nonlocal encoded  # (over every try)
            ids, now = self._cache_texts(chunks, share, source)  # checks every text first
            encoded += now
            encode_s = time.perf_counter() - start
            digest = content_hash  # (hashed after: a bad character is named, not a codec error)
            if digest is None:
                digest = hashlib.sha256("\x00".join(chunks).encode()).hexdigest()
            removed = self.corpus.set_document(source, digest, ids)
            return DocumentIngest(source, tuple(ids), encoded, len(removed), encode_s)

        return recorded_again(record)

    def remove_document(self, source: str) -> int:
        """Forget a document; returns how many chunks (listed by no other document) went."""
        checked_name("document source", source)  # (None was "no such document": 0)
        return len(self.corpus.remove_document(source))

    def retrieve(
        self, query: str, top_k: int = 4, *, embedding: Sequence[float] | None = None
    ) -> list[Retrieved]:
        """The ingested chunks most similar to `query` (cosine, best first), with cache IDs.
        `embedding`: a vector of the engine's embedding model (`MiniLMEmbedding`) to search
        with instead of `query`'s own, e.g. the mean of a question and a hypothetical answer
        (LlamaIndex's HyDE); `query` may then be empty. Their KV starts moving from the
        durable tier into the hot tiers at once (`prefetch`), so the answer that follows finds
        it there or on its way."""
        top_k = whole_number("top_k", top_k)  # (a float or bool failed inside FAISS)
        blank = not check_text(query, "query").strip()
        if blank and embedding is None:  # (as `generate` refuses to answer it)
            raise ConfigError(f"the query is empty ({query!r}): ask something")
        hits = self.corpus.search(query, top_k, self.lm.fingerprint, embedding)
        self.store.prefetch([h.cache_id for h in hits])
        return hits

    def expire_cache(self, cache_id: str) -> bool:
        """Forget a chunk's KV; later requests naming it get UnknownCacheIdError, and
        retrieval no longer finds it (its documents no longer list it). The system prompt's
        own entry (`prefix_id`), which every answer reads, is refused."""
        if cache_id == self.prefix_id:  # (every later answer failed, naming an ID never given)
            raise ConfigError(
                f"{cache_id} is the system prompt's KV, which every answer of this engine "
                "reads: it cannot be expired"
            )
        catalog = self.store.catalog  # (anything but a string: the store's error, below)
        documented = False
        if catalog is not None and isinstance(cache_id, str):
            documented = bool(catalog.sources([cache_id]))
        removed = self.store.remove(cache_id)
        if removed and documented:  # (a chunk no document lists needs no embedding model)
            # the catalog bumped the corpus version as it deleted the listed chunk: every other
            # process syncs at its next search; this one now, so the saved index drops it too
            self.corpus.sync()
        return removed

    # ------------------------------------------------------------------ answering

    def prompt_ids(self, query: str, cache_ids: list[str]) -> list[int]:
        """The full prompt, token for token, that linking reproduces (for the baseline)."""
        chunks = self.store.get([self.prefix_id, *self._chunk_ids(cache_ids)])
        return prompt_in_position_order(chunks, self._question_ids(query))

    def generate(
        self,
        query: str,
        cache_ids: list[str],
        *,
        strategy: Strategy | str | None = None,
        max_new_tokens: int | None = None,
        stream: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Answer | AnswerStream:
        """Answer `query` over the cached chunks, in order, after the system prompt.

        The query is the user's text, read as text (a control token spelled in it is
        characters); a chat's question (`chat_question`) keeps its template's control tokens.

        strategy: how the context is computed (default: the config's); `prefill` is the plain
        baseline. With stream=True, an AnswerStream of text pieces. Sampling settings left
        None are the engine's (`GenerationConfig`; temperature 0 is greedy).
        """
        strategy = self.config.strategy if strategy is None else Strategy.parse(strategy)
        question = self._question_ids(query)
        gen = self.generation_config(
            max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        ids = [self.prefix_id, *strategy.arrange(self._chunk_ids(cache_ids))]

        def context() -> Prepared:
            with stage(STAGE_FETCH):
                fetched = self._fetch(ids)
                calibration = self.calibration() if strategy.calibrated else None
            reserve = gen.max_new_tokens
            prepared = prepare(
                self.lm, fetched.chunks, question, strategy, reserve, calibration=calibration
            )
            if fetched.settle():
                return prepared
            # a blob the forward read failed its checksum: again, from a re-read (repaired)
            release_buffers(prepared.cache)
            chunks = self.store.get(ids)
            return prepare(self.lm, chunks, question, strategy, reserve, calibration=calibration)

        steps = answer_steps(self.lm, context, len(question), strategy, gen)
        return self._finish(AnswerStream(steps), stream)

    def _fetch(self, ids: list[str]) -> Fetched:
        """The chunks for one request's link. On the CPU, cold chunks arrive from disk layer
        by layer while the forward runs (`KVStore.fetch`). On a GPU they are read whole: its
        link places every chunk at once, so layer reads would overlap nothing, and they would
        rule out the replayed forward."""
        if self.lm.device.type == "cpu":
            return self.store.fetch(ids)
        return Fetched(self.store.get(ids))

    def complete(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        stream: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        strip: bool | None = None,
    ) -> Answer | AnswerStream:
        """Plain generation from an already formatted prompt (no cached chunks): what any LLM
        does. The prompt is tokenized as is (no special tokens added; control tokens spelled
        in it are tokens, except in the messages of a `chat_prompt`), prefilled, and decoded.
        `strip=False`: the text as decoded, the prompt's continuation (see GenerationConfig)."""
        ids = self.prompt_tokens(prompt)
        gen = self.generation_config(
            max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, strip=strip
        )

        def context() -> Prepared:
            return prepare(self.lm, [], ids, PREFILL, gen.max_new_tokens)

        steps = answer_steps(self.lm, context, len(ids), PREFILL, gen, lead=ids)
        return self._finish(AnswerStream(steps), stream)

    def forced_logits(
        self, query: str, cache_ids: list[str], tokens: list[int], strategy: Strategy | str
    ) -> torch.Tensor:
        """Next-token logits [len(tokens), vocab] with `tokens` fed in as the answer (teacher
        forcing), over the context `generate` would compute: how close a strategy's
        distributions stay to another's."""
        strategy = Strategy.parse(strategy)
        question = self._question_ids(query)
        chunks = self.store.get([self.prefix_id, *strategy.arrange(self._chunk_ids(cache_ids))])
        calibration = self.calibration() if strategy.calibrated else None
        prepared = prepare(
            self.lm, chunks, question, strategy, reserve=len(tokens), calibration=calibration
        )
        try:
            return forced_logits(self.lm, prepared, tokens)
        finally:
            release_buffers(prepared.cache)

    # ------------------------------------------------------------------ link calibration

    def calibration(self) -> Calibration:
        """The model's link calibration for this engine's chunk encoding, as the store keeps
        it now (read from the catalog on each call, so a new one reaches every worker)."""
        data = self.store.calibration(self.lm.fingerprint, self.doc_settings.key())
        if data is None:
            raise CalibrationError(
                f"no link calibration for model {self.lm.name} ({self.lm.fingerprint}) in this "
                "store; train one with `rag-kvcache calibrate`"
            )
        if self._calibration is None or self._calibration[0] != data:
            self._calibration = (data, Calibration.from_bytes(data).to(self.lm))
        return self._calibration[1]

    def set_calibration(self, calibration: Calibration) -> str:
        """Keep `calibration` in the store for this model and encoding (replacing any); every
        `+calibrated` answer uses it from then on. Returns its checksum."""
        if calibration.fingerprint != self.lm.fingerprint:
            raise CalibrationError(
                f"the calibration was trained on model {calibration.fingerprint}, not on "
                f"{self.lm.fingerprint} ({self.lm.name})"
            )
        if calibration.encode != self.doc_settings.key():
            raise CalibrationError(
                f"the calibration was trained on chunks encoded with {calibration.encode!r}; "
                f"this engine encodes with {self.doc_settings.key()!r}"
            )
        data = calibration.to_bytes()
        return self.store.put_calibration(self.lm.fingerprint, self.doc_settings.key(), data)

    def _question_ids(self, query: str) -> list[int]:
        """The question's token ids as the linked prompt holds them (`PromptTemplate`)."""
        self._check_length(query, "question")
        return self.template.question_ids(self.lm.tokenizer, query)

    def prompt_tokens(self, prompt: str) -> list[int]:
        """A plain prompt's token ids, as `complete` prefills them; an empty prompt is a
        ConfigError (there is nothing to continue)."""
        self._check_length(prompt, "prompt")
        ids = self.template.tokenize(self.lm.tokenizer, prompt)
        if not ids:
            raise ConfigError("the prompt is empty: give the text to continue")
        return ids

    @cached_property
    def _longest_token(self) -> int | None:
        """The most characters one token spells: its vocabulary's longest entry, where every
        character is read into some token (BPE with unknowns apart, byte fallback); None where
        a token may stand for any run of characters (fused unknowns, Unigram, whole words)."""
        model = getattr(getattr(self.lm.tokenizer, "backend_tokenizer", None), "model", None)
        bpe = type(model).__name__ == "BPE" and not getattr(model, "fuse_unk", True)
        if not (bpe or getattr(model, "byte_fallback", False)):
            return None
        return max((len(t) for t in self.lm.tokenizer.get_vocab()), default=1)

    def _check_length(self, text: str, what: str) -> None:
        """A text too long for the window is refused before it is tokenized (a few MB take
        seconds): past twice the characters the window's tokens can spell (the margin for a
        normalizer that joins characters), it cannot fit."""
        longest = self._longest_token
        if longest is None or not isinstance(text, str):
            return
        if len(text) > 2 * self.lm.max_context * longest:
            raise ContextTooLongError(
                f"the {what} is {len(text):,} characters: more tokens than the model's window "
                f"of {self.lm.max_context} holds; send a shorter {what}"
            )

    def chat_prompt(self, messages: list[dict[str, str]]) -> ChatText:
        """Render chat messages ({"role", "content"}) with the model's own chat template,
        for `complete`: the messages' text is read as text, never as control tokens."""
        return self.template.render_chat(self.lm.tokenizer, messages)

    def chat_question(
        self, messages: Sequence[Message], history_turns: int | None = HISTORY_TURNS
    ) -> ChatText:
        """The question for `generate` that answers a chat's last (user) message over linked
        chunks: earlier turns rendered as the chat template renders them (see `chat`), the
        messages' text read as text (`ChatText`)."""
        return chat_question(
            self.template, self.lm.tokenizer, self.config.system_prompt, messages, history_turns
        )

    def generate_batch(
        self,
        requests: list[BatchRequest],
        *,
        strategy: Strategy | str | None = None,
        max_batch: int = 32,
    ) -> BatchResult:
        """Answer many requests together, sharing linked prefixes (system prompt + leading
        chunks in common) in the prefix tree and decoding them as one batch. Each answer equals
        `generate(request.query, request.cache_ids)` alone (greedy: token for token).

        It decodes in the calling thread, holding the prefix tree meanwhile: requests of
        `agenerate` / `astream` wait until it is done. One request's error (its context past
        the window, say) raises for the whole call, with no answer; unknown or expired cache
        IDs, the commonest, are found before any request is computed. `agenerate` answers
        each request apart."""
        strategy = self.config.strategy if strategy is None else Strategy.parse(strategy)
        for r in requests:  # (a (query, ids) tuple failed with an AttributeError)
            if not isinstance(r, BatchRequest):
                raise ConfigError(
                    f"each request is a BatchRequest(query, cache_ids), got {type(r).__name__}"
                )
        ids = [self._chunk_ids(r.cache_ids) for r in requests]  # read once
        self._check_known([c for chunks in ids for c in chunks])
        work = [
            self._loop_request(
                r.query,
                chunks,
                strategy,
                self.generation_config(r.max_new_tokens),  # (0 is refused, not the default)
            )
            for r, chunks in zip(requests, ids, strict=True)
        ]
        with self._tree_lock:
            decoder = BatchDecoder(self.lm, self.prefix_tree, self.store.get, max_batch)
            done, stats = decoder.run(
                [(list(w.path), list(w.question), w.config, w.strategy) for w in work]
            )
        return BatchResult([self._answer(d) for d in done], stats)

    # ------------------------------------------------------------------ concurrent answering

    async def agenerate(
        self,
        query: str,
        cache_ids: list[str],
        *,
        strategy: Strategy | str | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Answer:
        """`generate`, awaited: the request joins the engine loop's running batch, sharing
        linked prefixes with every other request in flight. Greedy answers equal `generate`'s
        token for token. Cancelling the awaiting task aborts the request."""
        stream = self.astream(
            query,
            cache_ids,
            strategy=strategy,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )
        return await stream.finish()

    def astream(
        self,
        query: str,
        cache_ids: list[str],
        *,
        strategy: Strategy | str | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> AsyncTokenStream[Answer]:
        """The answer's text pieces as they are decoded in the engine loop (`async for`);
        `.result` is the `Answer` once exhausted. Closing it early (`aclose()`, or cancelling
        the task iterating it) aborts the request. Errors of the request itself (an unknown
        cache ID) are raised from the iteration; bad arguments are raised here. Sampling
        settings left None are the engine's (`GenerationConfig`)."""
        strategy = self.config.strategy if strategy is None else Strategy.parse(strategy)
        gen = self.generation_config(
            max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        request = self._loop_request(query, cache_ids, strategy, gen)
        return AsyncTokenStream(self.serving_loop(), request, self._answer)

    async def acomplete(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Answer:
        """`complete`, awaited: the formatted prompt is prefilled in the engine loop and
        decodes in its running batch. Greedy answers equal `complete`'s token for token."""
        stream = self.astream_complete(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        return await stream.finish()

    def astream_complete(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        strip: bool | None = None,
    ) -> AsyncTokenStream[Answer]:
        """`complete`'s text pieces as the engine loop decodes them (see `astream`): a
        request with no cached chunks, its prompt tokenized as is and prefilled alone."""
        ids = self.prompt_tokens(prompt)
        gen = self.generation_config(
            max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, strip=strip
        )
        request = LoopRequest((), tuple(ids), gen, PREFILL)
        return AsyncTokenStream(self.serving_loop(), request, self._answer)

    def serving_loop(self) -> EngineLoop:
        """The engine loop (one thread owning the batch decoder), started on first use."""
        with self._loop_guard:
            if self._closed:
                raise EngineClosedError("the engine is closed; open a new one to answer")
            if self._loop is None:
                with self._tree_lock:  # it joins the tree's batches, which a step may be reading
                    decoder = BatchDecoder(
                        self.lm,
                        self.prefix_tree,
                        self.store.get,
                        link_budget_s=self.config.link_budget_s,
                    )
                self._loop = EngineLoop(decoder, self._tree_lock)
            return self._loop

    def batch_load(self) -> BatchLoad:
        """The engine loop's decoder as its last step or abort left it: requests decoding and
        waiting, KV bytes held (zeros before the loop starts or after close). Never starts the
        loop or waits for it: for metrics, from any thread."""
        loop = self._loop
        return loop.decoder.load if loop is not None else BatchLoad()

    def close(self) -> None:
        """Stop the engine loop (if started): requests in flight fail with
        EngineClosedError, and so do later `agenerate` / `astream` calls. `generate` and
        `generate_batch` keep working."""
        with self._loop_guard:
            loop, self._loop, self._closed = self._loop, None, True
        if loop is not None:
            loop.close()

    def clear_prefix_tree(self) -> int:
        """Drop every linked prefix no request holds; returns bytes freed."""
        with self._tree_lock:
            return self.prefix_tree.clear()

    def _chunk_ids(self, cache_ids: object) -> list[str]:
        """A request's cache IDs as a list (`listed`; an ID that is not a string is the
        store's to name as unknown). The system prompt's entry is refused: every answer
        starts with it already (given as a chunk, it was linked a second time)."""
        ids = listed(cache_ids, "cache_ids", strings=False)
        for i, cache_id in enumerate(ids):  # (`in` would compare arrays and such with ==)
            if isinstance(cache_id, str) and cache_id == self.prefix_id:
                raise ConfigError(
                    f"cache_ids[{i}] is {cache_id!r}, the system prompt's KV, which every "
                    "answer starts with: give only document chunks"
                )
        return ids

    def _check_known(self, cache_ids: list[str]) -> None:
        """UnknownCacheIdError naming every one of `cache_ids` the store cannot serve."""
        unknown: list[object] = [c for c in cache_ids if not isinstance(c, str)]  # (unhashable)
        for cache_id in dict.fromkeys(c for c in cache_ids if isinstance(c, str)):
            try:
                known = self.store.contains(cache_id)
            except InvalidNameError:  # names no chunk
                known = False
            if not known:
                unknown.append(cache_id)
        if unknown:
            raise UnknownCacheIdError(unknown)

    def _loop_request(
        self, query: str, cache_ids: list[str], strategy: Strategy, generation: GenerationConfig
    ) -> LoopRequest:
        check_batchable(strategy)
        question = self._question_ids(query)
        path = (self.prefix_id, *strategy.arrange(self._chunk_ids(cache_ids)))
        return LoopRequest(path, tuple(question), generation, strategy)

    def _answer(self, done: Finished) -> Answer:
        return make_answer(
            self.lm,
            list(done.tokens),
            done.text,
            done.strategy,
            done.prompt_tokens,
            done.context_tokens,
            done.recomputed,
            done.ttft_s,
            done.total_s,
            reused=done.reused,
        )

    def generation_config(
        self,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        strip: bool | None = None,
    ) -> GenerationConfig:
        """The engine's generation settings, with those given (not None) instead: what an
        answer asked with them would use. A bad value is a ConfigError now, not at answer time."""
        gen = self.config.generation
        return replace(
            gen,
            max_new_tokens=gen.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=gen.temperature if temperature is None else temperature,
            top_p=gen.top_p if top_p is None else top_p,
            seed=gen.seed if seed is None else seed,
            strip=gen.strip if strip is None else strip,
        )

    @staticmethod
    def _finish(answer_stream: AnswerStream, stream: bool) -> Answer | AnswerStream:
        if not isinstance(stream, bool):  # ("no" streamed)
            raise ConfigError(f"stream must be True or False, got {stream!r}")
        return answer_stream if stream else answer_stream.finish()
