"""Link strategies: which cached context tokens are recomputed when chunks are linked.

Chunk 0 is the system prefix, encoded at position 0 and so already exact; strategies pick
tokens from the document chunks after it. The query is always computed.

- `full`: every context token (the prefix too): must equal a plain prefill.
- `naive`: none: the rotated chunk KV is used as is.
- `legolink:k`: the first k tokens of every chunk but the first (Epic's LegoLink).
- `legolink0`: none, but chunks must have been encoded with sink tokens (Epic's LegoLink-0).
- `cacheblend:r`: a ratio r of document tokens, those whose layer-1 values deviate most from a
  fresh prefill (CacheBlend's HKVD selection; a baseline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rag_kvcache.errors import StrategyError

KINDS = ("full", "naive", "legolink", "legolink0", "cacheblend")


@dataclass(frozen=True)
class LinkStrategy:
    kind: str
    k: int = 0
    ratio: float = 0.0

    def __str__(self) -> str:
        if self.kind == "legolink":
            return f"legolink:{self.k}"
        if self.kind == "cacheblend":
            return f"cacheblend:{self.ratio:g}"
        return self.kind


def parse_strategy(name: str | LinkStrategy) -> LinkStrategy:
    """'full' | 'naive' | 'legolink:K' | 'legolink0' | 'cacheblend:R' -> LinkStrategy."""
    if isinstance(name, LinkStrategy):
        return name
    text = name.strip().lower()
    if text in ("full", "naive", "legolink0"):
        return LinkStrategy(text)
    if m := re.fullmatch(r"legolink:(\d+)", text):
        return LinkStrategy("legolink", k=int(m.group(1)))
    if m := re.fullmatch(r"cacheblend:([0-9.]+)", text):
        ratio = float(m.group(1))
        if 0 <= ratio <= 1:
            return LinkStrategy("cacheblend", ratio=ratio)
    raise StrategyError(
        f"unknown link strategy {name!r}; use full, naive, legolink:K (K >= 0), legolink0 "
        "or cacheblend:R (0 <= R <= 1)"
    )


def select_positions(
    strategy: LinkStrategy, lengths: list[int], deviation: torch.Tensor | None = None
) -> torch.Tensor:
    """Sorted global positions [R] (int64) of the context tokens to recompute.

    lengths: tokens per chunk, chunk 0 first. deviation [total] is needed by cacheblend only.
    """
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    if strategy.kind == "full":
        return torch.arange(total)
    if strategy.kind in ("naive", "legolink0"):
        return torch.empty(0, dtype=torch.long)
    if strategy.kind == "legolink":
        picks = [torch.arange(s, s + min(strategy.k, n)) for s, n in zip(starts[1:], lengths[1:])]
        return torch.cat(picks) if picks else torch.empty(0, dtype=torch.long)
    assert strategy.kind == "cacheblend" and deviation is not None
    docs = torch.arange(starts[1] if len(starts) > 1 else total, total)
    count = round(strategy.ratio * len(docs))
    top = deviation[docs].topk(count).indices if count else torch.empty(0, dtype=torch.long)
    return docs[top].sort().values
