"""Batched generation over shared linked prefixes equals generating each request alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SERVING_DOCS, linked_span

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.answer import Answer
from rag_kvcache.engine import BatchResult
from rag_kvcache.errors import ConfigError, StrategyError, UnknownCacheIdError
from rag_kvcache.link.linker import LinkedPrefix, link
from rag_kvcache.model.adapter import key_bias
from rag_kvcache.serving import batch_kv
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.strategy import Strategy

DOCS = SERVING_DOCS


def mixed_requests(ids: list[str]) -> list[BatchRequest]:
    """Shared leading chunks, a request that is a prefix of another, reordered chunks,
    an unshared one, the same chunks with another question, and different lengths."""
    return [
        BatchRequest("Who designed the lighthouse?", (ids[0], ids[1], ids[2])),
        BatchRequest("When was it first lit?", (ids[0], ids[1], ids[3])),
        BatchRequest("How deep is the harbor?", (ids[0], ids[1]), max_new_tokens=3),
        BatchRequest("When is the festival?", (ids[3], ids[4])),
        BatchRequest("Who designed the lighthouse?", (ids[1], ids[0])),
        BatchRequest("How many crews?", (ids[0], ids[1], ids[2])),
        BatchRequest("What burned until 1861?", ()),
    ]


def batched_and_alone(
    engine: RagKVCache,
    requests: list[BatchRequest],
    strategy: str | None = None,
    max_batch: int = 4,
) -> tuple[BatchResult, list[Answer]]:
    """The requests answered as one batch and each alone (None: the engine's strategy), after
    asserting they are equal, text and prompt included."""
    result = engine.generate_batch(requests, strategy=strategy, max_batch=max_batch)
    alone = []
    for request, answer in zip(requests, result.answers, strict=True):
        single = engine.generate(
            request.query,
            list(request.cache_ids),
            strategy=strategy,
            max_new_tokens=request.max_new_tokens,
        )
        assert isinstance(single, Answer)
        assert answer.token_ids == single.token_ids and answer.text == single.text
        assert answer.prompt_tokens == single.prompt_tokens
        alone.append(single)
    return result, alone


@pytest.mark.parametrize(
    "strategy",
    [
        "legolink:2",
        "full",
        "naive",
        "naive+top:2",
        "legolink:1+top:2+window:3",
        "legolink:2+ape:0.7,0.5",
        "naive+top:1+window:3+ape:1,0.5",
    ],
)
def test_linking_after_a_linked_prefix_equals_linking_all_at_once(tiny64, strategy) -> None:
    """The prefix carries what linking it left behind, APE's score bias on its stale tokens
    included (its keys are tempered already)."""
    engine = RagKVCache(EngineConfig(), lm=tiny64)
    ids = engine.generate_context_cache(DOCS[:3])
    chunks = engine.store.get([engine.prefix_id, *ids])
    question = engine.template.question_ids(tiny64.tokenizer, "Who designed it?")
    whole = link(tiny64, chunks, question, Strategy.parse(strategy))
    first = link(tiny64, chunks[:2], [1], Strategy.parse(strategy))  # chunk 1 is ranked first
    P = first.context_tokens
    keys, values = linked_span(first, 0, P)
    tokens = tuple(t for c in chunks[:2] for t in c.token_ids)
    in_full = Strategy.parse(strategy).in_full(len(chunks) - 1)  # the whole request's ranks
    bias = key_bias(first.cache)
    assert (bias is not None) == (Strategy.parse(strategy).scale != 1)
    rest = link(
        tiny64,
        chunks[2:],
        question,
        Strategy.parse(strategy),
        prefix=LinkedPrefix(
            keys,
            values,
            tokens,
            system_tokens=chunks[0].num_tokens,
            key_bias=None if bias is None else bias[:P],
        ),
        in_full=in_full[1:],
    )
    torch.testing.assert_close(rest.next_logits, whole.next_logits, rtol=1e-10, atol=1e-10)
    for a, b in zip(linked_span(rest, 0, rest.length), linked_span(whole, 0, whole.length)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert rest.recomputed == whole.recomputed - first.recomputed
    with pytest.raises(StrategyError, match="cacheblend"):
        link(
            tiny64,
            chunks[2:],
            question,
            Strategy.parse("cacheblend:0.5"),
            prefix=LinkedPrefix(keys, values, tokens),
        )


# never copied (every shared node attended apart, the cascade's first phase), and the
# default (short shared nodes such as the system prompt copied into each row)
@pytest.fixture(params=[0, batch_kv.COPIED_TOKENS], ids=["none-copied", "short-copied"])
def copied_tokens(request, monkeypatch) -> int:
    monkeypatch.setattr(batch_kv, "COPIED_TOKENS", request.param)
    return request.param


@pytest.mark.parametrize("max_batch", [1, 3, 32])
def test_batched_generation_equals_each_request_alone(tiny64, max_batch, copied_tokens) -> None:
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=6)), lm=tiny64)
    ids = engine.generate_context_cache(DOCS)
    requests = mixed_requests(ids)
    result, _ = batched_and_alone(engine, requests, max_batch=max_batch)
    assert result.answers[2].token_ids and len(result.answers[2].token_ids) <= 3
    reused = [a.reused_tokens for a in result.answers]
    prefix_tokens = len(engine.template.prefix_ids(tiny64.tokenizer))
    assert all(r >= prefix_tokens for r in reused[1:])  # the system prompt is always shared
    assert reused[5] == result.answers[5].prompt_tokens - len(
        engine.template.question_ids(tiny64.tokenizer, "How many crews?")
    )  # its whole context was linked by the first request
    # a second call finds everything linked already
    again = engine.generate_batch(requests[:2], max_batch=max_batch)
    assert [a.token_ids for a in again.answers] == [a.token_ids for a in result.answers[:2]]
    assert all(a.recomputed_tokens == 0 for a in again.answers)


@pytest.mark.parametrize(
    "strategy, shared",
    [
        ("legolink:1+top:1", True),
        ("naive+reversed+top:1", False),
        ("naive+reversed+top:1+window:8", False),
        ("legolink:1+top:1+ape:0.7,0.5", True),
        ("naive+reversed+top:1+window:8+ape:1,0.5", False),
    ],
)
def test_batched_top_strategies_equal_each_request_alone(
    tiny64, strategy, shared, copied_tokens
) -> None:
    """A chunk recomputed whole in one request (ranked first) and stale in another (ranked
    lower) is linked to different KV: sharing them would change answers."""
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=6)), lm=tiny64)
    ids = engine.generate_context_cache(DOCS)
    requests = [*mixed_requests(ids), BatchRequest("Who lit it?", (ids[0],))]
    result, alone = batched_and_alone(engine, requests, strategy)
    # the last request's one chunk is ranked first (whole). In the given order an earlier
    # request linked it whole at the same place: shared. Reversed, an earlier request placed
    # it first but ranked it second (stale): it must be recomputed, not taken from the tree.
    last, last_alone = result.answers[-1], alone[-1]
    assert last.recomputed_tokens == (0 if shared else last_alone.recomputed_tokens)
    assert last_alone.recomputed_tokens > 0
    with pytest.raises(StrategyError, match="in_full"):
        whole = engine.store.get([engine.prefix_id, *ids[:2]])
        first = link(tiny64, whole[:2], [1], Strategy.parse(strategy))
        keys, values = linked_span(first, 0, first.context_tokens)
        tokens = tuple(t for c in whole[:2] for t in c.token_ids)
        link(
            tiny64,
            whole[2:],
            [1],
            Strategy.parse(strategy),
            prefix=LinkedPrefix(keys, values, tokens),
        )


def test_batched_ends_placement_equals_each_request_alone(tiny64) -> None:
    """`+ends` moves the second-ranked chunk to the front: requests that share chunks in
    another rank order start differently, and the tree shares only what is placed alike."""
    strategy = "legolink:1+ends+top:1+ape:1,0.5"
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=6)), lm=tiny64)
    ids = engine.generate_context_cache(DOCS)
    requests = mixed_requests(ids)
    result, _ = batched_and_alone(engine, requests, strategy)
    # the sixth request has the first one's chunks, so the same placement: all of it shared
    question = engine.template.question_ids(tiny64.tokenizer, "How many crews?")
    assert result.answers[5].reused_tokens == result.answers[5].prompt_tokens - len(question)


@pytest.mark.parametrize("strategy", ["cacheblend:0.5"])
def test_batches_refuse_what_the_tree_cannot_share_with_a_clear_error(tiny64, strategy) -> None:
    """cacheblend's whole-context selection cannot ride on a shared prefix: refused up front
    (it would fail only at the second request sharing the system prompt's node)."""
    engine = RagKVCache(EngineConfig(), lm=tiny64)
    ids = tuple(engine.generate_context_cache(DOCS[:2]))
    twice = [BatchRequest("Who?", ids), BatchRequest("When?", ids)]
    with pytest.raises(StrategyError, match="one at a time"):
        engine.generate_batch(twice, strategy=strategy)


def test_batch_settings_are_checked_like_generates(tiny64) -> None:
    """max_batch 0 spun for ever; max_new_tokens 0 answered with the default; one past the
    window was refused for its KV, where `generate` stops the answer at the window."""
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=6)), lm=tiny64)
    ids = tuple(engine.generate_context_cache(DOCS[:2]))
    with pytest.raises(ConfigError, match=r"a BatchRequest\(query, cache_ids\), got tuple"):
        engine.generate_batch([("Who?", ids)])  # type: ignore[list-item]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="max_batch must be a whole number >= 1"):
            engine.generate_batch([BatchRequest("Who?", ids)], max_batch=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_new_tokens must be a whole number >= 1"):
        engine.generate_batch([BatchRequest("Who?", ids, max_new_tokens=0)])
    # an unknown or expired chunk is found before any request is computed
    odd: tuple = (*ids, "f" * 32, "../x", ["a"])  # a list: unhashable, not a TypeError
    known = [BatchRequest("Who?", ids), BatchRequest("When?", odd)]
    with pytest.raises(UnknownCacheIdError) as unknown:
        engine.generate_batch(known)
    assert "f" * 32 in str(unknown.value) and "../x" in str(unknown.value)
    assert engine.prefix_tree.roots == {}  # nothing linked
    past = [BatchRequest("Who?", ids, max_new_tokens=10**30), BatchRequest("When?", ids)]
    result, alone = batched_and_alone(engine, past)
    assert alone[0].prompt_tokens + len(alone[0].token_ids) <= tiny64.max_context + 1
    assert len(result.answers[1].token_ids) <= 6
    assert engine.generate_batch([BatchRequest("Who?", ids)], max_batch=np.int64(2)).answers


@pytest.mark.slow
def test_batched_generation_on_smollm2_equals_each_request_alone(smol) -> None:
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=20)), lm=smol)
    ids = engine.generate_context_cache(DOCS)
    requests = mixed_requests(ids)
    result, _ = batched_and_alone(engine, requests)
    assert "Mara Quell" in result.answers[0].text  # a real answer, not just equal noise
    longest = max(len(a.token_ids) for a in result.answers)
    assert result.stats.steps >= longest - 1  # every token after the first is a batched step


def test_a_batch_of_one_token_answers_counts_the_kv_it_held(tiny64) -> None:
    """A request that ends at its first token is never packed into rows, where the peak was
    counted: `bench serve --new-tokens 1` reported a peak of 0 bytes."""
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=1)), lm=tiny64)
    ids = engine.generate_context_cache(DOCS)
    request = BatchRequest("Who designed the lighthouse?", (ids[0], ids[1], ids[2]))
    result = engine.generate_batch([request])
    (answer,) = result.answers
    assert len(answer.token_ids) == 1
    per_token = tiny64.num_layers * 2 * 2 * 16 * tiny64.dtype.itemsize  # K and V, 2 heads of 16
    assert result.stats.peak_kv_bytes >= answer.context_tokens * per_token > 0
