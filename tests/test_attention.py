"""The CPU attention fast path (GQA without copies, blocks over key extents) equals HF's sdpa."""

import pytest
import torch
from torch import nn

from rag_kvcache.model.adapter import (
    QUERY_BLOCK,
    gqa_sdpa_attention,
    query_block_keys,
    reference_attention,
)


class Heads(nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("queries", [5, QUERY_BLOCK, 3 * QUERY_BLOCK + 7])
@pytest.mark.parametrize("mask_kind", ["causal-by-position", "windowed", "none", "batched-padding"])
def test_fast_attention_equals_reference(dtype, queries: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(queries)
    batch = 2 if mask_kind == "batched-padding" else 1
    keys_len = 200 if mask_kind in ("causal-by-position", "windowed") else queries
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
    elif mask_kind == "windowed":  # a chunk's rows read 8 system keys and 40 before it
        positions = torch.arange(keys_len - queries, keys_len)
        allowed = torch.arange(keys_len)[None, :] <= positions[:, None]
        reach = torch.where(positions < keys_len - 8, positions[0] - 40, 0)  # the last 8: all
        allowed &= (torch.arange(keys_len)[None, :] < 8) | (
            torch.arange(keys_len)[None, :] >= reach[:, None]
        )
        mask = torch.zeros(queries, keys_len, dtype=dtype).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )[None, None]
    elif mask_kind == "batched-padding":
        allowed = torch.ones(batch, 1, queries, queries).tril().bool()
        allowed[1, :, :, queries // 2 :] = False
        allowed[1, :, :, 0] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    seen = None if mask is None else query_block_keys(mask)  # as `forward` passes them
    if mask_kind == "causal-by-position" and queries > QUERY_BLOCK:
        assert seen is not None and len(seen) == -(-queries // QUERY_BLOCK)
        assert seen[0].index is None and seen[0].count < keys_len  # really skips keys
    if mask_kind == "windowed" and queries > QUERY_BLOCK:
        assert seen is not None and seen[0].index is not None  # gathered
        assert seen[0].count < keys_len // 2
        assert seen[0].index is seen[1].index  # the window's rows share one gather
    fast, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, query_block_keys=seen)
    slow, _ = reference_attention(Heads(), q, k, v, mask, scaling=0.25)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)


@pytest.mark.parametrize("queries, with_mask", [(1, False), (4, False), (4, True)])
def test_key_bias_adds_to_every_score_on_its_key(queries: int, with_mask: bool) -> None:
    """A cache's key bias (APE's log scale on stale context columns) reaches attention as an
    addition to the scores: softmax(q k^T * scale + mask + bias) v, written out by hand."""
    g = torch.Generator().manual_seed(7)
    keys_len = 9
    q = torch.randn(1, 6, queries, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, keys_len, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, keys_len, 16, generator=g, dtype=torch.float64)
    bias = torch.zeros(keys_len - 2, dtype=torch.float64)  # shorter: the keys past it unbiased
    bias[2:5] = torch.tensor([0.7, -1.3, 2.0])
    causal = torch.arange(keys_len)[None, :] <= torch.arange(keys_len - queries, keys_len)[:, None]
    mask = None
    if with_mask:
        mask = torch.zeros(queries, keys_len, dtype=torch.float64)
        mask = mask.masked_fill(~causal, torch.finfo(torch.float64).min)[None, None]
    out, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, key_bias=bias)
    scores = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25
    scores = scores + torch.cat((bias, torch.zeros(2, dtype=torch.float64)))
    scores = scores.masked_fill(~causal, float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-10, atol=1e-10)
