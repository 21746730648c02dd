"""Linking equivalences: full == plain prefill, batched mask == one-token-at-a-time reference."""

import math
from dataclasses import replace

import pytest
import torch
from helpers import random_chunks

from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import (
    ContextTooLongError,
    DtypeMismatchError,
    FingerprintMismatchError,
    StrategyError,
)
from rag_kvcache.kv import EncodeSettings
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.masks import link_mask
from rag_kvcache.link.placement import place_into, place_together
from rag_kvcache.link.reference import link_reference
from rag_kvcache.model.adapter import build_cache, forward, unpack_cache
from rag_kvcache.model.rope import apply_rope
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.strategy import Strategy

LENGTHS = [6, 11, 4, 9]  # prefix, then three document chunks
QUERY = [7, 8, 9, 10, 11]


def _setup(lm, lengths=LENGTHS, settings=EncodeSettings()):
    ids = random_chunks(lengths, seed=5)
    prefix = encode_chunks(lm, ids[:1])
    docs = encode_chunks(lm, ids[1:], settings)
    return prefix + docs, [t for c in ids for t in c]


def _context_kv(linked, layer=0):
    k, v = unpack_cache(linked.cache)[layer]
    return k[0], v[0]


@pytest.mark.parametrize("model", ["tiny64", "tiny32"])
def test_full_equals_plain_prefill(model, request) -> None:
    lm = request.getfixturevalue(model)
    chunks, tokens = _setup(lm)
    linked = link(lm, chunks, QUERY, Strategy.parse("full"))
    cache, logits = prefill(lm, tokens + QUERY)
    tol = 1e-10 if lm.dtype == torch.float64 else 1e-4
    torch.testing.assert_close(linked.next_logits, logits, rtol=tol, atol=tol)
    for (k1, v1), (k2, v2) in zip(unpack_cache(linked.cache), unpack_cache(cache)):
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)
    assert linked.recomputed == sum(LENGTHS) and linked.length == sum(LENGTHS) + len(QUERY)
    config = GenerationConfig(max_new_tokens=12)
    position = len(tokens) + len(QUERY)
    assert list(decode(lm, linked.cache, linked.next_logits, position, config)) == list(
        decode(lm, cache, logits, position, config)
    )


@pytest.mark.parametrize("k", [11, 50])
def test_legolink_with_k_past_chunk_length_equals_full(tiny64, k: int) -> None:
    chunks, _ = _setup(tiny64)
    lego = link(tiny64, chunks, QUERY, Strategy.parse(f"legolink:{k}"))
    full = link(tiny64, chunks, QUERY, Strategy.parse("full"))
    torch.testing.assert_close(lego.next_logits, full.next_logits, rtol=1e-10, atol=1e-10)
    assert lego.recomputed == sum(LENGTHS[1:])  # the exact prefix is kept


@pytest.mark.parametrize("strategy", ["naive+top:3", "legolink:1+reversed+top:7"])
def test_top_past_the_chunk_count_equals_full(tiny64, strategy: str) -> None:
    chunks, _ = _setup(tiny64)
    top = link(tiny64, chunks, QUERY, Strategy.parse(strategy))
    full = link(tiny64, chunks, QUERY, Strategy.parse("full"))
    torch.testing.assert_close(top.next_logits, full.next_logits, rtol=1e-10, atol=1e-10)
    assert top.recomputed == sum(LENGTHS[1:])


def test_top_recomputes_the_best_ranked_chunk_whole(tiny64) -> None:
    chunks, _ = _setup(tiny64)
    for spelling, whole in (("naive+top:1", 1), ("naive+rotated+top:1", 3)):
        linked = link(tiny64, chunks, QUERY, Strategy.parse(spelling))
        assert linked.recomputed == LENGTHS[whole]  # the chunk ranked first, where placed
    plain = link(tiny64, chunks, QUERY, Strategy.parse("legolink:1"))
    topped = link(tiny64, chunks, QUERY, Strategy.parse("legolink:1+top:1"))
    assert not torch.allclose(plain.next_logits, topped.next_logits)


def test_naive_is_plain_concatenation_of_rotated_chunks(tiny64) -> None:
    chunks, _ = _setup(tiny64)
    linked = link(tiny64, chunks, QUERY, Strategy.parse("naive"))
    offsets = torch.tensor([0, 6, 17, 21])
    for layer in range(tiny64.num_layers):
        k, v = _context_kv(linked, layer)
        expected_k = torch.cat(
            [
                apply_rope(c.keys[layer], torch.full((c.num_tokens,), int(o)), tiny64.inv_freq)
                for c, o in zip(chunks, offsets)
            ],
            dim=1,
        )
        assert torch.equal(v[:, :30], torch.cat([c.values[layer] for c in chunks], dim=1))
        torch.testing.assert_close(k[:, :30], expected_k, rtol=0, atol=1e-12)
    assert linked.recomputed == 0


@pytest.mark.parametrize(
    "strategy",
    ["full", "naive", "legolink:1", "legolink:3", "cacheblend:0.3", "legolink0",
     "legolink:1+top:1", "naive+reversed+top:2", "naive+reversed+top:2+window:3",
     "legolink:2+window:0", "legolink:1+top:1+window:5"],
)  # fmt: skip
def test_one_forward_with_custom_mask_equals_token_by_token_reference(tiny64, strategy) -> None:
    settings = EncodeSettings((1, 2)) if strategy == "legolink0" else EncodeSettings()
    chunks, _ = _setup(tiny64, settings=settings)
    fast = link(tiny64, chunks, QUERY, Strategy.parse(strategy))
    slow = link_reference(tiny64, chunks, QUERY, Strategy.parse(strategy))
    assert fast.recomputed == slow.recomputed
    torch.testing.assert_close(fast.next_logits, slow.next_logits, rtol=1e-10, atol=1e-10)
    for (k1, v1), (k2, v2) in zip(unpack_cache(fast.cache), unpack_cache(slow.cache)):
        torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", ["naive+reversed+top:1", "legolink:3", "legolink:2+top:2"])
def test_a_window_wider_than_the_context_is_the_strategy_alone(tiny64, strategy: str) -> None:
    chunks, _ = _setup(tiny64)
    alone = link(tiny64, chunks, QUERY, Strategy.parse(strategy))
    for width in (sum(LENGTHS), 2**31 - 1):  # the widest a strategy takes, too
        wide = link(tiny64, chunks, QUERY, Strategy.parse(f"{strategy}+window:{width}"))
        torch.testing.assert_close(wide.next_logits, alone.next_logits, rtol=1e-10, atol=1e-10)
        for (k1, v1), (k2, v2) in zip(unpack_cache(wide.cache), unpack_cache(alone.cache)):
            torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)
    narrow = link(tiny64, chunks, QUERY, Strategy.parse(f"{strategy}+window:2"))
    assert (narrow.next_logits - alone.next_logits).abs().max() > 1e-3  # it does narrow


def test_window_zero_reencodes_each_chunk_after_the_system_prefix(tiny64) -> None:
    """Every chunk recomputed, each reading only the system prefix and itself: its K/V are a
    plain prefill of system prefix + that chunk, at the chunk's place in the context."""
    chunks, tokens = _setup(tiny64)
    linked = link(tiny64, chunks, QUERY, Strategy.parse("naive+top:3+window:0"))
    system = LENGTHS[0]
    for i in range(1, len(LENGTHS)):
        start = sum(LENGTHS[:i])
        positions = [*range(system), *range(start, start + LENGTHS[i])]
        ids = torch.tensor([[tokens[p] for p in positions]])
        _, cache = forward(tiny64, ids, positions=torch.tensor([positions]))
        for (k1, v1), (k2, v2) in zip(unpack_cache(linked.cache), unpack_cache(cache)):
            span = slice(start, start + LENGTHS[i])
            torch.testing.assert_close(k1[0, :, span], k2[0, :, system:], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(v1[0, :, span], v2[0, :, system:], rtol=1e-10, atol=1e-10)


def test_recompute_changes_the_context(tiny64) -> None:
    """Guards the tests above against a no-op: recomputed tokens really differ from naive."""
    chunks, _ = _setup(tiny64)
    naive, lego = (
        link(tiny64, chunks, QUERY, Strategy.parse("naive")),
        link(tiny64, chunks, QUERY, Strategy.parse("legolink:2")),
    )
    assert (naive.next_logits - lego.next_logits).abs().max() > 1e-3


def test_link_mask_small_case() -> None:
    # context of 4 tokens, position 2 recomputed, query at 4 and 5: causal by position
    mask = link_mask(torch.tensor([2, 4, 5]), 6)
    assert mask.int().tolist() == [
        [1, 1, 1, 0, 0, 0],  # recomputed token 2 sees 0, 1 and its own fresh K/V
        [1, 1, 1, 1, 1, 0],  # query 4 sees the context (2 fresh by then) and itself
        [1, 1, 1, 1, 1, 1],
    ]


def test_link_mask_with_a_window_small_case() -> None:
    # system prefix of 2; chunks at 2 (4 tokens) and 6 (4 tokens); positions 6..9 recomputed
    # with a window of 1; the query at 10 sees everything
    positions = torch.tensor([6, 7, 10])
    mask = link_mask(positions, 11, (torch.tensor([5, 5, 0]), 2))
    assert mask.int().tolist() == [
        [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # the system prefix, 1 token before its chunk, itself
        [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]


def test_bad_chunks_give_clear_errors(tiny64, tiny32) -> None:
    chunks, _ = _setup(tiny64)
    with pytest.raises(FingerprintMismatchError, match="ingest its text again with this model"):
        link(tiny32, chunks, QUERY, Strategy.parse("naive"))
    other, _ = _setup(tiny32)
    forged = [type(c)(c.cache_id, tiny64.fingerprint, c.token_ids, c.keys, c.values) for c in other]
    with pytest.raises(DtypeMismatchError, match="torch.float32"):
        link(tiny64, forged, QUERY, Strategy.parse("naive"))
    with pytest.raises(ContextTooLongError, match="window of 512"):
        link(tiny64, chunks * 20, QUERY, Strategy.parse("naive"))
    with pytest.raises(StrategyError, match="sink tokens"):
        link(tiny64, chunks, QUERY, Strategy.parse("legolink0"))
    with pytest.raises(StrategyError, match="at least one token"):
        link(tiny64, chunks, [], Strategy.parse("naive"))


@pytest.mark.parametrize(
    "strategy", ["naive", "legolink:2", "full", "cacheblend:0.3", "legolink:2+ape:0.5,2"]
)
def test_placing_layer_by_layer_equals_placing_first(tiny32, strategy: str) -> None:
    """LayerFeed (each layer's chunk KV placed when the forward reaches that layer, as for
    CPU-pinned chunks feeding a GPU) gives bit for bit what placing everything first gives."""
    chunks, _ = _setup(tiny32)
    eager = link(tiny32, chunks, QUERY, Strategy.parse(strategy), reserve=3, layerwise=False)
    fed = link(tiny32, chunks, QUERY, Strategy.parse(strategy), reserve=3, layerwise=True)
    assert torch.equal(fed.next_logits, eager.next_logits)
    for (k1, v1), (k2, v2) in zip(unpack_cache(fed.cache), unpack_cache(eager.cache)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    config = GenerationConfig(max_new_tokens=6)
    assert list(decode(tiny32, fed.cache, fed.next_logits, fed.length, config)) == list(
        decode(tiny32, eager.cache, eager.next_logits, eager.length, config)
    )


def test_layer_by_layer_after_a_linked_prefix(tiny32) -> None:
    from helpers import linked_span

    from rag_kvcache.link.linker import LinkedPrefix

    chunks, tokens = _setup(tiny32)
    head = link(tiny32, chunks[:2], QUERY, Strategy.parse("legolink:2"))
    keys, values = linked_span(head, 0, head.context_tokens)
    prefix = LinkedPrefix(keys, values, tuple(tokens[: head.context_tokens]))
    eager = link(
        tiny32, chunks[2:], QUERY, Strategy.parse("legolink:2"), prefix=prefix, layerwise=False
    )
    fed = link(
        tiny32, chunks[2:], QUERY, Strategy.parse("legolink:2"), prefix=prefix, layerwise=True
    )
    assert torch.equal(fed.next_logits, eager.next_logits)


# ----------------------------------------------------------------------------- APE


def test_ape_temperature_equals_linking_keys_divided_by_it(tiny64) -> None:
    """Temperature T on the stale context equals the token-by-token reference over chunks
    whose document keys were divided by T (scores on them divided by T; rotation is linear,
    and recomputed tokens get fresh keys either way)."""
    chunks, _ = _setup(tiny64)
    tempered = [chunks[0]] + [replace(c, keys=c.keys / 0.5) for c in chunks[1:]]
    for spelling in ("naive", "legolink:1"):
        fast = link(tiny64, chunks, QUERY, Strategy.parse(f"{spelling}+ape:0.5,1"))
        slow = link_reference(tiny64, tempered, QUERY, Strategy.parse(spelling))
        torch.testing.assert_close(fast.next_logits, slow.next_logits, rtol=1e-10, atol=1e-10)


def test_ape_scale_biases_exactly_the_stale_document_tokens(tiny64) -> None:
    from rag_kvcache.link.ape import stale_context

    chunks, _ = _setup(tiny64)
    recompute = torch.tensor([6, 7, 17, 18, 21, 22])  # legolink:2's: 2 per document chunk
    expected = [p for p in range(6, 30) if p not in (6, 7, 17, 18, 21, 22)]
    assert stale_context(chunks, recompute, 0).tolist() == expected
    linked = link(tiny64, chunks, QUERY, Strategy.parse("legolink:2+ape:1,2"), reserve=4)
    bias = linked.cache.layers[0].key_bias
    assert bias is not None and len(bias) == 30 + len(QUERY) + 4
    assert bias.nonzero().flatten().tolist() == expected
    torch.testing.assert_close(bias[expected], torch.full((len(expected),), math.log(2.0)).double())


def test_ape_scale_reaches_every_decoding_step(tiny64) -> None:
    """A decode step over an APE-linked cache equals the same step given the bias as an
    explicit mask over an unbiased copy of that cache."""
    chunks, _ = _setup(tiny64)
    linked = link(tiny64, chunks, QUERY, Strategy.parse("naive+ape:0.8,3"), reserve=2)
    bias = linked.cache.layers[0].key_bias
    assert bias is not None
    plain = build_cache([(k.clone(), v.clone()) for k, v in unpack_cache(linked.cache)], tiny64)
    token, position = torch.tensor([[5]]), torch.tensor([[linked.length]])
    mask = bias[: linked.length + 1][None, None, None].clone()
    via_mask, _ = forward(tiny64, token, positions=position, cache=plain, mask=mask)
    via_cache, _ = forward(tiny64, token, positions=position, cache=linked.cache)
    torch.testing.assert_close(via_cache, via_mask, rtol=1e-10, atol=1e-10)
    unbiased = link(tiny64, chunks, QUERY, Strategy.parse("naive+ape:0.8,1"), reserve=2)
    again, _ = forward(tiny64, token, positions=position, cache=unbiased.cache)
    assert not torch.allclose(again, via_cache)  # the scale changes the step


def test_ape_one_one_is_plain_linking(tiny64) -> None:
    chunks, _ = _setup(tiny64)
    assert Strategy("legolink", k=1, temperature=1.0, scale=1.0) == Strategy.parse("legolink:1")
    plain = link(tiny64, chunks, QUERY, Strategy.parse("legolink:1+ape:1,1"))
    assert plain.cache.layers[0].key_bias is None
    changed = link(tiny64, chunks, QUERY, Strategy.parse("legolink:1+ape:0.7,0.8"))
    assert not torch.allclose(plain.next_logits, changed.next_logits)


def test_placing_all_chunks_together_equals_placing_each(tiny64) -> None:
    """The GPU's placement (one concatenation, one rotation by per-token deltas) writes what
    the CPU's chunk-by-chunk placement does, bit for bit."""
    chunks, _ = _setup(tiny64)
    chunks = [replace(c, start=c.start + 5 * i) for i, c in enumerate(chunks)]  # encoded anywhere
    L = sum(c.num_tokens for c in chunks)
    shape = (tiny64.num_layers, tiny64.num_kv_heads, L + 7, tiny64.head_dim)
    each, together = (
        [torch.zeros(shape, dtype=tiny64.dtype) for _ in range(2)],
        [torch.zeros(shape, dtype=tiny64.dtype) for _ in range(2)],
    )
    place_into(*each, chunks, tiny64.inv_freq, offset=3)  # on the CPU: chunk by chunk
    place_together(*together, chunks, tiny64.inv_freq, offset=3)
    assert torch.equal(each[0], together[0]) and torch.equal(each[1], together[1])
    assert each[0][:, :, 3 : 3 + L].abs().sum() > 0  # something was placed
