"""Link cached chunks into one context and compute the query over it.

`link` is the hot path: check the chunks (`checks`), place them back to back (chunk 0, the
system prefix, at position 0), rotating each chunk's keys from where it was encoded to where
it now sits (`placement`), then run ONE forward over the strategy's recomputed tokens plus the
query with a custom mask, and write the recomputed tokens' fresh K/V over their stale copies.
All of it happens in one preallocated buffer per request, which decoding then appends to in
place. `reference.link_reference` computes the same thing one token at a time with plain
causal attention: it is the oracle for the mask.

`cacheblend:r` recomputes a set that shrinks over the first layers (`GradualFilter`), so its
forward goes layer by layer (`forward_by_layer`), each layer computing only the rows still
chosen; its oracle is `reference.blend_reference`, where every layer computes every token and
the mask chooses, per layer, between each token's fresh and cached K/V.

The recomputed tokens and the query write their fresh K/V at their own positions of the
buffer inside the forward (over the stale copies), so the mask is causal by position: a new
token at position p sees positions <= p, recomputed ones already fresh (`masks`). APE's
tempering of the tokens left stale is `ape`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rag_kvcache.errors import StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.ape import stale_context, temper
from rag_kvcache.link.calibration import Calibration, soft_inputs, with_link_slots
from rag_kvcache.link.checks import check_calibration, check_chunks
from rag_kvcache.link.layer_feed import LayerFeed
from rag_kvcache.link.masks import link_mask, window_reach
from rag_kvcache.link.placement import place_into
from rag_kvcache.link.selection import GradualFilter, select_positions
from rag_kvcache.model.adapter import (
    Cache,
    LayerRows,
    before_layer_update,
    buffered_cache,
    forward,
    forward_by_layer,
    new_buffers,
    released_on_error,
    unpack_cache,
    write_at,
)
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.loading import LoadedModel
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
