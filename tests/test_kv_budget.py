"""One KV budget for batched answering: the prefix tree's nodes and the batch's rows together.

Requests whose KV would not fit wait, first in line, until one leaves; idle tree nodes are
evicted to make room (never the path a request extends); a request that cannot fit even
alone fails with a clear error and the others go on. Whatever waits, every answer equals
`generate` alone."""

from __future__ import annotations

import gc
import os

import pytest
from helpers import SERVING_DOCS

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.answer import Answer
from rag_kvcache.errors import ConfigError, ContextTooLongError, KVBudgetError
from rag_kvcache.kv import KVStore
from rag_kvcache.serving import batch_kv
from rag_kvcache.serving.batch import BatchDecoder, BatchRequest, tree_path
from rag_kvcache.strategy import Strategy

DOCS = SERVING_DOCS
QUESTIONS = [
    "Who designed the lighthouse?",
    "When was it first lit?",
    "How deep is the harbor?",
    "When is the festival?",
    "How many crews are there?",
]
NEW = 6
STRATEGY = Strategy.parse("legolink:2")


def engine_with(tiny64, kv_cache_bytes: int | None, store: KVStore | None = None) -> RagKVCache:
    config = EngineConfig(
        generation=GenerationConfig(max_new_tokens=NEW),
        strategy=STRATEGY,
        kv_cache_bytes=kv_cache_bytes,
    )
    return RagKVCache(config, lm=tiny64, store=store)


def row_bytes(engine: RagKVCache, query: str, cache_ids: list[str]) -> int:
    """One request's KV alone: its whole prompt and room for its answer."""
    tokens = len(engine.prompt_ids(query, cache_ids)) + NEW
    return tokens * engine.lm.kv_bytes_per_token


def drive(engine: RagKVCache, decoder: BatchDecoder, asked: list[tuple[str, list[str]]]):
    """Add every request at once and step to the end. After each step the rows are laid out
    (as the next step would) and the KV held is checked against the budget. Returns the
    answers (or errors) by request, and the most requests decoding at once."""
    ids = []
    for query, cache_ids in asked:
        request = engine._loop_request(query, cache_ids, STRATEGY, engine.generation_config(NEW))
        ids.append(
            decoder.add_request(
                list(request.path), list(request.question), request.config, request.strategy
            )
        )
    results: dict[int, Answer | Exception] = {}
    most = 0
    tree = decoder.tree
    while decoder.has_work:
        for out in decoder.step():
            if out.error is not None:
                results[out.request_id] = out.error
            elif out.done is not None:
                results[out.request_id] = engine._answer(out.done)
        most = max(most, len(decoder.active))
        decoder.pack(list(decoder.active.values()))  # the layout the next step decodes in
        assert tree.in_use() <= tree.budget_bytes
        assert decoder.load.decoding == len(decoder.active)
    return [results[i] for i in ids], most


def test_requests_beyond_the_budget_wait_and_answer_as_alone(tiny64) -> None:
    """Five requests over different chunks after the shared system prompt, a budget that
    holds the system prompt once and the rest of about two of them (each row with its copy
    of the system prompt, which is short): two decode at once, the KV held never passes the
    budget, and every answer equals `generate` alone."""
    probe = engine_with(tiny64, None)
    ids = probe.generate_context_cache(DOCS)
    asked = [(q, [ids[i]]) for i, q in enumerate(QUESTIONS)]
    system_tokens = probe.store.get([probe.prefix_id])[0].num_tokens
    assert system_tokens < batch_kv.COPIED_TOKENS  # copied into every row that uses it
    system = system_tokens * tiny64.kv_bytes_per_token
    row = max(row_bytes(probe, q, c) for q, c in asked)  # its own tokens and the copy
    budget = system + int(2.5 * row)
    engine = engine_with(tiny64, budget)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, probe.store.get)
    answers, most = drive(engine, decoder, asked)
    assert most == 2  # they waited for room, and did share the batch
    for (query, cache_ids), answer in zip(asked, answers, strict=True):
        alone = probe.generate(query, cache_ids, max_new_tokens=NEW)
        assert isinstance(answer, Answer) and isinstance(alone, Answer)
        assert answer.token_ids == alone.token_ids
    assert decoder.peak_bytes <= budget * 1.25  # re-laying out: a layer twice
    assert sum(n.refs for n in engine.prefix_tree.nodes()) == 0


def test_a_shared_prefix_counts_once(tiny64) -> None:
    """Four requests over the same three chunks fit a budget that could not hold four
    private copies of them: the shared nodes are counted once, and all four decode at once."""
    probe = engine_with(tiny64, None)
    ids = probe.generate_context_cache(DOCS)[:3]
    asked = [(q, ids) for q in QUESTIONS[:4]]
    one = max(row_bytes(probe, q, c) for q, c in asked)
    engine = engine_with(tiny64, 2 * one)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, probe.store.get)
    answers, most = drive(engine, decoder, asked)
    assert most == 4
    for (query, cache_ids), answer in zip(asked, answers, strict=True):
        alone = probe.generate(query, cache_ids, max_new_tokens=NEW)
        assert isinstance(answer, Answer) and isinstance(alone, Answer)
        assert answer.token_ids == alone.token_ids


def test_idle_prefixes_are_evicted_to_make_room_but_not_the_path_extended(tiny64) -> None:
    """Two earlier requests' paths stay in the tree, idle. A request that extends one of
    them, under a budget that holds its own KV and not the other path too, evicts the other
    path and keeps its own."""
    probe = engine_with(tiny64, None)
    ids = probe.generate_context_cache(DOCS)
    extended = ("When was it first lit?", [ids[0], ids[1]])
    other_tokens = probe.store.get([ids[3]])[0].num_tokens
    budget = row_bytes(probe, *extended) + (other_tokens - 1) * tiny64.kv_bytes_per_token
    engine = engine_with(tiny64, budget, store=probe.store)
    tree = engine.prefix_tree
    engine.generate_batch([_request("Who designed it?", [ids[0]])])
    engine.generate_batch([_request("When is the festival?", [ids[3]])])
    cached = {c for n in tree.nodes() for c in n.cache_ids}
    assert ids[0] in cached and ids[3] in cached  # both idle paths fitted
    answer = engine.generate_batch([_request(*extended)]).answers[0]
    assert answer.reused_tokens > 0  # it built on the first request's path
    cached = {c for n in tree.nodes() for c in n.cache_ids}
    assert ids[3] not in cached and {ids[0], ids[1]} <= cached  # the other path made room
    assert all(n.parent is None or n.parent in tree.nodes() for n in tree.nodes())
    assert tree.in_use() <= budget
    alone = probe.generate(*extended, max_new_tokens=NEW)
    assert isinstance(alone, Answer) and answer.token_ids == alone.token_ids


def test_a_request_beyond_the_whole_budget_fails_clearly_and_the_others_go_on(tiny64) -> None:
    probe = engine_with(tiny64, None)
    ids = probe.generate_context_cache(DOCS)
    small = ("Who designed the lighthouse?", [ids[0]])
    big = ("How deep is the harbor?", ids)
    engine = engine_with(tiny64, int(1.5 * row_bytes(probe, *small)))
    decoder = BatchDecoder(tiny64, engine.prefix_tree, probe.store.get)
    answers, _ = drive(engine, decoder, [small, big, small])
    error = answers[1]
    assert isinstance(error, KVBudgetError) and isinstance(error, ContextTooLongError)
    assert "kv_cache_bytes" in str(error) and "MiB" in str(error)
    alone = probe.generate(*small, max_new_tokens=NEW)
    assert isinstance(alone, Answer)
    for answer in (answers[0], answers[2]):
        assert isinstance(answer, Answer) and answer.token_ids == alone.token_ids
    assert not decoder.has_work and sum(n.refs for n in engine.prefix_tree.nodes()) == 0


def test_the_batch_size_and_the_budget_share_one_count_across_decoders(tiny64) -> None:
    """The engine loop's rows and a `generate_batch` decoder's count under one budget: the
    tree knows every batch decoding over it, and forgets one that is gone."""
    engine = engine_with(tiny64, None)
    tree = engine.prefix_tree
    first = BatchDecoder(tiny64, tree, engine.store.get)
    second = BatchDecoder(tiny64, tree, engine.store.get)
    assert set(tree.batches) == {first.kv, second.kv}
    del first
    gc.collect()
    assert set(tree.batches) == {second.kv}


def test_the_default_budget_is_a_quarter_of_the_machines_memory(tiny64) -> None:
    engine = engine_with(tiny64, None)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert engine.prefix_tree.budget_bytes == memory // 4
    assert engine_with(tiny64, 123).prefix_tree.budget_bytes == 123


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes=-1)


def _request(query: str, cache_ids: list[str]) -> BatchRequest:
    return BatchRequest(query, tuple(cache_ids), NEW)


def asked_over(engine: RagKVCache, decoder: BatchDecoder, query: str, cache_ids: list[str]):
    """Queue a request; returns what admission will count it as (`kv_after`)."""
    request = engine._loop_request(query, cache_ids, STRATEGY, engine.generation_config(NEW))
    found = decoder.tree.match(tree_path(STRATEGY, list(request.path)))
    chunks = engine.store.get(list(request.path))
    tokens = sum(c.num_tokens for c in chunks[found.chunks :]) + len(request.question) + NEW
    projected = decoder.kv_after(found.nodes, tokens)
    decoder.add_request(
        list(request.path), list(request.question), request.config, request.strategy
    )
    return projected


def test_admission_counts_exactly_the_layout_that_follows(tiny64) -> None:
    """What admission counts is the KV held once the request has its row: a request whose
    chunks are new (linked into the tree, inlined in its row), one over a path in the tree
    another request uses (both rows leave it shared), and one in a second batch (as
    `generate_batch` makes beside the engine loop's) over a path the first batch's row holds:
    its copy and the row's both count."""
    engine = engine_with(tiny64, None)
    ids = engine.generate_context_cache(DOCS)
    tree = engine.prefix_tree
    first = BatchDecoder(tiny64, tree, engine.store.get)
    expected = asked_over(engine, first, "Who designed it?", ids[:2])
    first.step()
    first.pack(list(first.active.values()))
    assert tree.in_use() == expected and first.kv.inlined_nbytes > 0
    second = BatchDecoder(tiny64, tree, engine.store.get)
    expected = asked_over(engine, second, "When was it lit?", ids[:2])
    second.step()
    second.pack(list(second.active.values()))
    assert second.kv.inlined_nbytes > 0 and first.kv.inlined_nbytes == 0  # moved, not shared
    assert tree.in_use() == expected
    expected = asked_over(engine, first, "How deep?", [ids[2]])
    first.step()
    first.pack(list(first.active.values()))
    assert tree.in_use() == expected


def test_a_request_that_must_wait_leaves_the_idle_prefixes_cached(tiny64) -> None:
    """A waiting request that would not fit even with every idle prefix evicted evicts none
    of them: the cache stays warm for the requests that do fit."""
    probe = engine_with(tiny64, None)
    ids = probe.generate_context_cache(DOCS)
    small = ("Who?", [ids[0]])
    budget = 3 * row_bytes(probe, *small)
    engine = engine_with(tiny64, budget, store=probe.store)
    tree = engine.prefix_tree
    engine.generate_batch([_request("When is the festival?", [ids[3]])])
    assert any(ids[3] in n.cache_ids for n in tree.nodes())  # an idle path
    decoder = BatchDecoder(tiny64, tree, probe.store.get)
    asked_over(engine, decoder, *small)
    big = engine._loop_request("How deep?", ids[:3], STRATEGY, engine.generation_config(200))
    decoder.add_request(list(big.path), list(big.question), big.config, STRATEGY)
    decoder.step()
    assert decoder.full and len(decoder.active) == 1
    assert any(ids[3] in n.cache_ids for n in tree.nodes())  # still cached


def test_the_published_load_follows_an_abort(tiny64) -> None:
    engine = engine_with(tiny64, None)
    ids = engine.generate_context_cache(DOCS)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, engine.store.get)
    asked_over(engine, decoder, "Who?", ids[:1])
    decoder.step()
    assert decoder.load.decoding == 1 and decoder.load.kv_bytes > 0
    decoder.abort(next(iter(decoder.active)))
    assert not decoder.has_work and decoder.load.decoding == 0
    assert decoder.load.kv_bytes == engine.prefix_tree.in_use()
