"""Link cached chunks into one context and compute the query over it.

`link` is the hot path: place the chunks back to back (chunk 0, the system prefix, at position
0), rotate each chunk's keys from where it was encoded to where it now sits, then run ONE
forward over the strategy's recomputed tokens plus the query with a custom mask, and write the
recomputed tokens' fresh K/V over their stale copies. All of it happens in one preallocated
buffer per request, which decoding then appends to in place. `link_reference` computes the
same thing one token at a time with plain causal attention: it is the oracle for the mask.

The recomputed tokens and the query write their fresh K/V at their own positions of the
buffer inside the forward (over the stale copies), so the mask is causal by position: a new
token at position p sees positions <= p, recomputed ones already fresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from rag_kvcache.errors import (
    ContextTooLongError,
    DtypeMismatchError,
    FingerprintMismatchError,
    StrategyError,
)
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.layer_feed import LayerFeed
from rag_kvcache.link.selection import choose_recomputed, select_positions
from rag_kvcache.model.adapter import (
    Cache,
    additive_mask,
    before_layer_update,
    buffered_cache,
    build_cache,
    forward,
    new_buffers,
    set_key_bias,
    unpack_cache,
    write_at,
)
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.model.rope import apply_rope, rotate_into
from rag_kvcache.strategy import Strategy
from rag_kvcache.timing import STAGE_FORWARD, STAGE_PLACE, STAGE_SELECT, record_function


@dataclass
class LinkedContext:
    """The linked cache (context then query) and the logits for the first answer token."""

    cache: Cache
    next_logits: torch.Tensor  # [vocab]
    length: int  # tokens in the cache: context + query
    context_tokens: int
    recomputed: int  # context tokens recomputed (the query not counted)


@dataclass(frozen=True)
class LinkedPrefix:
    """KV already linked for the first chunks (e.g. from the prefix tree): keys and values
    [layers, kv_heads, P, head_dim] at positions 0..P-1, boundary tokens already recomputed."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def link(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    query_ids: list[int],
    strategy: Strategy,
    reserve: int = 0,
    prefix: LinkedPrefix | None = None,
    layerwise: bool | None = None,
    in_full: Sequence[bool] | None = None,
) -> LinkedContext:
    """Link chunks (chunk 0 = system prefix) and prefill the query over them.

    `reserve` extra cache slots are allocated for the tokens to be generated. With `prefix`,
    the chunks follow an already linked prefix (which then counts as chunk 0) and only they
    are linked: the result equals linking the prefix's chunks and these in one call; a
    strategy with `+top:N` then needs `in_full`, the `Strategy.in_full` flags of these chunks
    (their ranks are the whole request's).
    `layerwise` places the chunks one layer at a time as the forward reaches it (`LayerFeed`;
    by default when their KV is on another device than the model, e.g. CPU-pinned for CUDA).
    """
    check_chunks(lm, chunks, strategy, len(query_ids), prefix)
    with record_function(STAGE_SELECT):
        recompute, token_ids = _recomputed(lm, chunks, strategy, prefix, in_full)
    P = prefix.num_tokens if prefix else 0
    L, r, q = len(token_ids), len(recompute), len(query_ids)
    # 1. place: chunks back to back in one buffer, keys rotated to their new offsets
    with record_function(STAGE_PLACE):
        keys, values = new_buffers(lm, L + q + reserve)  # [layers, 1, kv_heads, cap, head_dim]
        if prefix is not None:
            keys[:, 0, :, :P], values[:, 0, :, :P] = prefix.keys, prefix.values
        if layerwise is None:
            layerwise = any(c.keys.device != lm.device for c in chunks)
        feed = LayerFeed(keys[:, 0], values[:, 0], chunks, lm.inv_freq, P) if layerwise else None
        if feed is None:
            place_into(keys[:, 0], values[:, 0], chunks, lm.inv_freq, offset=P)
        stale = stale_context(chunks, recompute, P) if strategy.uses_ape else None
    # 2. one forward over the recomputed tokens and the query; each writes its fresh K/V at
    # its own position (over the stale copy) and attends causally by position
    with record_function(STAGE_FORWARD):
        query = torch.tensor(query_ids, dtype=torch.long, device=lm.device)
        new_positions = torch.cat((recompute, torch.arange(L, L + q, device=lm.device)))  # [r+q]
        new_ids = torch.cat((token_ids[recompute], query))  # [r+q]
        mask = additive_mask(link_mask(new_positions, L + q), lm.dtype)  # [1, 1, r+q, L+q]
        cache = buffered_cache(lm, keys, values, L)
        calls: list[Callable[[], None]] = [*feed.calls()] if feed else []
        if stale is not None:  # APE: stale keys tempered as placed, their scores scaled
            calls = temper(lm, cache, keys[:, 0], stale, strategy, L + q + reserve, calls)
        if calls:
            before_layer_update(cache, calls)
        write_at(cache, new_positions)
        logits, _ = forward(
            lm,
            new_ids[None],
            positions=new_positions[None],
            cache=cache,
            mask=mask,
            logits_to_keep=1,
        )
        write_at(cache, None)  # decoding appends after the query
    return LinkedContext(cache, logits[0, -1], L + q, L, r)


def _recomputed(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    prefix: LinkedPrefix | None,
    in_full: Sequence[bool] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [r] the strategy recomputes, every context token id [L]) on the device."""
    P = prefix.num_tokens if prefix else 0
    token_ids = torch.tensor(
        [*(prefix.token_ids if prefix else ()), *(t for c in chunks for t in c.token_ids)],
        dtype=torch.long,
        device=lm.device,
    )  # [L]
    if prefix is None:
        recompute = choose_recomputed(lm, chunks, token_ids, strategy)  # [r] positions
    else:
        if strategy.top and in_full is None:
            raise StrategyError(f"{strategy} after a linked prefix needs the chunks' in_full")
        lengths = [P, *(c.num_tokens for c in chunks)]
        recompute = select_positions(strategy, lengths, device=lm.device, in_full=in_full)
        recompute = recompute[recompute >= P]  # the prefix is linked already
    return recompute, token_ids


def stale_context(chunks: list[ChunkKV], recompute: torch.Tensor, start: int) -> torch.Tensor:
    """Positions [s] of the document tokens left stale: after the exact system prefix (chunk 0,
    or a linked prefix of `start` tokens), not recomputed."""
    first = start if start else chunks[0].num_tokens
    end = start + sum(c.num_tokens for c in chunks)
    stale = torch.ones(end, dtype=torch.bool, device=recompute.device)
    stale[:first] = False
    stale[recompute] = False
    return stale.nonzero().flatten()


def temper(
    lm: LoadedModel,
    cache: Cache,
    keys: torch.Tensor,
    stale: torch.Tensor,
    strategy: Strategy,
    capacity: int,
    layer_calls: list[Callable[[], None]],
) -> list[Callable[[], None]]:
    """APE on the stale context tokens: their keys [layers, kv_heads, cap, d] divided by the
    temperature (every later score on them is divided by it) and log(scale) added to their
    scores (a key bias kept with the cache, so decoding applies it too). Chunks placed layer
    by layer (`layer_calls`) are tempered as each layer arrives: the calls to run instead."""
    if strategy.scale != 1:
        bias = torch.zeros(capacity, dtype=lm.dtype, device=lm.device)
        bias[stale] = math.log(strategy.scale)
        set_key_bias(cache, bias)
    if strategy.temperature == 1:
        return layer_calls

    def tempered(layer: int) -> None:
        if layer_calls:
            layer_calls[layer]()
        keys[layer, :, stale] /= strategy.temperature

    if not layer_calls:  # placed already: temper every layer now
        for layer in range(len(keys)):
            tempered(layer)
        return []
    return [partial(tempered, layer) for layer in range(len(keys))]


def linked_layers(
    linked: LinkedContext, start: int, end: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values of positions start..end-1 as one copy per layer, [kv_heads, end -
    start, head_dim] each (what the prefix tree and the batch keep: KV that can move a layer
    at a time)."""
    layers = unpack_cache(linked.cache)
    return (
        [k[0, :, start:end].clone() for k, _ in layers],
        [v[0, :, start:end].clone() for _, v in layers],
    )


def link_mask(new_positions: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean [N, length]: a new token at position p sees every position <= p.

    Causal by position is enough because the new tokens' fresh K/V are written over their
    stale copies before attention: a recomputed position holds fresh K/V when it is read.
    """
    return torch.arange(length, device=new_positions.device)[None, :] <= new_positions[:, None]


def place_into(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunks: list[ChunkKV],
    inv_freq: torch.Tensor,
    offset: int = 0,
) -> None:
    """Write chunks back to back into keys/values [layers, kv_heads, >= L, head_dim] from
    position `offset` on, each chunk's keys rotated from where it was encoded to its place."""
    for c in chunks:
        span = slice(offset, offset + c.num_tokens)
        rotate_into(keys[:, :, span], c.keys.to(keys.device), offset - c.start, inv_freq)
        values[:, :, span] = c.values
        offset += c.num_tokens


def check_chunks(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    query_tokens: int,
    prefix: LinkedPrefix | None = None,
) -> None:
    """Clear errors for KV that cannot be linked into this model's context."""
    if not strategy.uses_cache or strategy.kind == "positions":
        raise StrategyError(f"{strategy} is not a link strategy")
    if not chunks and prefix is None:
        raise StrategyError("nothing to link: pass at least the system prefix chunk")
    if prefix is not None and strategy.kind == "cacheblend":
        raise StrategyError(
            "cacheblend picks tokens over the whole context, so it cannot extend a linked prefix"
        )
    if query_tokens < 1:
        raise StrategyError("the query must have at least one token")
    for c in chunks:
        if c.fingerprint != lm.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {c.cache_id} was encoded by model {c.fingerprint}, not by the loaded "
                f"model {lm.fingerprint} ({lm.name}, {lm.dtype}); re-encode it with this model"
            )
        if c.keys.dtype != lm.dtype or c.values.dtype != lm.dtype:
            raise DtypeMismatchError(
                f"chunk {c.cache_id} holds {c.keys.dtype} KV; the model computes in {lm.dtype}"
            )
        expected = (lm.num_layers, lm.num_kv_heads, c.num_tokens, lm.head_dim)
        if tuple(c.keys.shape) != expected or tuple(c.values.shape) != expected:
            raise FingerprintMismatchError(
                f"chunk {c.cache_id} KV shape {tuple(c.keys.shape)} != expected {expected}"
            )
    total = sum(c.num_tokens for c in chunks) + query_tokens + (prefix.num_tokens if prefix else 0)
    if total > lm.max_context:
        raise ContextTooLongError(
            f"{total} tokens (context + query) exceed the model's window of {lm.max_context}; "
            "retrieve fewer or smaller chunks"
        )
    documents = chunks if prefix is not None else chunks[1:]
    if strategy.kind == "legolink0" and any(c.start == 0 for c in documents):
        raise StrategyError(
            "legolink0 needs document chunks encoded with sink tokens "
            "(EncodeConfig(sink_tokens=N) with N > 0); these were encoded without"
        )


def link_reference(
    lm: LoadedModel, chunks: list[ChunkKV], query_ids: list[int], strategy: Strategy
) -> LinkedContext:
    """Oracle for `link`: the same tokens recomputed one at a time, in position order.

    Chunks are placed with `apply_rope` (the reference rotation) and each token is a
    single-token forward over exactly the KV it may see (all earlier positions, recomputed
    ones already fresh), so no custom mask and no buffer bookkeeping is involved.
    """
    check_chunks(lm, chunks, strategy, len(query_ids))
    token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=lm.device)
    recompute = choose_recomputed(lm, chunks, token_ids, strategy)
    L, q = len(token_ids), len(query_ids)
    offsets = [sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks))]
    delta = torch.cat([torch.full((c.num_tokens,), o - c.start) for c, o in zip(chunks, offsets)])
    placed_keys = apply_rope(torch.cat([c.keys for c in chunks], dim=2), delta, lm.inv_freq)
    pad = torch.zeros(*placed_keys.shape[:2], q, lm.head_dim, dtype=lm.dtype, device=lm.device)
    keys = torch.cat((placed_keys, pad), dim=2)  # [layers, h, L + q, d]
    values = torch.cat((torch.cat([c.values for c in chunks], dim=2), pad), dim=2)
    order = [*recompute.tolist(), *range(L, L + q)]
    ids = [*token_ids[recompute].tolist(), *query_ids]
    logits = torch.empty(0)
    for position, token in zip(order, ids):
        past = [
            (k[None, :, :position].clone(), v[None, :, :position].clone())
            for k, v in zip(keys, values)
        ]
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
