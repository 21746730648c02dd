"""The CPU attention fast path (GQA without copies, blocks over key extents) equals HF's sdpa."""

import pytest
import torch
from torch import nn

from rag_kvcache.model.adapter import (
    QUERY_BLOCK,
    gqa_sdpa_attention,
    query_blocks,
    reference_attention,
)


class Heads(nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("queries", [5, QUERY_BLOCK, 3 * QUERY_BLOCK + 7])
@pytest.mark.parametrize(
    "mask_kind", ["causal-by-position", "windowed", "boundaries", "none", "batched-padding"]
)
def test_fast_attention_equals_reference(dtype, queries: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(queries)
    batch = 2 if mask_kind == "batched-padding" else 1
    keys_len = 200 if mask_kind in ("causal-by-position", "windowed", "boundaries") else queries
    q = torch.randn(batch, 6, queries, 16, generator=g, dtype=dtype)
    k = torch.randn(batch, 2, keys_len, 16, generator=g, dtype=dtype)
    v = torch.randn(batch, 2, keys_len, 16, generator=g, dtype=dtype)
    allowed = None
    keys = torch.arange(keys_len)[None, :]
    if mask_kind == "causal-by-position":  # sorted positions, like the linker's new tokens
        positions = torch.randint(0, keys_len, (queries,), generator=g).sort().values
        allowed = keys <= positions[:, None]
    elif mask_kind == "windowed":  # a chunk's rows read 8 system keys and 40 before it
        positions = torch.arange(keys_len - queries, keys_len)
        reach = torch.where(positions < keys_len - 8, positions[0] - 40, 0)  # the last 8: all
        allowed = (keys <= positions[:, None]) & ((keys < 8) | (keys >= reach[:, None]))
    elif mask_kind == "boundaries":  # what the default strategy's link forward reads
        allowed = _boundaries_window_question(queries, keys_len)
    elif mask_kind == "batched-padding":
        allowed = torch.ones(batch, 1, queries, queries).tril().bool()
        allowed[1, :, :, queries // 2 :] = False
        allowed[1, :, :, 0] = True
    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        mask = mask if mask.dim() == 4 else mask[None, None]
    blocks = None if mask is None else query_blocks(mask)  # as `forward` passes them
    if mask_kind == "causal-by-position" and queries > QUERY_BLOCK:
        assert blocks is not None and len(blocks) == -(-queries // QUERY_BLOCK)
        assert blocks[0].keys is None and blocks[0].count < keys_len  # really skips keys
    if mask_kind == "windowed" and queries > QUERY_BLOCK:
        assert blocks is not None and blocks[0].keys is not None  # gathered
        assert blocks[0].count < keys_len // 2
        assert blocks[0].keys is blocks[1].keys  # the window's rows share one gather
    if mask_kind == "boundaries" and queries > QUERY_BLOCK:
        assert blocks is not None
        chunk = [b for b in blocks if isinstance(b.rows, slice)]  # the recomputed chunk's
        assert len(chunk) == -(-(queries - 14) // QUERY_BLOCK)
        assert all(b.keys is chunk[0].keys is not None for b in chunk)  # one shared gather
        (wide,) = [b for b in blocks if b.keys is None]  # boundaries and question: one call
        assert isinstance(wide.rows, torch.Tensor) and len(wide.rows) == 14
    fast, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, query_blocks=blocks)
    slow, _ = reference_attention(Heads(), q, k, v, mask, scaling=0.25)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)


def _boundaries_window_question(queries: int, keys_len: int) -> torch.Tensor:
    """Boolean [queries, keys_len] like `legolink:2+top:1+window:W` over chunks of 20 keys
    after 8 system keys: two boundary rows per stale chunk (3 chunks; each reads the system
    keys and the 12 before it: short runs of a window), the recomputed chunk's rows (each
    reading the system keys and the 8 before the chunk), 8 question rows reading everything;
    the first `queries` of them when fewer than 14."""
    keys = torch.arange(keys_len)[None, :]
    boundaries = torch.tensor([8, 9, 28, 29, 48, 49])
    chunk = torch.arange(68, 68 + max(queries - 14, 0))
    question = torch.arange(keys_len - 8, keys_len)
    positions = torch.cat((boundaries, chunk, question))[:queries]
    reach = torch.cat(((boundaries - 12).clamp(min=8), torch.full_like(chunk, 60), 0 * question))
    return (keys <= positions[:, None]) & ((keys < 8) | (keys >= reach[:queries, None]))
