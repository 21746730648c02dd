"""Link cached chunks into one context and compute the query over it.

`link` is the hot path: place the chunks back to back (chunk 0, the system prefix, at position
0), rotate each chunk's keys from where it was encoded to where it now sits, then run ONE
forward over the strategy's recomputed tokens plus the query with a custom mask, and write the
recomputed tokens' fresh K/V over their stale copies. `link_reference` computes the same thing
one token at a time with plain causal attention: it is the oracle for the mask.

The mask, for a new token at position p (recomputed or query) over [cached L | new tokens]:
- a cached position j is visible iff j < p and j is not being recomputed (its stale copy);
- a new token at position p' is visible iff p' <= p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_kvcache.errors import (
    ContextTooLongError,
    DtypeMismatchError,
    FingerprintMismatchError,
    StrategyError,
)
from rag_kvcache.kv import ChunkKV
from rag_kvcache.model import (
    Cache,
    LoadedModel,
    additive_mask,
    build_cache,
    forward,
    layer_values,
    unpack_cache,
)
from rag_kvcache.rope import apply_rope
from rag_kvcache.strategy import LinkStrategy, parse_strategy, select_positions


@dataclass
class LinkedContext:
    """The linked cache (context then query) and the logits for the first answer token."""

    cache: Cache
    next_logits: torch.Tensor  # [vocab]
    length: int  # tokens in the cache: context + query
    context_tokens: int
    recomputed: int  # context tokens recomputed (the query not counted)


@dataclass
class PlacedChunks:
    """Chunks concatenated and rotated to their linked positions."""

    token_ids: torch.Tensor  # [L]
    keys: torch.Tensor  # [layers, kv_heads, L, head_dim]
    values: torch.Tensor  # [layers, kv_heads, L, head_dim]
    lengths: list[int]


def link(
    lm: LoadedModel, chunks: list[ChunkKV], query_ids: list[int], strategy: str | LinkStrategy
) -> LinkedContext:
    """Link chunks (chunk 0 = system prefix) and prefill the query over them."""
    strategy = parse_strategy(strategy)
    placed = place(lm, chunks, strategy, len(query_ids))
    recompute = choose_recomputed(lm, placed, strategy)
    L, q, r = len(placed.token_ids), len(query_ids), len(recompute)
    query = torch.tensor(query_ids, dtype=torch.long, device=lm.device)
    new_positions = torch.cat((recompute, torch.arange(L, L + q, device=lm.device)))  # [r + q]
    new_ids = torch.cat((placed.token_ids[recompute], query))  # [r + q]
    mask = additive_mask(link_mask(new_positions, recompute, L), lm.dtype)  # [1, 1, r+q, L+r+q]
    cache = build_cache(
        [(k[None], v[None]) for k, v in zip(placed.keys, placed.values)], lm
    )  # per layer [1, kv_heads, L, head_dim]
    logits, cache = forward(
        lm, new_ids[None], positions=new_positions[None], cache=cache, mask=mask, logits_to_keep=1
    )
    if r:
        cache = build_cache([_commit(k, v, recompute, L) for k, v in unpack_cache(cache)], lm)
    return LinkedContext(cache, logits[0, -1], L + q, L, r)


def _commit(
    k: torch.Tensor, v: torch.Tensor, recompute: torch.Tensor, L: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [1, h, L + r + q, d]: move the r fresh rows over their stale copies, drop them."""
    r = len(recompute)
    k[:, :, recompute] = k[:, :, L : L + r]
    v[:, :, recompute] = v[:, :, L : L + r]
    return torch.cat((k[:, :, :L], k[:, :, L + r :]), 2), torch.cat(
        (v[:, :, :L], v[:, :, L + r :]), 2
    )


def link_mask(new_positions: torch.Tensor, recompute: torch.Tensor, L: int) -> torch.Tensor:
    """Boolean [N, L + N]: what each new token (at new_positions [N]) may attend to."""
    stale = torch.zeros(L, dtype=torch.bool, device=new_positions.device)
    stale[recompute] = True
    cached = torch.arange(L, device=new_positions.device)
    see_cached = (cached[None, :] < new_positions[:, None]) & ~stale[None, :]  # [N, L]
    see_new = new_positions[None, :] <= new_positions[:, None]  # [N, N]
    return torch.cat((see_cached, see_new), dim=1)


def place(
    lm: LoadedModel, chunks: list[ChunkKV], strategy: LinkStrategy, query_tokens: int
) -> PlacedChunks:
    """Check the chunks, concatenate them and rotate each to its offset in the linked context."""
    check_chunks(lm, chunks, strategy, query_tokens)
    lengths = [c.num_tokens for c in chunks]
    offsets = [sum(lengths[:i]) for i in range(len(chunks))]
    delta = torch.cat(
        [torch.full((c.num_tokens,), off - c.start) for c, off in zip(chunks, offsets)]
    )  # [L]: how far each token moves
    keys = torch.cat([c.keys.to(lm.device) for c in chunks], dim=2)
    values = torch.cat([c.values.to(lm.device) for c in chunks], dim=2)
    token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=lm.device)
    return PlacedChunks(token_ids, apply_rope(keys, delta, lm.inv_freq), values, lengths)


def choose_recomputed(
    lm: LoadedModel, placed: PlacedChunks, strategy: LinkStrategy
) -> torch.Tensor:
    """Positions [R] to recompute; cacheblend measures layer-1 value deviation first."""
    deviation = None
    if strategy.kind == "cacheblend":
        layer = min(1, lm.num_layers - 1)
        fresh = layer_values(lm, placed.token_ids[None], layer)  # [h, L, d]
        deviation = (fresh.float() - placed.values[layer].float()).norm(dim=(0, 2))  # [L]
    return select_positions(strategy, placed.lengths, deviation).to(lm.device)


def check_chunks(
    lm: LoadedModel, chunks: list[ChunkKV], strategy: LinkStrategy, query_tokens: int
) -> None:
    """Clear errors for KV that cannot be linked into this model's context."""
    if not chunks:
        raise StrategyError("nothing to link: pass at least the system prefix chunk")
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
    total = sum(c.num_tokens for c in chunks) + query_tokens
    if total > lm.max_context:
        raise ContextTooLongError(
            f"{total} tokens (context + query) exceed the model's window of {lm.max_context}; "
            "retrieve fewer or smaller chunks"
        )
    if strategy.kind == "legolink0" and any(c.start == 0 for c in chunks[1:]):
        raise StrategyError(
            "legolink0 needs document chunks encoded with sink tokens "
            "(EncodeConfig(sink_tokens=N) with N > 0); these were encoded without"
        )


def link_reference(
    lm: LoadedModel, chunks: list[ChunkKV], query_ids: list[int], strategy: str | LinkStrategy
) -> LinkedContext:
    """Oracle for `link`: the same tokens recomputed one at a time, in position order.

    Each token is a single-token forward over exactly the KV it may see (all earlier positions,
    recomputed ones already fresh), so no custom mask is involved.
    """
    strategy = parse_strategy(strategy)
    placed = place(lm, chunks, strategy, len(query_ids))
    recompute = choose_recomputed(lm, placed, strategy)
    L, q = len(placed.token_ids), len(query_ids)
    pad = torch.zeros(
        *placed.keys.shape[:2], q, placed.keys.shape[3], dtype=lm.dtype, device=lm.device
    )
    keys = torch.cat((placed.keys, pad), dim=2)  # [layers, h, L + q, d]
    values = torch.cat((placed.values, pad.clone()), dim=2)
    order = [*recompute.tolist(), *range(L, L + q)]
    ids = [*placed.token_ids[recompute].tolist(), *query_ids]
    logits = torch.empty(0)
    for position, token in zip(order, ids):
        cache = build_cache(
            [
                (k[None, :, :position].clone(), v[None, :, :position].clone())
                for k, v in zip(keys, values)
            ],
            lm,
        )
        logits, cache = forward(
            lm,
            torch.tensor([[token]], device=lm.device),
            positions=torch.tensor([[position]], device=lm.device),
            cache=cache,
        )
        for layer, (k, v) in enumerate(unpack_cache(cache)):
            keys[layer, :, position] = k[0, :, -1]
            values[layer, :, position] = v[0, :, -1]
    cache = build_cache([(k[None], v[None]) for k, v in zip(keys, values)], lm)
    return LinkedContext(cache, logits[0, -1], L + q, L, len(recompute))
