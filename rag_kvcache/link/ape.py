"""APE (adaptive parallel encoding) on linked chunks: the document tokens a strategy leaves
stale get their attention tempered (keys divided by the temperature) and scaled (log(scale)
added to their scores, a key bias kept with the cache so every decode step applies it too).
`+ape:1,1` is plain linking.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.adapter import Cache, set_key_bias
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import Strategy


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
