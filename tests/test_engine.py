"""The engine end to end: on the tiny model (its small tokenizer built in the tests) and on real
SmolLM2."""

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rag_kvcache import (
    AnswerStream,
    ConfigError,
    ContextTooLongError,
    EmptyChunkError,
    EncodeConfig,
    EngineConfig,
    FingerprintMismatchError,
    GenerationConfig,
    RagKVCache,
    RagKVCacheError,
    UnknownCacheIdError,
)
from rag_kvcache.link.linker import link
from rag_kvcache.link.reference import link_reference
from rag_kvcache.prompt import PromptTemplate
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.strategy import Strategy

DATA = Path(__file__).resolve().parents[1] / "demos" / "data"
DOCS = ["The lighthouse at Hallam Point was built in 1788.", "Velmora has three harbor basins."]


@pytest.fixture
def tiny_engine(tiny64):
    return RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=8)), lm=tiny64)


@pytest.mark.parametrize("question", ["", "   ", "\n\t"])
def test_an_empty_question_is_an_error_not_an_answer(tiny_engine, question: str) -> None:
    ids = tiny_engine.generate_context_cache(DOCS)
    with pytest.raises(ConfigError, match="the question is empty"):
        tiny_engine.generate(question, ids)
    with pytest.raises(ConfigError, match="the question is empty"):
        tiny_engine.generate_batch([BatchRequest(question, ids)])


def test_a_question_that_is_not_text_is_named_so(tiny_engine) -> None:
    """`b"abc"` was "the question is empty"."""
    ids = tiny_engine.generate_context_cache(DOCS)
    for question in (b"abc", None, 42):
        with pytest.raises(ConfigError, match="the question must be text"):
            tiny_engine.generate(question, ids)  # type: ignore[arg-type]


def test_full_link_answers_exactly_like_plain_prefill(tiny_engine) -> None:
    ids = tiny_engine.generate_context_cache(DOCS)
    full = tiny_engine.generate("When was it built?", ids, strategy="full")
    plain = tiny_engine.generate("When was it built?", ids, strategy="prefill")
    assert full.token_ids == plain.token_ids and len(full.token_ids) == 8
    assert full.prompt_tokens == len(tiny_engine.prompt_ids("When was it built?", ids))
    assert full.recomputed_tokens == full.context_tokens


@pytest.mark.parametrize("base", ["prefill", "full", "legolink:2"])
def test_an_order_answers_like_the_chunks_given_in_that_order(tiny_engine, base: str) -> None:
    """`+reversed` / `+rotated` / `+ends` only move the document chunks: the same as passing
    the cache IDs in that order (the system prefix stays first)."""
    docs = [*DOCS, "The ferry leaves at dawn.", "Eels are smoked in May."]
    ids = tiny_engine.generate_context_cache(docs)
    assert len(ids) == 4
    ends = [ids[1], ids[3], ids[2], ids[0]]  # LongContextReorder: best last, second first
    orders = (("reversed", ids[::-1]), ("rotated", [*ids[1:], ids[0]]), ("ends", ends))
    for order, arranged in orders:
        ordered = tiny_engine.generate("When?", ids, strategy=f"{base}+{order}")
        plain = tiny_engine.generate("When?", arranged, strategy=base)
        assert ordered.token_ids == plain.token_ids and ordered.prompt_tokens == plain.prompt_tokens
        assert str(ordered.strategy) == f"{base}+{order}"
    given = tiny_engine.generate("When?", ids, strategy=base)
    reversed_ = tiny_engine.generate("When?", ids, strategy=f"{base}+reversed")
    assert given.token_ids != reversed_.token_ids  # the order really reaches the model


def test_streaming_yields_the_same_text(tiny_engine) -> None:
    ids = tiny_engine.generate_context_cache(DOCS)
    stream = tiny_engine.generate("How many basins?", ids, stream=True)
    pieces = list(stream)
    answer = stream.answer
    assert answer is not None and len(pieces) >= 2
    assert "".join(pieces).strip() == answer.text
    assert answer.text == tiny_engine.generate("How many basins?", ids).text
    assert answer.ttft_s > 0 and answer.total_s >= answer.ttft_s


def test_a_stream_read_in_parts_then_finished_is_the_whole_answer(tiny_engine) -> None:
    """`finish()` after a loop over the stream (the README's loop, then the record) raised a
    bare AssertionError and cleared `.answer`; after a `break`, the answer was ended."""
    ids = tiny_engine.generate_context_cache(DOCS)
    whole = tiny_engine.generate("How many basins?", ids, max_new_tokens=6)
    stream = tiny_engine.generate("How many basins?", ids, stream=True, max_new_tokens=6)
    pieces = list(stream)
    assert stream.finish() == stream.answer and stream.answer.token_ids == whole.token_ids
    assert list(stream) == [] and stream.answer is not None  # read again: nothing more
    with pytest.raises(ConfigError, match="stream must be True or False, got 'no'"):
        tiny_engine.generate("How many basins?", ids, stream="no")  # (it streamed)
    paused = tiny_engine.generate("How many basins?", ids, stream=True, max_new_tokens=6)
    first = next(iter(paused))  # a loop that breaks after one piece
    rest = list(paused)  # goes on from the next piece
    assert [first, *rest] == pieces
    assert paused.finish().token_ids == whole.token_ids
    with tiny_engine.generate("How many basins?", ids, stream=True) as ended:
        next(iter(ended))  # read one piece, then leave: the answer ends with the block
    with pytest.raises(RagKVCacheError, match="closed before its end"):
        ended.finish()


def test_the_system_prompts_entry_cannot_be_expired(tiny_engine) -> None:
    """`expire_cache(engine.prefix_id)` was accepted, and every later answer of the engine
    failed with an UnknownCacheIdError naming an ID the user never gave."""
    ids = tiny_engine.generate_context_cache(DOCS)
    with pytest.raises(ConfigError, match="the system prompt's KV, .* cannot be expired"):
        tiny_engine.expire_cache(tiny_engine.prefix_id)
    assert tiny_engine.generate("How many basins?", ids, max_new_tokens=2).token_ids


def test_the_system_prompts_entry_is_not_a_chunk(tiny_engine) -> None:
    """`prefix_id` among the cache IDs was linked a second time after the system prompt."""
    ids = tiny_engine.generate_context_cache(DOCS)
    asked = [ids[0], tiny_engine.prefix_id]
    with pytest.raises(ConfigError, match=r"cache_ids\[1\] is .*the system prompt's KV"):
        tiny_engine.generate("How many basins?", asked)
    with pytest.raises(ConfigError, match="system prompt's KV"):
        tiny_engine.generate_batch([BatchRequest("How many basins?", asked)])
    with pytest.raises(ConfigError, match="system prompt's KV"):
        tiny_engine.prompt_ids("How many basins?", asked)
    with pytest.raises(ConfigError, match="system prompt's KV"):  # the engine loop's path
        asyncio.run(tiny_engine.agenerate("How many basins?", asked))


def test_a_stream_that_failed_says_so_when_read_again(tiny_engine) -> None:
    def steps():
        yield "a"
        raise ContextTooLongError("too long")

    stream = AnswerStream(steps())
    with pytest.raises(ContextTooLongError):
        list(stream)
    with pytest.raises(RagKVCacheError, match="stopped with ContextTooLongError"):
        stream.finish()


def test_a_stream_read_from_a_second_thread_is_refused_and_the_first_reads_on() -> None:
    """A second thread reading a stream got the generator's ValueError, and the answer was
    marked failed for the thread that was reading it. `close()` from another thread (a stop
    button) raised the same ValueError; it now waits for the piece being decoded."""
    decoding, go_on = threading.Event(), threading.Event()

    def steps():
        yield "a"
        decoding.set()
        go_on.wait(10)
        yield "b"
        yield "c"
        return "done"

    stream = AnswerStream(steps())  # type: ignore[arg-type]
    reader = iter(stream)
    assert next(reader) == "a"
    pieces: list[str] = []
    second = threading.Thread(target=lambda: pieces.append(next(reader)))
    second.start()
    assert decoding.wait(10)  # the first reader is decoding "b"
    with pytest.raises(RagKVCacheError, match="another thread is reading this answer"):
        next(iter(stream))
    go_on.set()
    second.join(10)
    assert pieces == ["b"] and list(stream) == ["c"] and stream.answer == "done"

    decoding.clear()
    go_on.clear()
    stopped, read = AnswerStream(steps()), list[str]()  # type: ignore[arg-type]
    reading = threading.Thread(target=lambda: read.extend(stopped))
    reading.start()
    assert decoding.wait(10)
    stopper = threading.Thread(target=stopped.close)
    stopper.start()  # the piece being decoded is the last
    while not stopped._closed.is_set():  # (the stop is asked before that piece is done)
        time.sleep(0.001)
    go_on.set()
    stopper.join(10)
    reading.join(10)
    assert read == ["a", "b"] and not stopper.is_alive()  # the reader's loop just ended
    assert stopped.answer is None
    with pytest.raises(RagKVCacheError, match="closed before its end"):
        stopped.finish()


def test_a_stream_closed_while_read_ends_its_loop_quietly(tiny_engine) -> None:
    """A stop button (`close()` from another thread, at any moment) gave the reading thread
    "another thread is reading this answer" in most runs, and a `close()` inside the loop
    made that loop raise: the pieces now end, as a closed generator's do."""
    ids = tiny_engine.generate_context_cache(DOCS)
    whole = tiny_engine.generate("How many basins?", ids, max_new_tokens=40).text
    for delay in (0.0, 0.001, 0.005, 0.02, 0.05):
        stream = tiny_engine.generate("How many basins?", ids, stream=True, max_new_tokens=40)
        pieces, errors = list[str](), list[BaseException]()

        def read(stream=stream, pieces=pieces, errors=errors) -> None:
            try:
                pieces.extend(stream)
            except BaseException as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(delay)
        stream.close()
        reader.join(30)
        assert not reader.is_alive() and errors == []
        assert whole.startswith("".join(pieces).strip())
    inside = tiny_engine.generate("How many basins?", ids, stream=True, max_new_tokens=40)
    got = []
    for piece in inside:
        got.append(piece)
        if len(got) == 2:
            inside.close()
    assert len(got) == 2 and inside.answer is None and list(inside) == []


def test_caching_is_idempotent_and_expiry_is_final(tiny_engine) -> None:
    first = tiny_engine.generate_context_cache(DOCS)
    size = len(tiny_engine.store)
    assert tiny_engine.generate_context_cache(DOCS[::-1]) == first[::-1]
    assert len(tiny_engine.store) == size  # nothing re-encoded
    assert tiny_engine.expire_cache(first[0])
    with pytest.raises(UnknownCacheIdError, match=first[0]):
        tiny_engine.generate("q", first)
    with pytest.raises(UnknownCacheIdError, match="deadbeef"):
        tiny_engine.generate("q", ["deadbeef"])


def test_unknown_cache_ids_are_quoted_alike_whatever_they_are(tiny_engine) -> None:
    """A well-formed unknown ID was shown bare and a malformed one quoted, so `''` or an ID
    holding ", " could not be told apart in the message."""
    long = "f" * 500
    for ids in (["deadbeef", "", None, "a, b", long], ["", None, "a, b", long, "deadbeef"]):
        with pytest.raises(UnknownCacheIdError) as raised:
            tiny_engine.generate("q", ids, strategy="legolink:2")  # (no placement: in order)
        shown = ", ".join(repr(c) if c != long else repr(c)[:77] + "..." for c in ids)
        assert str(raised.value).startswith(f"unknown cache ID(s): {shown}; ingest")
        assert raised.value.cache_ids == ids


def test_bad_input(tiny_engine, tiny32) -> None:
    with pytest.raises(EmptyChunkError, match="text 1 is empty"):
        tiny_engine.generate_context_cache(["fine", "  \n"])
    long_doc = " ".join(["harbor"] * 300)  # ~300 tokens each; the tiny window is 512
    with pytest.raises(ContextTooLongError, match="exceed the model's window of 512"):
        tiny_engine.generate("q", tiny_engine.generate_context_cache([long_doc, long_doc + " x"]))
    with pytest.raises(ContextTooLongError, match="window is 512"):
        tiny_engine.generate_context_cache([long_doc * 2])
    short = tiny_engine.generate_context_cache(["The harbor is deep."])
    with pytest.raises(ContextTooLongError, match="the question is .* ask a shorter question"):
        tiny_engine.generate(" ".join(["harbor"] * 600), short)  # fewer chunks cannot help
    other = RagKVCache(lm=tiny32, store=tiny_engine.store)  # a second model sharing the store
    stranger = tiny_engine.generate_context_cache(["only the float64 model encoded this"])
    with pytest.raises(FingerprintMismatchError, match="ingest its text again"):
        other.generate("q", stranger)


def test_a_string_or_other_objects_where_a_list_belongs_are_one_clear_error(tiny_engine) -> None:
    """A lone string was read as one item per character: `generate_context_cache("abc")`
    cached three one-letter chunks, `generate("q", an_id)` named 32 unknown one-character IDs;
    None or bytes in a list raised AttributeError / TypeError. Nothing is cached or linked."""
    (cid,) = tiny_engine.generate_context_cache(["The harbor is deep."])
    size = len(tiny_engine.store)
    calls = {
        "generate_context_cache": lambda: tiny_engine.generate_context_cache("abc"),
        "ingest_document": lambda: tiny_engine.ingest_document("z.md", "xyz"),
        "generate": lambda: tiny_engine.generate("q", cid),
        "stream": lambda: tiny_engine.generate("q", cid, stream=True),
        "prompt_ids": lambda: tiny_engine.prompt_ids("q", cid),
        "batch": lambda: tiny_engine.generate_batch([BatchRequest("q", cid)]),  # type: ignore[arg-type]
    }
    for call in calls.values():  # (named for the reader; a failure shows its line)
        with pytest.raises(ConfigError, match="must be a list of strings, got str: for one, pass"):
            call()
    for bad, kind in ((None, "NoneType"), (b"hello", "bytes")):
        with pytest.raises(ConfigError, match=rf"texts\[1\] must be a string, got {kind}"):
            tiny_engine.generate_context_cache(["fine", bad])  # type: ignore[list-item]
        with pytest.raises(UnknownCacheIdError, match=repr(bad)):  # named, as unknown
            tiny_engine.generate("q", [bad])  # type: ignore[list-item]
    for unordered in ({cid}, {cid: 1}):
        with pytest.raises(ConfigError, match="must be a list of strings, got (set|dict)"):
            tiny_engine.generate("q", unordered)  # type: ignore[arg-type]
    assert len(tiny_engine.store) == size
    wanted = tiny_engine.generate("q", [cid]).token_ids  # other ordered iterables are lists
    assert tiny_engine.generate("q", (cid,)).token_ids == wanted
    assert tiny_engine.generate("q", iter([cid])).token_ids == wanted  # type: ignore[arg-type]
    batched = tiny_engine.generate_batch([BatchRequest("q", iter([cid]))])  # type: ignore[arg-type]
    assert batched.answers[0].token_ids == wanted  # read once: it was answered over no chunk
    assert tiny_engine.generate_context_cache(t for t in ["The harbor is deep."]) == [cid]  # type: ignore[arg-type]


def test_a_text_too_long_for_the_window_is_refused_before_it_is_tokenized(
    tiny_engine, monkeypatch
) -> None:
    """A few MB of question or prompt took seconds to tokenize only to be refused: past
    twice the characters the window's tokens can spell, it is refused unread. Under that, the
    tokens decide (as before)."""
    short = tiny_engine.generate_context_cache(["The harbor is deep."])
    longest = max(len(t) for t in tiny_engine.lm.tokenizer.get_vocab())
    limit = 2 * tiny_engine.lm.max_context * longest
    read: list[int] = []

    def counted(original):
        def tokenize(self, tokenizer, text):
            read.append(len(text))
            return original(self, tokenizer, text)

        return tokenize

    for name in ("question_ids", "tokenize"):
        monkeypatch.setattr(PromptTemplate, name, counted(getattr(PromptTemplate, name)))
    huge = "harbor " * (limit // 7 + 1)
    with pytest.raises(ContextTooLongError, match=f"{len(huge):,} characters: more tokens"):
        tiny_engine.generate(huge, short)
    with pytest.raises(ContextTooLongError, match="send a shorter prompt"):
        tiny_engine.complete(huge)
    with pytest.raises(ContextTooLongError, match="send a shorter question"):
        tiny_engine.generate_batch([BatchRequest(huge, short)])
    assert read == []
    under = huge[: limit - 7]  # tokenized: then past the window by its tokens
    with pytest.raises(ContextTooLongError, match="ask a shorter question"):
        tiny_engine.generate(under, short)
    assert read == [len(under)]


def test_the_length_bound_holds_only_where_every_character_is_read(tiny_tokenizer) -> None:
    """The early refusal counts the characters a token can spell. A tokenizer that folds any
    run of unknown characters into one token (BPE with fused unknowns, Unigram) has no such
    bound: there it is left to the tokens (1000 snowmen are one token)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def longest(tokenizer) -> int | None:
        return RagKVCache._longest_token.func(
            SimpleNamespace(lm=SimpleNamespace(tokenizer=tokenizer))
        )

    fused = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=True))
    unigram = Tokenizer(models.Unigram([("[UNK]", 0.0), ("a", -1.0)], unk_id=0))
    for model in (fused, unigram):
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]")
        assert tokenizer("☃" * 1000, add_special_tokens=False)["input_ids"] == [0]
        assert longest(tokenizer) is None
    assert longest(tiny_tokenizer) == max(len(t) for t in tiny_tokenizer.get_vocab())


def test_sampling_is_reproducible(tiny_engine) -> None:
    ids = tiny_engine.generate_context_cache(DOCS)
    sampled = EngineConfig(generation=GenerationConfig(max_new_tokens=8, temperature=1.0, seed=7))
    engine = RagKVCache(sampled, lm=tiny_engine.lm, store=tiny_engine.store)
    assert engine.generate("q", ids).token_ids == engine.generate("q", ids).token_ids
    unseeded = RagKVCache(EngineConfig(), lm=tiny_engine.lm, store=tiny_engine.store)
    answers = {
        unseeded.generate("q", ids, temperature=2.0, max_new_tokens=8).token_ids for _ in range(4)
    }
    assert len(answers) > 1  # no seed: each answer drawn anew (as OpenAI's API does)


def test_sink_encoded_chunks_link_with_legolink0(tiny64) -> None:
    engine = RagKVCache(EngineConfig(encode=EncodeConfig(sink_tokens=3)), lm=tiny64)
    ids = engine.generate_context_cache(DOCS)
    assert all(c.start == 3 for c in engine.store.get(ids))
    full = engine.generate("q", ids, strategy="full", max_new_tokens=6)
    plain = engine.generate("q", ids, strategy="prefill", max_new_tokens=6)
    assert full.token_ids == plain.token_ids
    assert engine.generate("q", ids, strategy="legolink0", max_new_tokens=6).recomputed_tokens == 0


# ----------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def smol_engine(smol):
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=24)), lm=smol)
    texts = [p.read_text() for p in sorted(DATA.glob("0*.md"))[:3]]
    return engine, engine.generate_context_cache(texts)


def test_smollm2_full_link_equals_prefill(smol_engine) -> None:
    engine, ids = smol_engine
    question = "Who is the current Harbor Reeve of Velmora?"
    chunks = engine.store.get([engine.prefix_id, *ids])
    query = engine.template.question_ids(engine.lm.tokenizer, question)
    _, logits = prefill(engine.lm, engine.prompt_ids(question, ids))
    linked = link(engine.lm, chunks, query, Strategy.parse("full"))
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-4, atol=2e-4)
    full = engine.generate(question, ids, strategy="full")
    plain = engine.generate(question, ids, strategy="prefill")
    assert full.token_ids == plain.token_ids
    assert "Morrow-Kade" in plain.text  # the real model reads the cached document
    lego_all = engine.generate(question, ids, strategy="legolink:100000")
    assert lego_all.token_ids == plain.token_ids


def test_smollm2_mask_matches_reference(smol_engine) -> None:
    engine, ids = smol_engine
    chunks = engine.store.get([engine.prefix_id, *ids[:2]])
    query = engine.template.question_ids(engine.lm.tokenizer, "What year was the light built?")
    fast = link(engine.lm, chunks, query, Strategy.parse("legolink:3"))
    slow = link_reference(engine.lm, chunks, query, Strategy.parse("legolink:3"))
    torch.testing.assert_close(fast.next_logits, slow.next_logits, rtol=1e-4, atol=2e-4)


def test_store_config_opens_a_tiered_store(tiny64, tmp_path) -> None:
    from rag_kvcache.config import StoreConfig
    from rag_kvcache.storage.store import TieredStore

    config = EngineConfig(store=StoreConfig(root=tmp_path, cpu_bytes=1 << 20, policy="lfu"))
    engine = RagKVCache(config, lm=tiny64)
    assert isinstance(engine.store, TieredStore) and engine.store.reencode is not None
    ids = engine.generate_context_cache(DOCS)
    assert engine.store.catalog.chunk(ids[0]).text == DOCS[0]  # kept for re-encoding
    assert engine.generate("q", ids, strategy="full", max_new_tokens=4).token_ids == (
        engine.generate("q", ids, strategy="prefill", max_new_tokens=4).token_ids
    )
    engine.store.close()
