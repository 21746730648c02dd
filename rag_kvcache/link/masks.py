"""The link forward's masks: which positions each new token (a recomputed context token or
the question's) may see. Causal by position, since the new tokens' fresh K/V are written over
their stale copies before attention; with `+window:W`, a recomputed document token sees only
the system prefix and the W positions before its own chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rag_kvcache.errors import StrategyError
from rag_kvcache.kv import ChunkKV

if TYPE_CHECKING:  # linker imports this module: the prefix's type only, for annotations
    from rag_kvcache.link.linker import LinkedPrefix


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
