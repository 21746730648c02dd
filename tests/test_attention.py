"""The CPU attention fast path (GQA without copies, blocks over key extents) equals HF's sdpa."""

import pytest
import torch
from torch import nn

from rag_kvcache.model.adapter import (
    QUERY_BLOCK,
    gqa_sdpa_attention,
    query_block_ends,
    reference_attention,
)


class Heads(nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("queries", [5, QUERY_BLOCK, 3 * QUERY_BLOCK + 7])
@pytest.mark.parametrize("mask_kind", ["causal-by-position", "none", "batched-padding"])
def test_fast_attention_equals_reference(dtype, queries: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(queries)
    batch = 2 if mask_kind == "batched-padding" else 1
    keys_len = 200 if mask_kind == "causal-by-position" else queries
    q = torch.randn(batch, 6, queries, 16, generator=g, dtype=dtype)
    k = torch.randn(batch, 2, keys_len, 16, generator=g, dtype=dtype)
    v = torch.randn(batch, 2, keys_len, 16, generator=g, dtype=dtype)
    mask = None
    if mask_kind == "causal-by-position":  # sorted positions, like the linker's new tokens
        positions = torch.randint(0, keys_len, (queries,), generator=g).sort().values
        allowed = torch.arange(keys_len)[None, :] <= positions[:, None]
        mask = torch.zeros(queries, keys_len, dtype=dtype).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )[None, None]
    elif mask_kind == "batched-padding":
        allowed = torch.ones(batch, 1, queries, queries).tril().bool()
        allowed[1, :, :, queries // 2 :] = False
        allowed[1, :, :, 0] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    ends = None if mask is None else query_block_ends(mask)  # as `forward` passes them
    if mask_kind == "causal-by-position" and queries > QUERY_BLOCK:
        assert ends is not None and len(ends) == -(-queries // QUERY_BLOCK)
        assert ends[0] < keys_len  # the first block really skips keys
    fast, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, query_block_ends=ends)
    slow, _ = reference_attention(Heads(), q, k, v, mask, scaling=0.25)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)
