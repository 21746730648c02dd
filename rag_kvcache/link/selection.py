"""Which cached context tokens a strategy recomputes when chunks are linked.

Chunk 0 is the system prefix, encoded at position 0 and so already exact; strategies pick
tokens from the document chunks after it (`full` takes the prefix too), and a `+top:N` part adds
whole chunks (`Strategy.in_full`). Positions are made on the device of the tensors they will
index (the model's), CUDA included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.adapter import layer_values
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import Strategy


def select_positions(
    strategy: Strategy,
    lengths: list[int],
    deviation: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    in_full: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Sorted global positions [R] (int64, on `device`) of the context tokens to recompute.

    lengths: tokens per chunk, chunk 0 first. deviation [total] is needed by cacheblend only
    (and then gives the device). in_full: per chunk after chunk 0, recomputed whole (default:
    `strategy.in_full`, which holds when `lengths` are all of a request's chunks).
    """
    if deviation is not None:
        device = deviation.device
    picked = _by_kind(strategy, lengths, deviation, device)
    if in_full is None:
        in_full = strategy.in_full(len(lengths) - 1)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    whole = [
        torch.arange(s, s + n, device=device)
        for s, n, full in zip(starts[1:], lengths[1:], in_full, strict=True)
        if full
    ]
    if not whole:
        return picked
    return torch.cat((picked, *whole)).unique()  # sorted


def _by_kind(
    strategy: Strategy,
    lengths: list[int],
    deviation: torch.Tensor | None,
    device: torch.device | str,
) -> torch.Tensor:
    """The positions the strategy's kind picks (sorted), before `top`."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    none = torch.empty(0, dtype=torch.long, device=device)
    if strategy.kind == "full":
        return torch.arange(total, device=device)
    if strategy.kind in ("naive", "legolink0"):
        return none
    if strategy.kind == "legolink":
        picks = [
            torch.arange(s, s + min(strategy.k, n), device=device)
            for s, n in zip(starts[1:], lengths[1:])
        ]
        return torch.cat(picks) if picks else none
    assert strategy.kind == "cacheblend" and deviation is not None, strategy
    docs = torch.arange(starts[1] if len(starts) > 1 else total, total, device=device)
    count = round(strategy.ratio * len(docs))
    top = deviation[docs].topk(count).indices if count else none
    return docs[top].sort().values


def choose_recomputed(
    lm: LoadedModel, chunks: list[ChunkKV], token_ids: torch.Tensor, strategy: Strategy
) -> torch.Tensor:
    """Positions [R] to recompute, on the model's device; cacheblend measures layer-1 value
    deviation from a fresh partial prefill first."""
    deviation = None
    if strategy.kind == "cacheblend":
        layer = min(1, lm.num_layers - 1)
        fresh = layer_values(lm, token_ids[None], layer)  # [h, L, d]
        cached = torch.cat([c.values[layer].to(lm.device) for c in chunks], dim=1)  # [h, L, d]
        deviation = (fresh.float() - cached.float()).norm(dim=(0, 2))  # [L]
    lengths = [c.num_tokens for c in chunks]
    return select_positions(strategy, lengths, deviation, lm.device)
