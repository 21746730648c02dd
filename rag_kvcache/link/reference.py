"""Oracles for `link`: they compute the same thing as `link` the slow, obvious way, and are
what the tests compare it against.

`link_reference` recomputes the chosen tokens one at a time, in position order, each a
single-token forward over exactly the KV it may see (no custom mask, no buffer bookkeeping).
`blend_reference` is cacheblend's: every layer computes every token and each layer's mask
chooses between a token's fresh and cached K/V. Both place the chunks with `apply_rope`, the
reference rotation (`_placed_reference`), not with `placement`'s fused kernels.
"""

from __future__ import annotations

import torch

from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.checks import check_chunks
from rag_kvcache.link.linker import LinkedContext
from rag_kvcache.link.selection import filter_counts, select_positions
from rag_kvcache.model.adapter import (
    LayerRows,
    buffered_cache,
    build_cache,
    forward,
    forward_by_layer,
    new_buffers,
    unpack_cache,
    write_at,
)
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.model.rope import apply_rope
from rag_kvcache.strategy import Strategy


def link_reference(
    lm: LoadedModel, chunks: list[ChunkKV], query_ids: list[int], strategy: Strategy
) -> LinkedContext:
    """Oracle for `link`: the same tokens recomputed one at a time, in position order.

    Chunks are placed with `apply_rope` (the reference rotation) and each token is a
    single-token forward over exactly the KV it may see (all earlier positions, recomputed
    ones already fresh; with `+window:W`, a document token sees the system prefix and the
    positions from W before its chunk on), so no custom mask and no buffer bookkeeping is
    involved.
    cacheblend, whose set changes from layer to layer, has its own: `blend_reference`.
    """
    check_chunks(lm, chunks, strategy, len(query_ids))
    if strategy.kind == "cacheblend":
        return blend_reference(lm, chunks, query_ids, strategy)
    token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=lm.device)
    recompute = select_positions(strategy, [c.num_tokens for c in chunks], lm.device)
    L, q = len(token_ids), len(query_ids)
    placed_keys, placed_values = _placed_reference(lm, chunks)
    pad = torch.zeros(*placed_keys.shape[:2], q, lm.head_dim, dtype=lm.dtype, device=lm.device)
    keys = torch.cat((placed_keys, pad), dim=2)  # [layers, h, L + q, d]
    values = torch.cat((placed_values, pad), dim=2)
    order = [*recompute.tolist(), *range(L, L + q)]
    ids = [*token_ids[recompute].tolist(), *query_ids]
    starts = [sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks))]
    system = chunks[0].num_tokens
    logits = torch.empty(0)
    for position, token in zip(order, ids):
        seen = list(range(position))
        if strategy.window is not None and system <= position < L:
            own = max(s for s in starts if s <= position)
            seen = [p for p in seen if p < system or p >= own - strategy.window]
        past = [(k[None, :, seen].clone(), v[None, :, seen].clone()) for k, v in zip(keys, values)]
        logits, cache = forward(
            lm,
            torch.tensor([[token]], device=lm.device),
            positions=torch.tensor([[position]], device=lm.device),
            cache=build_cache(past, lm),
        )
        for layer, (k, v) in enumerate(unpack_cache(cache)):
            keys[layer, :, position] = k[0, :, -1]
            values[layer, :, position] = v[0, :, -1]
    cache = build_cache([(k[None], v[None]) for k, v in zip(keys, values)], lm)
    return LinkedContext(cache, logits[0, -1], L + q, L, len(recompute))


def blend_reference(
    lm: LoadedModel, chunks: list[ChunkKV], query_ids: list[int], strategy: Strategy
) -> LinkedContext:
    """Oracle for `link` with cacheblend: every layer computes every token, none is dropped.

    Each context token's K/V is held twice: fresh, as the layer running computes it, and
    cached, placed with `apply_rope` in a second copy after the question. Each layer's mask
    lets a row see, at every position up to its own, the fresh copy of the tokens recomputed
    in that layer and the cached copy of the others: what a blended cache is, by definition.
    Which tokens stay recomputed is decided in plain Python from the deviations read off the
    two copies (same schedule, `filter_counts`), not by `GradualFilter`.
    """
    check_chunks(lm, chunks, strategy, len(query_ids))
    lengths = [c.num_tokens for c in chunks]
    L, q = sum(lengths), len(query_ids)
    T = L + q
    keys, values = new_buffers(lm, T + L)  # [layers, 1, h, T + L, d]: fresh, then cached
    keys[:, 0, :, T:], values[:, 0, :, T:] = _placed_reference(lm, chunks)
    cache = buffered_cache(lm, keys, values, T + L)
    everything = torch.arange(T, device=lm.device)
    write_at(cache, everything)  # each layer writes every token's fresh K/V, cached ones kept
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    flags = strategy.in_full(len(chunks) - 1)
    whole = {p for s, n, f in zip(starts[1:], lengths[1:], flags) if f for p in range(s, s + n)}
    pool = [p for p in range(lengths[0], L) if p not in whole]
    target = min(round(strategy.ratio * (L - lengths[0])), len(pool))
    counts = filter_counts(len(pool), target, lm.num_layers)
    chosen = pool if counts[0] else []
    sets: list[torch.Tensor] = []
    causal = everything[None, :] <= everything[:, None]  # [T, T]

    def blended(layer: int) -> LayerRows:
        nonlocal chosen
        if len(chosen) > counts[layer]:  # ranked on the layer before
            v = values[layer - 1, 0]
            moved = {p: float((v[:, p] - v[:, T + p]).double().norm()) for p in chosen}
            chosen = sorted(sorted(chosen, key=moved.__getitem__, reverse=True)[: counts[layer]])
        recomputed = sorted({*chosen, *whole})
        sets.append(torch.tensor(recomputed, dtype=torch.long, device=lm.device))
        fresh = everything >= L
        fresh[recomputed] = True
        allowed = torch.cat((causal & fresh, (causal & ~fresh)[:, :L]), dim=1)  # [T, T + L]
        return LayerRows(None, additive_mask(allowed, lm.dtype))

    ids = torch.tensor([[t for c in chunks for t in c.token_ids] + query_ids], device=lm.device)
    first = blended(0).mask
    logits = forward_by_layer(
        lm,
        ids,
        positions=everything[None],
        cache=cache,
        mask=first,
        rows=lambda layer: blended(layer) if layer else None,
    )
    layers = []
    for layer, fresh in enumerate(sets):  # each layer: fresh where recomputed, else cached
        k, v = keys[layer, :, :, :T].clone(), values[layer, :, :, :T].clone()
        cached = torch.ones(L, dtype=torch.bool, device=lm.device)
        cached[fresh] = False
        k[:, :, :L][:, :, cached] = keys[layer, :, :, T:][:, :, cached]
        v[:, :, :L][:, :, cached] = values[layer, :, :, T:][:, :, cached]
        layers.append((k, v))
    average = round(sum(len(s) for s in sets) / len(sets))
    return LinkedContext(build_cache(layers, lm), logits, T, L, average, tuple(sets))


def _placed_reference(lm: LoadedModel, chunks: list[ChunkKV]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks back to back from position 0, keys moved with `apply_rope` (the reference
    rotation): keys and values [layers, kv_heads, L, head_dim]."""
    offsets = [sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks))]
    delta = torch.cat([torch.full((c.num_tokens,), o - c.start) for c, o in zip(chunks, offsets)])
    keys = apply_rope(torch.cat([c.keys for c in chunks], dim=2), delta, lm.inv_freq)
    return keys, torch.cat([c.values for c in chunks], dim=2)
