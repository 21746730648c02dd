"""cacheblend as the paper does it: the recomputed set shrinks over the first layers (gradual
filtering). Checked at its limits (`full`, `naive`), against a slow reference that computes
every token in every layer and masks, and on the sets it records; and the adapter's
layer-by-layer forward it runs on."""

import threading

import pytest
import torch
from helpers import random_chunks, tiny_config
from transformers import LlamaForCausalLM

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.masks import link_mask
from rag_kvcache.link.reference import blend_reference
from rag_kvcache.link.selection import filter_counts
from rag_kvcache.model.adapter import (
    LayerRows,
    buffered_cache,
    forward,
    forward_by_layer,
    new_buffers,
    unpack_cache,
    write_at,
)
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.loading import describe
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.strategy import Strategy

LENGTHS = [6, 15, 12, 17]  # the system prefix, then three document chunks: 44 document tokens
DOCUMENTS = sum(LENGTHS[1:])
QUERY = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def deep64():
    """7 layers, so the whole schedule runs: 2 full layers, the 3 widths, 2 at the target."""
    torch.manual_seed(1)
    model = LlamaForCausalLM._from_config(
        tiny_config(num_hidden_layers=7), attn_implementation="sdpa"
    )
    return describe(model.to(torch.float64).eval().requires_grad_(False), None, "tiny-deep")


def _setup(lm):
    ids = random_chunks(LENGTHS, seed=7)
    return encode_chunks(lm, ids[:1]) + encode_chunks(lm, ids[1:]), [t for c in ids for t in c]


def _tolerance(lm) -> float:
    return 1e-10 if lm.dtype == torch.float64 else 1e-4


def _assert_same_kv(a, b, tol: float) -> None:
    for (k1, v1), (k2, v2) in zip(unpack_cache(a), unpack_cache(b), strict=True):
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)


@pytest.mark.parametrize("model", ["tiny64", "tiny32", "deep64"])
def test_all_of_it_equals_full_and_a_plain_prefill(model, request) -> None:
    lm = request.getfixturevalue(model)
    chunks, tokens = _setup(lm)
    blend = link(lm, chunks, QUERY, Strategy.parse("cacheblend:1"))
    full = link(lm, chunks, QUERY, Strategy.parse("full"))
    cache, logits = prefill(lm, tokens + QUERY)
    tol = _tolerance(lm)
    for other, other_logits in ((full.cache, full.next_logits), (cache, logits)):
        torch.testing.assert_close(blend.next_logits, other_logits, rtol=tol, atol=tol)
        _assert_same_kv(blend.cache, other, tol)
    documents = list(range(LENGTHS[0], sum(LENGTHS)))
    assert [s.tolist() for s in blend.recomputed_by_layer] == [documents] * lm.num_layers
    assert blend.recomputed == DOCUMENTS  # the exact system prefix is kept


@pytest.mark.parametrize("model", ["tiny64", "tiny32", "deep64"])
def test_none_of_it_equals_naive(model, request) -> None:
    lm = request.getfixturevalue(model)
    chunks, _ = _setup(lm)
    blend = link(lm, chunks, QUERY, Strategy.parse("cacheblend:0"))
    naive = link(lm, chunks, QUERY, Strategy.parse("naive"))
    tol = _tolerance(lm)
    torch.testing.assert_close(blend.next_logits, naive.next_logits, rtol=tol, atol=tol)
    _assert_same_kv(blend.cache, naive.cache, tol)
    assert blend.recomputed == 0 and all(len(s) == 0 for s in blend.recomputed_by_layer)


@pytest.mark.parametrize("model", ["tiny64", "deep64"])
@pytest.mark.parametrize(
    "strategy",
    ["cacheblend:0.3", "cacheblend:0.15", "cacheblend:0.6+reversed", "cacheblend:0.2+top:1"],
)
def test_layer_by_layer_equals_the_masked_reference(model, strategy: str, request) -> None:
    """The fast path (rows dropped as the filter goes, stale copies stashed and compared)
    equals the reference (every token computed in every layer, fresh or cached K/V picked by
    the mask, ranked in plain Python): the same sets, logits and KV."""
    lm = request.getfixturevalue(model)
    chunks, _ = _setup(lm)
    fast = link(lm, chunks, QUERY, Strategy.parse(strategy))
    slow = blend_reference(lm, chunks, QUERY, Strategy.parse(strategy))
    assert [s.tolist() for s in fast.recomputed_by_layer] == [
        s.tolist() for s in slow.recomputed_by_layer
    ]
    assert fast.recomputed == slow.recomputed
    torch.testing.assert_close(fast.next_logits, slow.next_logits, rtol=1e-10, atol=1e-10)
    _assert_same_kv(fast.cache, slow.cache, 1e-10)
    naive = link(lm, chunks, QUERY, Strategy.parse("naive"))  # guards against a no-op
    full = link(lm, chunks, QUERY, Strategy.parse("full"))
    for other in (naive, full):
        assert (fast.next_logits - other.next_logits).abs().max() > 1e-3


@pytest.mark.parametrize("strategy", ["cacheblend:0.25", "cacheblend:0.25+top:1"])
def test_the_set_shrinks_layer_by_layer_to_the_target(deep64, strategy: str) -> None:
    chunks, _ = _setup(deep64)
    parsed = Strategy.parse(strategy)
    linked = link(deep64, chunks, QUERY, parsed)
    sets = [set(s.tolist()) for s in linked.recomputed_by_layer]
    assert len(sets) == deep64.num_layers
    whole = set(range(6, 21)) if parsed.top else set()  # chunk 1, ranked first
    target = round(0.25 * DOCUMENTS)  # 11
    pool = DOCUMENTS - len(whole)
    schedule = [pool, pool, 22, 16, 14, 11, 11]  # 2 full layers, 2x, 1.5x, 1.25x the target
    assert [len(s - whole) for s in sets] == schedule == filter_counts(pool, target, 7)
    for before, after in zip(sets, sets[1:]):
        assert after <= before  # each layer's set within the one before
    assert all(whole <= s and min(s) >= LENGTHS[0] for s in sets)  # never the exact prefix
    assert len(sets[-1] - whole) == target
    assert linked.recomputed == round(sum(map(len, sets)) / len(sets))


# ----------------------------------------------------------------------------- the adapter


@pytest.mark.parametrize("model", ["tiny64", "deep64"])
def test_dropping_rows_over_exact_kv_changes_nothing(model, request) -> None:
    """Rows dropped from layer 2 on, over a buffer already holding a plain prefill's exact
    K/V, leave the logits and every layer's K/V as the prefill made them: the kept rows are
    computed at their own positions (positions and position embeddings narrowed with them)."""
    lm = request.getfixturevalue(model)
    tokens = random_chunks([40], seed=3)[0]
    exact, logits = prefill(lm, tokens)
    keys, values = new_buffers(lm, len(tokens))
    for layer, (k, v) in enumerate(unpack_cache(exact)):
        keys[layer], values[layer] = k, v
    cache = buffered_cache(lm, keys, values, len(tokens))
    everything = torch.arange(len(tokens))
    write_at(cache, everything)
    kept = torch.tensor([0, 3, 4, 17, 33, 34, 39])  # the last row goes on

    def rows(layer: int) -> LayerRows | None:
        if layer != 2:
            return None
        write_at(cache, kept)
        return LayerRows(kept, additive_mask(link_mask(kept, len(tokens)), lm.dtype))

    computed = []  # rows reaching each layer's attention
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda _m, _a, kwargs: computed.append(kwargs["hidden_states"].shape[1]),
            with_kwargs=True,
        )
        for layer in lm.model.model.layers
    ]
    mask = additive_mask(link_mask(everything, len(tokens)), lm.dtype)
    try:
        out = forward_by_layer(
            lm,
            torch.tensor([tokens]),
            positions=everything[None],
            cache=cache,
            mask=mask,
            rows=rows,
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert computed == [40, 40] + [len(kept)] * (lm.num_layers - 2)
    torch.testing.assert_close(out, logits, rtol=1e-10, atol=1e-10)
    _assert_same_kv(cache, exact, 1e-10)


def test_another_threads_forward_meanwhile_is_untouched(tiny64) -> None:
    """The narrowing hooks sit on the shared model while a layer-by-layer forward runs; a
    forward in another thread at that moment (the demo app serves sessions in threads) must
    pass through them as if they were not there."""
    other = torch.tensor([random_chunks([12], seed=4)[0]])
    alone, _ = forward(tiny64, other)
    meanwhile = []

    def rows(layer: int) -> LayerRows | None:
        if layer != 1:
            return None
        thread = threading.Thread(target=lambda: meanwhile.append(forward(tiny64, other)[0]))
        thread.start()
        thread.join()
        kept = torch.tensor([2, 3])
        write_at(cache, kept)
        return LayerRows(kept, additive_mask(link_mask(kept, 4), tiny64.dtype))

    keys, values = new_buffers(tiny64, 4)
    cache = buffered_cache(tiny64, keys, values, 0)
    positions = torch.arange(4)
    write_at(cache, positions)
    mask = additive_mask(link_mask(positions, 4), tiny64.dtype)
    forward_by_layer(
        tiny64,
        torch.tensor([[5, 6, 7, 8]]),
        positions=positions[None],
        cache=cache,
        mask=mask,
        rows=rows,
    )
    assert len(meanwhile) == 1
    torch.testing.assert_close(meanwhile[0], alone, rtol=0, atol=0)
