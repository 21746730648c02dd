"""Chunk placement: cached chunks written back to back into the link's buffer, each chunk's
keys re-rotated from where it was encoded to where it now sits.

`place_into` is the entry point: on the CPU chunk by chunk with no temporaries; on a GPU
`place_together`, the same in a handful of kernels whatever the number of chunks. (Placing
layer by layer as the forward reaches each layer is `layer_feed.LayerFeed`; the link's
reference rotation, `apply_rope`, is in `reference._placed_reference`.)
"""

from __future__ import annotations

import torch

from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.rope import rope_cos_sin, rotate_into


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
