"""Link cached chunks into one context and compute the query over it.

`link` is the hot path: place the chunks back to back (chunk 0, the system prefix, at position
0), rotate each chunk's keys from where it was encoded to where it now sits, then run ONE
forward over the strategy's recomputed tokens plus the query with a custom mask, and write the
recomputed tokens' fresh K/V over their stale copies. All of it happens in one preallocated
buffer per request, which decoding then appends to in place. `link_reference` computes the
same thing one token at a time with plain causal attention: it is the oracle for the mask.

`cacheblend:r` recomputes a set that shrinks over the first layers (`GradualFilter`), so its
forward goes layer by layer (`forward_by_layer`), each layer computing only the rows still
chosen; its oracle is `blend_reference`, where every layer computes every token and the mask
chooses, per layer, between each token's fresh and cached K/V.

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
    CalibrationError,
    ContextTooLongError,
    DtypeMismatchError,
    FingerprintMismatchError,
    StrategyError,
)
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.calibration import Calibration, soft_inputs, with_link_slots
from rag_kvcache.link.layer_feed import LayerFeed
from rag_kvcache.link.selection import GradualFilter, filter_counts, select_positions
from rag_kvcache.model.adapter import (
    Cache,
    LayerRows,
    additive_mask,
    before_layer_update,
    buffered_cache,
    build_cache,
    forward,
    forward_by_layer,
    new_buffers,
    released_on_error,
    set_key_bias,
    unpack_cache,
    write_at,
)
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.model.rope import apply_rope, rope_cos_sin, rotate_into
from rag_kvcache.strategy import Strategy
from rag_kvcache.timing import STAGE_FORWARD, STAGE_PLACE, STAGE_SELECT, stage


@dataclass
class LinkedContext:
    """The linked cache (context then query) and the logits for the first answer token."""

    cache: Cache
    next_logits: torch.Tensor  # [vocab]
    length: int  # tokens in the cache: context + query
    context_tokens: int
    # context tokens recomputed (the query not counted); for cacheblend, whose set shrinks
    # layer by layer, the average over layers (rounded), a token recomputed in k of N layers
    # counting k / N: what the recompute costs, comparable with the other strategies
    recomputed: int
    # cacheblend only: the context positions recomputed in each layer (sorted)
    recomputed_by_layer: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class LinkedPrefix:
    """KV already linked for the first chunks (e.g. from the prefix tree): keys and values
    [layers, kv_heads, P, head_dim] at positions 0..P-1, boundary tokens already recomputed."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    system_tokens: int | None = None  # the system prefix's, at its start (`+window:W` needs it)
    # the score bias on its keys [P] (APE's scale on the tokens it left stale; their keys are
    # tempered already); None: none
    key_bias: torch.Tensor | None = None

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
    calibration: Calibration | None = None,
) -> LinkedContext:
    """Link chunks (chunk 0 = system prefix) and prefill the query over them.

    `reserve` extra cache slots are allocated for the tokens to be generated. With `prefix`,
    the chunks follow an already linked prefix (which then counts as chunk 0) and only they
    are linked: the result equals linking the prefix's chunks and these in one call; a
    strategy with `+top:N` then needs `in_full`, the `Strategy.in_full` flags of these chunks
    (their ranks are the whole request's).
    `layerwise` places the chunks one layer at a time as the forward reaches it (`LayerFeed`;
    by default on the CPU for chunks still arriving from disk, `ChunkKV.arrival`). On a GPU
    chunks in host memory are copied whole and placed at once by default: feeding them layer
    by layer is 32 x 32 small copies and rotations for an 8K context (126 ms against 48 ms
    copied first, Llama-3-8B shapes on an H100), and it keeps the forward from being replayed.
    A `+calibrated` strategy needs the model's `calibration`: its link tokens are laid after
    every document chunk and computed with the query (`link.calibration`).
    """
    check_chunks(lm, chunks, strategy, len(query_ids), prefix)
    check_calibration(lm, chunks, strategy, calibration, prefix, len(query_ids))
    with stage(STAGE_SELECT):
        blend = None
        if strategy.kind == "cacheblend":  # no prefix (check_chunks): chunk 0 is the system's
            lengths = [c.num_tokens for c in chunks]
            blend = GradualFilter(strategy, lengths, lm.num_layers, lm.device, in_full)
        recompute, token_ids = _recomputed(lm, chunks, strategy, prefix, in_full, blend)
        slots = None
        if calibration is not None:  # link slots after every document chunk, all computed
            slots = with_link_slots(lm, chunks, calibration.link_tokens)
            recompute = slots.computed(recompute, [c.num_tokens for c in chunks])
            chunks = slots.chunks
            token_ids = torch.tensor(
                [t for c in chunks for t in c.token_ids], dtype=torch.long, device=lm.device
            )
    P = prefix.num_tokens if prefix else 0
    L, r, q = len(token_ids), len(recompute), len(query_ids)
    keys, values = new_buffers(lm, L + q + reserve)  # [layers, 1, kv_heads, cap, head_dim]
    cache = buffered_cache(lm, keys, values, L)  # views of the buffers, placed below
    with released_on_error(cache):  # lent buffers go back if linking fails
        # 1. place: chunks back to back in one buffer, keys rotated to their new offsets
        with stage(STAGE_PLACE):
            if prefix is not None:
                keys[:, 0, :, :P], values[:, 0, :, :P] = prefix.keys, prefix.values
            if layerwise is None:  # on the CPU, chunks still arriving from disk (see `link`)
                layerwise = lm.device.type == "cpu" and any(c.arrival for c in chunks)
            feed = (
                LayerFeed(keys[:, 0], values[:, 0], chunks, lm.inv_freq, P) if layerwise else None
            )
            if feed is None:
                place_into(keys[:, 0], values[:, 0], chunks, lm.inv_freq, offset=P)
            stale = stale_context(chunks, recompute, P) if strategy.uses_ape else None
        # 2. one forward over the recomputed tokens and the query; each writes its fresh K/V at
        # its own position (over the stale copy) and attends causally by position
        with stage(STAGE_FORWARD):
            query = torch.tensor(query_ids, dtype=torch.long, device=lm.device)
            new_positions = torch.cat(
                (recompute, torch.arange(L, L + q, device=lm.device))
            )  # [r+q]
            new_ids = torch.cat((token_ids[recompute], query))  # [r+q]
            reach = None
            if strategy.window is not None:
                reach = window_reach(new_positions, chunks, prefix, L, strategy.window)
            mask = additive_mask(link_mask(new_positions, L + q, reach), lm.dtype)  # [1,1,r+q,L+q]
            calls: list[Callable[[], None]] = [*feed.calls()] if feed else []
            if stale is not None:  # APE: stale keys tempered as placed, their scores scaled
                bias = prefix.key_bias if prefix else None
                calls = temper(lm, cache, keys[:, 0], stale, strategy, L + q + reserve, calls, bias)
            write_at(cache, new_positions)
            if blend is not None:
                next_logits = _filtered_forward(
                    lm, blend, cache, values[:, 0], new_ids, new_positions, mask, calls, q
                )
            else:
                if calls:
                    before_layer_update(cache, calls)
                embeds = None
                if slots is not None and calibration is not None:
                    embeds = soft_inputs(lm, new_ids, new_positions, slots, calibration.vectors)
                logits, _ = forward(
                    lm,
                    new_ids[None],
                    positions=new_positions[None],
                    cache=cache,
                    mask=mask,
                    logits_to_keep=1,
                    embeds=embeds,
                )
                next_logits = logits[0, -1]
            write_at(cache, None)  # decoding appends after the query
        if blend is not None:
            return LinkedContext(cache, next_logits, L + q, L, blend.recomputed, tuple(blend.sets))
        return LinkedContext(cache, next_logits, L + q, L, r)


def _filtered_forward(
    lm: LoadedModel,
    blend: GradualFilter,
    cache: Cache,
    values: torch.Tensor,
    new_ids: torch.Tensor,
    new_positions: torch.Tensor,
    mask: torch.Tensor,
    place: list[Callable[[], None]],
    q: int,
) -> torch.Tensor:
    """cacheblend's forward, layer by layer: before each layer its cached chunks are placed
    (`place`, when they arrive layer by layer) and `blend` drops the rows it no longer
    recomputes, which then keep their cached KV from that layer on. new_ids, new_positions
    [r+q]: the first layer's rows, the question last; values: the buffer [layers, kv_heads,
    cap, head_dim]. The first answer token's logits [vocab]."""
    length = mask.shape[-1]
    question = new_positions[-q:]

    def rows(layer: int) -> LayerRows | None:
        if place:
            place[layer]()
        before = len(blend.rows)
        keep = blend.next_rows(layer, values)
        if keep is None:
            return None
        positions = torch.cat((blend.rows, question))
        write_at(cache, positions)
        keep = torch.cat((keep, torch.arange(before, before + q, device=keep.device)))
        return LayerRows(keep, additive_mask(link_mask(positions, length), mask.dtype))

    return forward_by_layer(
        lm, new_ids[None], positions=new_positions[None], cache=cache, mask=mask, rows=rows
    )


def _recomputed(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    prefix: LinkedPrefix | None,
    in_full: Sequence[bool] | None,
    blend: GradualFilter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [r] the strategy recomputes (cacheblend: in the first layer), every context
    token id [L]) on the device."""
    P = prefix.num_tokens if prefix else 0
    token_ids = torch.tensor(
        [*(prefix.token_ids if prefix else ()), *(t for c in chunks for t in c.token_ids)],
        dtype=torch.long,
        device=lm.device,
    )  # [L]
    if blend is not None:
        recompute = blend.rows
    elif prefix is None:
        lengths = [c.num_tokens for c in chunks]
        # chosen on the CPU and moved once: on a GPU each of its small steps is a launch
        recompute = select_positions(strategy, lengths, "cpu", in_full).to(lm.device)  # [r]
    else:
        if strategy.top and in_full is None:
            raise StrategyError(f"{strategy} after a linked prefix needs the chunks' in_full")
        lengths = [P, *(c.num_tokens for c in chunks)]
        recompute = select_positions(strategy, lengths, "cpu", in_full)
        recompute = recompute[recompute >= P].to(lm.device)  # the prefix is linked already
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
    prefix_bias: torch.Tensor | None = None,
) -> list[Callable[[], None]]:
    """APE on the stale context tokens: their keys [layers, kv_heads, cap, d] divided by the
    temperature (every later score on them is divided by it) and log(scale) added to their
    scores (a key bias kept with the cache, so decoding applies it too; a linked prefix's
    own, `prefix_bias`, kept before them). Chunks placed layer by layer (`layer_calls`) are
    tempered as each layer arrives: the calls to run instead."""
    if strategy.scale != 1:
        bias = torch.zeros(capacity, dtype=lm.dtype, device=lm.device)
        if prefix_bias is not None:
            bias[: len(prefix_bias)] = prefix_bias
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


def link_mask(
    new_positions: torch.Tensor, length: int, reach: tuple[torch.Tensor, int] | None = None
) -> torch.Tensor:
    """Boolean [N, length]: a new token at position p sees every position <= p; with `reach`
    (`window_reach`: per row the first document position it may see, and the system
    prefix's length), only the system prefix and the positions from its reach to p.

    Causal by position is enough because the new tokens' fresh K/V are written over their
    stale copies before attention: a recomputed position holds fresh K/V when it is read.
    """
    keys = torch.arange(length, device=new_positions.device)[None, :]
    allowed = keys <= new_positions[:, None]
    if reach is not None:
        first, system = reach
        allowed &= (keys < system) | (keys >= first[:, None])
    return allowed


def window_reach(
    new_positions: torch.Tensor,
    chunks: list[ChunkKV],
    prefix: LinkedPrefix | None,
    context: int,
    window: int,
) -> tuple[torch.Tensor, int]:
    """For `+window:W`: per new token [N], the first position it may see past the system
    prefix: W before its own chunk's start for a recomputed document token, 0 (everything)
    for the system prefix's tokens and the question. With the system prefix's length."""
    if prefix is None:
        system, start = chunks[0].num_tokens, 0
    elif prefix.system_tokens is None:
        raise StrategyError("+window after a linked prefix needs the prefix's system_tokens")
    else:
        system, start = prefix.system_tokens, prefix.num_tokens
    lengths = [c.num_tokens for c in chunks]
    starts = torch.tensor(
        [start + sum(lengths[:i]) for i in range(len(lengths) + 1)], device=new_positions.device
    )  # [chunks + 1]: where each placed chunk begins, then the context's end
    own = starts[torch.searchsorted(starts, new_positions, right=True).clamp(min=1) - 1]
    document = (new_positions >= system) & (new_positions < context)
    return torch.where(document, (own - window).clamp(min=system), 0), system


def place_into(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunks: list[ChunkKV],
    inv_freq: torch.Tensor,
    offset: int = 0,
) -> None:
    """Write chunks back to back into keys/values [layers, kv_heads, >= L, head_dim] from
    position `offset` on, each chunk's keys rotated from where it was encoded to its place.

    On the CPU chunk by chunk, with no temporaries (memory traffic is what costs there); on a
    GPU all at once (`place_together`), since there each small step is a kernel launch and a
    16K-token context of 64 chunks took ~30 ms of launches for ~1 ms of copying."""
    if keys.device.type != "cpu":
        place_together(keys, values, chunks, inv_freq, offset)
        return
    for c in chunks:
        c.whole()  # still arriving from disk: placed whole, so read whole first
        span = slice(offset, offset + c.num_tokens)
        rotate_into(keys[:, :, span], c.keys.to(keys.device), offset - c.start, inv_freq)
        values[:, :, span] = c.values
        offset += c.num_tokens


def place_together(
    keys: torch.Tensor,
    values: torch.Tensor,
    chunks: list[ChunkKV],
    inv_freq: torch.Tensor,
    offset: int = 0,
) -> None:
    """`place_into` in a handful of kernels whatever the number of chunks: the chunks' keys
    concatenated, then rotated into place by each token's own delta (one angle table)."""
    if not chunks:  # e.g. every chunk already linked in a prefix
        return
    for c in chunks:
        c.whole()
    lengths = [c.num_tokens for c in chunks]
    starts = [offset + sum(lengths[:i]) for i in range(len(chunks))]
    deltas = torch.tensor([s - c.start for s, c in zip(starts, chunks, strict=True)])
    delta = deltas.repeat_interleave(torch.tensor(lengths, dtype=torch.long))
    delta = delta.to(inv_freq.device)  # [L]
    span = slice(offset, offset + sum(lengths))
    half = inv_freq.shape[-1]
    cos, sin = rope_cos_sin(delta, inv_freq, keys.dtype)  # [L, 2 * half]
    angles = (cos[:, :half].to(keys.device), sin[:, :half].to(keys.device))
    # from pinned host memory the copies queue without waiting for one another
    stacked = torch.cat([c.keys.to(keys.device, non_blocking=True) for c in chunks], dim=-2)
    rotate_into(keys[:, :, span], stacked, 0, inv_freq, angles=angles)
    moved = [c.values.to(values.device, non_blocking=True) for c in chunks]
    values[:, :, span] = torch.cat(moved, dim=-2)


def widens(stored: torch.dtype, model: torch.dtype) -> bool:
    """Whether KV stored in `stored` is linked into a `model`-dtype context exactly: its own
    dtype, or bfloat16 into float32 (a bfloat16 blob of float32 KV, read as stored and widened
    as it is placed)."""
    return stored == model or (stored == torch.bfloat16 and model == torch.float32)


def check_calibration(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    calibration: Calibration | None,
    prefix: LinkedPrefix | None,
    query_tokens: int,
) -> None:
    """A calibration goes with `+calibrated` strategies, on the model and chunks it fits."""
    if strategy.calibrated and calibration is None:
        raise CalibrationError(
            f"{strategy} needs the model's link calibration: run `rag-kvcache calibrate`"
        )
    if calibration is not None:
        if not strategy.calibrated:
            raise StrategyError(f"a calibration was given to {strategy}, which is not +calibrated")
        if prefix is not None:
            raise StrategyError(
                "a calibrated link cannot extend a linked prefix yet: the prefix tree does not "
                "keep link tokens"
            )
        calibration.check_compatible(lm, chunks)
        total = sum(c.num_tokens for c in chunks) + query_tokens
        total += calibration.link_tokens * (len(chunks) - 1)
        if total > lm.max_context:
            raise ContextTooLongError(
                f"{total} tokens (context, link tokens and query) exceed the model's window of "
                f"{lm.max_context}; retrieve fewer or smaller chunks"
            )


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
        if not (widens(c.keys.dtype, lm.dtype) and widens(c.values.dtype, lm.dtype)):
            raise DtypeMismatchError(
                f"chunk {c.cache_id} holds {c.keys.dtype} KV; the model computes in {lm.dtype}"
            )
        expected = (lm.num_layers, lm.num_kv_heads, c.num_tokens, lm.head_dim)
        if tuple(c.keys.shape) != expected or tuple(c.values.shape) != expected:
            raise FingerprintMismatchError(
                f"chunk {c.cache_id} KV shape {tuple(c.keys.shape)} != expected {expected}"
            )
    total = sum(c.num_tokens for c in chunks) + query_tokens + (prefix.num_tokens if prefix else 0)
    system = (prefix.system_tokens or 0) if prefix is not None else chunks[0].num_tokens
    if system + query_tokens > lm.max_context:  # no retrieval makes room for it
        raise ContextTooLongError(
            f"the question is {query_tokens} tokens, more than the model's window of "
            f"{lm.max_context} holds after the system prompt: ask a shorter question"
        )
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
