"""The replayed forward (rag_kvcache.model.graphs) on the CPU: the static forward that CUDA
captures, run eagerly, must answer token for token as the plain forward does, for every kind
of short forward (a link's new tokens with its mask and key bias, a short prefill, each decode
step); the slabs it runs in are lent to one request at a time. tests/test_gpu.py holds the
captured graphs to the same answers on CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import linked_span, random_chunks
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rag_kvcache.answer import prepare
from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import StrategyError
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import LinkedPrefix, link
from rag_kvcache.link.placement import place_together
from rag_kvcache.model import attention, graphs
from rag_kvcache.model.adapter import (
    buffered_cache,
    capture_queries,
    new_buffers,
    release_buffers,
    unpack_cache,
)
from rag_kvcache.model.arithmetic import Arithmetic, counted
from rag_kvcache.model.attention import grouped_sdpa
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.strategy import DEFAULT, Strategy

LENGTHS = [6, 40, 33, 25, 30]  # the system prefix, then four document chunks
QUERY = [7, 8, 9, 10, 11]
STRATEGIES = ["prefill", "naive", "legolink:2", "full", str(DEFAULT), "legolink:2+ape:1,0.5"]


class _Module:  # what transformers' sdpa reads off an attention module
    def __init__(self, groups: int):
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@pytest.mark.parametrize("queries", [1, 5, 40])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("keys", [70, 64])  # 64: the keys split in parts for the matmul
@pytest.mark.parametrize("math_rows", [0, 256])  # every query by sdpa; few by matmuls
def test_grouped_attention_equals_transformers_sdpa(
    queries, heads, kv_heads, keys, math_rows, monkeypatch
) -> None:
    monkeypatch.setattr(attention, "MATH_ROWS", math_rows)
    torch.manual_seed(queries + heads)
    q = torch.randn(1, heads, queries, 16, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, keys, 16, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(queries, keys) < 0.6
    allowed[:, 0] = True  # no row without a key
    mask = torch.zeros(queries, keys, dtype=torch.float64).masked_fill_(~allowed, -1e300)
    mask = mask[None, None]
    theirs, _ = sdpa_attention_forward(_Module(heads // kv_heads), q, k, v, mask, scaling=0.25)
    for given in (mask, allowed[None, None]):  # additive or boolean
        ours = grouped_sdpa(q, k, v, given, 0.25).transpose(1, 2)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def _answer(lm, chunks, strategy: str, tokens: int = 8):
    """(greedy tokens, first logits, the cache's lent slab or None) of one answer."""
    prepared = prepare(lm, chunks, QUERY, Strategy.parse(strategy), reserve=tokens)
    config = GenerationConfig(max_new_tokens=tokens)
    out = list(decode(lm, prepared.cache, prepared.logits, prepared.position, config))
    slab = prepared.cache.layers[0].slab
    kv = [(k.clone(), v.clone()) for k, v in unpack_cache(prepared.cache)]
    release_buffers(prepared.cache)
    return out, prepared.logits, kv, slab


@pytest.fixture
def static_forward(tiny64):
    graphs.use_graphs(tiny64.model, tiny64.device, True, capture=False)
    yield graphs.graphs_of(tiny64.model, tiny64.device)
    graphs.use_graphs(tiny64.model, tiny64.device, False)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_forward_answers_token_for_token_as_the_plain_one(tiny64, strategy) -> None:
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=3))
    plain, plain_logits, plain_kv, slab = _answer(tiny64, chunks, strategy)
    assert slab is None  # off by default on the CPU
    graphs.use_graphs(tiny64.model, tiny64.device, True, capture=False)
    try:
        ours, logits, kv, slab = _answer(tiny64, chunks, strategy)
        assert slab is not None and not slab.lent  # it ran in a slab, handed back after
        # the link (or the short prefill) and the decode steps were replayed forwards
        assert 1 in slab.replays and max(slab.replays) > 1
    finally:
        graphs.use_graphs(tiny64.model, tiny64.device, False)
    assert ours == plain
    torch.testing.assert_close(logits, plain_logits, rtol=1e-9, atol=1e-9)
    for (k1, v1), (k2, v2) in zip(kv, plain_kv, strict=True):  # every layer's KV, decode's too
        torch.testing.assert_close(k1, k2, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-9)
    assert torch.isfinite(slab.keys).all() and torch.isfinite(slab.values).all()


def test_a_forward_past_the_largest_bucket_is_eager_in_the_same_slab(
    tiny64, static_forward, monkeypatch
) -> None:
    monkeypatch.setattr(graphs, "ROW_BUCKETS", (1, 8, 32))
    ids = random_chunks([35], seed=1)[0]
    cache, logits = prefill(tiny64, ids, reserve=2)
    slab = cache.layers[0].slab
    assert slab is not None and slab.replays == {}  # lent, but nothing replayed
    graphs.use_graphs(tiny64.model, tiny64.device, False)
    plain_cache, plain_logits = prefill(tiny64, ids, reserve=2)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-9, atol=1e-9)
    release_buffers(cache)


def test_slabs_are_lent_to_one_request_at_a_time(tiny64, static_forward) -> None:
    first = buffered_cache(tiny64, *new_buffers(tiny64, 100), 0)
    second = buffered_cache(tiny64, *new_buffers(tiny64, 100), 0)
    assert first.layers[0].slab is not None
    assert second.layers[0].slab is not first.layers[0].slab  # not shared while lent
    slab = first.layers[0].slab
    assert slab.capacity % graphs.SLAB_STEP == 0 and slab.capacity > 100  # room for the trash
    release_buffers(first)
    release_buffers(first)  # a second release changes nothing
    third = buffered_cache(tiny64, *new_buffers(tiny64, 90), 0)
    assert third.layers[0].slab is slab  # handed back: lent again
    views = unpack_cache(third)
    del third
    gc.collect()  # a cache dropped without release keeps its slab: views of it may live on
    assert buffered_cache(tiny64, *new_buffers(tiny64, 90), 0).layers[0].slab is not slab
    assert views


def test_a_link_that_fails_halfway_hands_its_slab_back(tiny64, static_forward) -> None:
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=3))
    tokens = [t for c in chunks for t in c.token_ids]
    head = link(tiny64, chunks[:2], QUERY, Strategy.parse("naive"))
    keys, values = linked_span(head, 0, head.context_tokens)
    release_buffers(head.cache)
    prefix = LinkedPrefix(keys, values, tuple(tokens[: head.context_tokens]))  # no system_tokens
    with pytest.raises(StrategyError, match="system_tokens"):  # found after the slab is lent
        link(tiny64, chunks[2:], QUERY, Strategy.parse("naive+window:8"), prefix=prefix)
    assert static_forward.slabs and not any(s.lent for s in static_forward.slabs)


def test_static_forward_after_a_linked_prefix_equals_the_plain_one(tiny64) -> None:
    """The prefix tree's links (KV already linked for the first chunks) replay too."""
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=4))
    tokens = [t for c in chunks for t in c.token_ids]
    strategy = Strategy.parse("legolink:2")

    def linked() -> tuple[torch.Tensor, object]:
        head = link(tiny64, chunks[:3], QUERY, strategy)
        keys, values = linked_span(head, 0, head.context_tokens)
        release_buffers(head.cache)
        prefix = LinkedPrefix(keys, values, tuple(tokens[: head.context_tokens]))
        tail = link(tiny64, chunks[3:], QUERY, strategy, prefix=prefix)
        slab = tail.cache.layers[0].slab
        release_buffers(tail.cache)
        return tail.next_logits, slab

    plain, slab = linked()
    assert slab is None
    graphs.use_graphs(tiny64.model, tiny64.device, True, capture=False)
    try:
        ours, slab = linked()
    finally:
        graphs.use_graphs(tiny64.model, tiny64.device, False)
    assert slab is not None and slab.replays
    torch.testing.assert_close(ours, plain, rtol=1e-9, atol=1e-9)


def test_decoding_past_the_reserve_leaves_the_slab_and_stays_right(tiny64, static_forward):
    """A cache that outgrows its buffers (decoding past `reserve`) is copied out of its slab
    by the eager forward; what it answers does not change, and the slab still goes back."""
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=3))
    config = GenerationConfig(max_new_tokens=6)

    def answer() -> list[int]:
        prepared = prepare(tiny64, chunks, QUERY, Strategy.parse("naive"), reserve=1)
        out = list(decode(tiny64, prepared.cache, prepared.logits, prepared.position, config))
        release_buffers(prepared.cache)
        return out

    ours = answer()
    assert not any(s.lent for s in static_forward.slabs)
    with graphs.paused(tiny64.model, tiny64.device):
        assert answer() == ours


def test_diagnosis_reads_queries_from_the_eager_forward(tiny64, static_forward) -> None:
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=3))
    with capture_queries() as captured:
        prepared = prepare(tiny64, chunks, QUERY, Strategy.parse("naive"))
    release_buffers(prepared.cache)
    assert [layer for layer, *_ in captured] == list(range(tiny64.num_layers))
    assert all(q.shape[2] == len(QUERY) for _, q, *_ in captured)  # no padded rows


def test_arithmetic_is_counted_in_the_eager_forward(tiny64, static_forward) -> None:
    """A replayed forward runs no Python per layer, so a count would see only the linear
    layers' hooks of a capture, and none of a replay: counting forwards run eagerly."""
    chunks = encode_chunks(tiny64, random_chunks(LENGTHS, seed=3))

    def counted_answer() -> Arithmetic:
        with counted(tiny64.model) as work:
            prepared = prepare(tiny64, chunks, QUERY, Strategy.parse("legolink:1"))
        release_buffers(prepared.cache)
        return work

    replayed = counted_answer()
    with graphs.paused(tiny64.model, tiny64.device):
        assert counted_answer() == replayed
    assert replayed.attention > 0 and replayed.linear > 0


def test_placing_no_chunks_places_nothing(tiny64) -> None:
    keys = torch.zeros(tiny64.num_layers, tiny64.num_kv_heads, 4, tiny64.head_dim)
    place_together(keys, keys.clone(), [], tiny64.inv_freq, offset=2)
    assert not keys.any()


def test_slabs_stay_within_the_budget(tiny64) -> None:
    graphs.use_graphs(tiny64.model, tiny64.device, True, capture=False)
    shape = (tiny64.num_layers, 1, tiny64.num_kv_heads, tiny64.head_dim)
    one = graphs.SLAB_STEP * tiny64.kv_bytes_per_token  # a slab of SLAB_STEP slots, K and V
    try:
        g = graphs.graphs_of(tiny64.model, tiny64.device)
        g.budget_bytes = int(2.5 * one)
        a, b = g.lend(shape, tiny64.dtype, 10), g.lend(shape, tiny64.dtype, 10)
        assert a is not None and b is not None and a is not b
        assert g.lend(shape, tiny64.dtype, 10) is None  # a third would pass the budget
        cache = buffered_cache(tiny64, *new_buffers(tiny64, 10), 0)
        assert cache.layers[0].slab is None  # plain buffers then: the eager forward
        g.give_back(a)
        assert g.lend(shape, tiny64.dtype, graphs.SLAB_STEP) is None  # b is still lent
        g.give_back(b)
        bigger = g.lend(shape, tiny64.dtype, graphs.SLAB_STEP)  # free slabs are dropped
        assert bigger is not None and g.slabs == [bigger]
        assert bigger.capacity == 2 * graphs.SLAB_STEP
    finally:
        graphs.use_graphs(tiny64.model, tiny64.device, False)
