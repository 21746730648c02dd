"""Which cached context tokens a strategy recomputes when chunks are linked.

Chunk 0 is the system prefix, encoded at position 0 and so already exact; strategies pick
tokens from the document chunks after it (`full` takes the prefix too), and a `+top:N` part adds
whole chunks (`Strategy.in_full`). Positions are made on the device of the tensors they will
index (the model's), CUDA included.

Every strategy but one recomputes one set of tokens in every layer (`select_positions`).
`cacheblend:r` chooses as CacheBlend does (Yao et al., EuroSys 2025: "gradual filtering" of
the tokens with the highest KV deviation), while the link's forward goes through the layers
(`GradualFilter`): the first two layers recompute every document token; after the second and
each of the next few layers, the candidates whose freshly computed values moved furthest from
their cached copies are kept for the next layer, the set shrinking (`filter_counts`) to
round(r x document tokens), which every later layer recomputes; the rest keep their cached KV.
Two layers, because a token's first-layer K/V depend on that token alone (cached ones are
exact once rotated): deviation shows from the second layer on, and getting there takes the
first layer's output for every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rag_kvcache.errors import StrategyError
from rag_kvcache.strategy import Strategy

FILTER_WIDTHS = (2.0, 1.5, 1.25)
"""cacheblend's candidates after its two full layers, in layers 2, 3, 4 (0-based), as a
multiple of the final count (capped at every document token); layer 5 on keeps the final count.

The paper gives no numbers, only that each layer's share is "slightly" above the next one's.
Twice the target, then shedding half of the surplus per layer, makes a token rank among the
most changed at four consecutive layers before it is kept, and costs 1.75 x target
token-layers beyond the final set's: at r = 0.15 about a quarter of one full layer, against the
two full layers (2/30 of SmolLM2's prefill) that measuring every token costs anyway. A model
with fewer layers uses the first widths that fit: its last layer always has the final count."""


def filter_counts(pool: int, target: int, layers: int) -> list[int]:
    """cacheblend's document tokens recomputed in each layer (never growing): `pool` in the
    first two, then down to `target` (see FILTER_WIDTHS). A model of two layers or fewer has
    no layer to measure deviation on before its last: it recomputes the whole pool if
    target > 0."""
    if target == 0:
        return [0] * layers
    if target >= pool or layers <= 2:
        return [pool] * layers
    widened = [min(pool, round(target * width)) for width in FILTER_WIDTHS][: layers - 3]
    return [pool, pool, *widened] + [target] * (layers - 2 - len(widened))


def select_positions(
    strategy: Strategy,
    lengths: list[int],
    device: torch.device | str = "cpu",
    in_full: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Sorted global positions [R] (int64, on `device`) of the context tokens to recompute in
    every layer (not for cacheblend, which chooses per layer: `GradualFilter`).

    lengths: tokens per chunk, chunk 0 first. in_full: per chunk after chunk 0, recomputed
    whole (default: `strategy.in_full`, which holds when `lengths` are all of a request's chunks).
    """
    if strategy.kind == "cacheblend":
        raise StrategyError("cacheblend chooses its tokens layer by layer: see GradualFilter")
    picked = _by_kind(strategy, lengths, device)
    whole = _whole_chunks(strategy, lengths, device, in_full)
    return torch.cat((picked, whole)).unique() if len(whole) else picked  # sorted


def _whole_chunks(
    strategy: Strategy,
    lengths: list[int],
    device: torch.device | str,
    in_full: Sequence[bool] | None,
) -> torch.Tensor:
    """Positions [W] (sorted) of the document chunks `+top:N` recomputes whole."""
    if in_full is None:
        in_full = strategy.in_full(len(lengths) - 1)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    whole = [
        torch.arange(s, s + n, device=device)
        for s, n, full in zip(starts[1:], lengths[1:], in_full, strict=True)
        if full
    ]
    return torch.cat(whole) if whole else torch.empty(0, dtype=torch.long, device=device)


def _by_kind(strategy: Strategy, lengths: list[int], device: torch.device | str) -> torch.Tensor:
    """The positions the strategy's kind picks (sorted), before `top`."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    none = torch.empty(0, dtype=torch.long, device=device)
    if strategy.kind == "full":
        return torch.arange(sum(lengths), device=device)
    if strategy.kind in ("naive", "legolink0"):
        return none
    assert strategy.kind == "legolink", strategy
    picks = [
        torch.arange(s, s + min(strategy.k, n), device=device)
        for s, n in zip(starts[1:], lengths[1:])
    ]
    return torch.cat(picks) if picks else none


class GradualFilter:
    """cacheblend's token selection, made while the link's forward runs layer by layer.

    `rows` are the context positions (sorted) recomputed in the layer about to run: at first
    every document token (none if r rounds to 0 tokens), with the `+top:N` chunks whole. Before
    each layer, `next_rows` drops the candidates the schedule (`filter_counts`) no longer has
    room for: those whose values at the layer just run deviate least (L2 over heads and dims)
    from their cached copies, the measure CacheBlend's code ranks by. `+top:N` chunks are never
    ranked: they are recomputed in every layer, like the question. `sets` records the rows of
    every layer run so far.
    """

    def __init__(
        self,
        strategy: Strategy,
        lengths: list[int],
        layers: int,
        device: torch.device | str = "cpu",
        in_full: Sequence[bool] | None = None,
    ):
        assert strategy.kind == "cacheblend", strategy
        documents = torch.arange(lengths[0], sum(lengths), device=device)
        whole = _whole_chunks(strategy, lengths, device, in_full)
        pool = documents[~torch.isin(documents, whole)]
        target = min(round(strategy.ratio * len(documents)), len(pool))
        self.counts = filter_counts(len(pool), target, layers)
        first = pool if self.counts[0] else pool[:0]
        self.rows = torch.cat((first, whole)).sort().values  # [m]
        self.ranked = torch.isin(self.rows, pool)  # [m]: rows the filter may drop
        self.sets: list[torch.Tensor] = []
        self._stale: torch.Tensor | None = None  # [kv_heads, ranked rows, head_dim]

    def next_rows(self, layer: int, values: torch.Tensor) -> torch.Tensor | None:
        """Before `layer` runs, its cached chunks placed in values [layers, kv_heads, >= L,
        head_dim] (layers before it hold what they wrote): the indices of the current rows
        that go on into it, or None for all. `rows` are then that layer's."""
        keep = None
        if layer > 0 and self.counts[layer] < self.counts[layer - 1]:
            keep = self._shrink(values[layer - 1], self.counts[layer])
        if layer + 1 < len(self.counts) and self.counts[layer + 1] < self.counts[layer]:
            self._stale = values[layer][:, self.rows[self.ranked]].clone()  # before it writes
        self.sets.append(self.rows)
        return keep

    def _shrink(self, fresh: torch.Tensor, count: int) -> torch.Tensor:
        """Keep the `count` ranked rows whose fresh values [kv_heads, >= L, head_dim] moved
        furthest from the stale copies kept before their layer wrote; the indices kept."""
        assert self._stale is not None
        moved = fresh[:, self.rows[self.ranked]] - self._stale  # [kv_heads, c, head_dim]
        precise = torch.promote_types(moved.dtype, torch.float32)
        deviation = torch.linalg.vector_norm(moved, dim=(0, 2), dtype=precise)  # [c]
        chosen = torch.zeros_like(deviation, dtype=torch.bool)
        chosen[deviation.topk(count).indices] = True
        keep = ~self.ranked  # unranked rows always go on
        keep[self.ranked] = chosen
        index = keep.nonzero().flatten()
        self.rows, self.ranked, self._stale = self.rows[index], self.ranked[index], None
        return index

    @property
    def recomputed(self) -> int:
        """Context tokens recomputed per layer, averaged over the layers run (rounded): what
        the recompute costs, a token recomputed in k of N layers counting k / N."""
        return round(sum(len(s) for s in self.sets) / max(len(self.sets), 1))
