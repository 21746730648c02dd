"""The CPU attention fast path (GQA without copies, blocks over key extents) equals HF's sdpa."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rag_kvcache.link.masks import link_mask
from rag_kvcache.model import adapter, attention
from rag_kvcache.model.adapter import gqa_sdpa_attention, reference_attention
from rag_kvcache.model.attention import (
    BLOCK_ROWS,
    QUERY_BLOCK,
    additive_mask,
    cut_rows,
    query_blocks,
    with_key_bias,
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
    if mask_kind == "causal-by-position":  # sorted positions, like the linker's new tokens
        positions = torch.randint(0, keys_len, (queries,), generator=g).sort().values
        allowed = link_mask(positions, keys_len)
    elif mask_kind == "windowed":  # a chunk's rows read 8 system keys and 40 before it
        positions = torch.arange(keys_len - queries, keys_len)
        reach = torch.where(positions < keys_len - 8, positions[0] - 40, 0)  # the last 8: all
        allowed = link_mask(positions, keys_len, (reach, 8))
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
        assert blocks is not None and len(blocks) > 1
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


class OneKVHeadPerQueryHead(Heads):
    num_key_value_groups = 1


def test_a_multi_head_model_is_attended_in_blocks_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with as many KV heads as query heads takes the same CPU path (query blocks, each
    over the keys its rows see) as a grouped one, and gives transformers' sdpa's result."""
    g = torch.Generator().manual_seed(1)
    queries, keys_len = 3 * QUERY_BLOCK + 7, 200
    q = torch.randn(1, 4, queries, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 4, keys_len, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 4, keys_len, 16, generator=g, dtype=torch.float64)
    positions = torch.randint(0, keys_len, (queries,), generator=g).sort().values
    mask = additive_mask(link_mask(positions, keys_len), torch.float64)
    blocks = query_blocks(mask)
    assert blocks is not None and len(blocks) > 1
    calls = []
    monkeypatch.setattr(adapter, "_sdpa", lambda *a: calls.append(a) or attention._sdpa(*a))
    heads = OneKVHeadPerQueryHead()
    fast, _ = gqa_sdpa_attention(heads, q, k, v, mask, scaling=0.25, query_blocks=blocks)
    slow, _ = reference_attention(heads, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    assert len(calls) == len(blocks)


def test_rows_are_cut_where_the_calls_cost_least() -> None:
    """`cut_rows`: every row once, in order; rows reading the same keys share as few calls as
    the block sizes allow; causal rows, when a call costs nothing more, go in the smallest
    blocks (each reads only up to its last row)."""
    same = cut_rows([100] * 300, overhead=8)
    assert len(same) == 2 and same[0][0] == 0 and same[-1][1] == 300
    assert all(a % BLOCK_ROWS[0] == 0 for a, _ in same)  # where the kernel's own blocks start
    assert all(b - a in BLOCK_ROWS for a, b in same[:-1])
    assert cut_rows(list(range(1, 65)), overhead=0) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    causal = cut_rows(list(range(1, 301)), overhead=20)
    assert [a for a, _ in causal[1:]] == [b for _, b in causal[:-1]]  # contiguous, in order
    cost = lambda cut: sum((20 + b - a) * b for a, b in cut)  # noqa: E731
    fixed = [(a, min(a + 32, 300)) for a in range(0, 300, 32)]
    assert cost(causal) <= cost(fixed)
    assert cut_rows([5], overhead=8) == [(0, 1)] and cut_rows([], overhead=8) == []


def _boundaries_window_question(queries: int, keys_len: int) -> torch.Tensor:
    """Boolean [queries, keys_len] like `legolink:2+top:1+window:W` over chunks of 20 keys
    after 8 system keys: two boundary rows per stale chunk (3 chunks; each reads the system
    keys and the 12 before it: short runs of a window), the recomputed chunk's rows (each
    reading the system keys and the 8 before the chunk), 8 question rows reading everything;
    the first `queries` of them when fewer than 14."""
    boundaries = torch.tensor([8, 9, 28, 29, 48, 49])
    chunk = torch.arange(68, 68 + max(queries - 14, 0))
    question = torch.arange(keys_len - 8, keys_len)
    positions = torch.cat((boundaries, chunk, question))[:queries]
    reach = torch.cat(((boundaries - 12).clamp(min=8), torch.full_like(chunk, 60), 0 * question))
    return link_mask(positions, keys_len, (reach[:queries], 8))


@pytest.mark.parametrize(
    "queries, with_mask, folded",
    [(1, False, False), (4, False, False), (4, True, False), (4, True, True), (40, True, True)],
)
def test_key_bias_adds_to_every_score_on_its_key(
    queries: int, with_mask: bool, folded: bool
) -> None:
    """A cache's key bias (APE's log scale on stale context columns) reaches attention as an
    addition to the scores: softmax(q k^T * scale + mask + bias) v, written out by hand. Added
    once: a mask that `forward` already gave it (`mask_has_key_bias`) is used as it is, in
    planned blocks too."""
    g = torch.Generator().manual_seed(7)
    keys_len = max(9, queries + 5)
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
    extra = {}
    if folded:  # as `forward` passes a 4D mask: the bias in it, the blocks planned from it
        assert mask is not None
        mask = with_key_bias(mask, bias, queries, keys_len)
        extra = {"mask_has_key_bias": True, "query_blocks": query_blocks(mask)}
        assert (extra["query_blocks"] is not None) == (queries > QUERY_BLOCK)
    out, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, key_bias=bias, **extra)
    scores = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25
    scores = scores + torch.cat((bias, torch.zeros(2, dtype=torch.float64)))
    scores = scores.masked_fill(~causal, float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-10, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40)),  # (window kind, rows of that kind)
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_planned_blocks_equal_reference_on_any_run_of_windows(
    rows: list[tuple[int, int]], seed: int
) -> None:
    """Whatever mix of causal rows and windowed runs (long, short, one row) a link forward
    makes, attention in planned blocks equals transformers' sdpa over the whole mask."""
    g = torch.Generator().manual_seed(seed)
    system, keys_len = 4, 240
    reaches = [0, 30, 90, 150]  # kind 0: causal; others: a window from there
    kinds = [kind for kind, count in rows for _ in range(count)]
    queries = len(kinds)
    positions = torch.randint(system, keys_len, (queries,), generator=g).sort().values
    reach = torch.tensor([reaches[k] for k in kinds])
    mask = additive_mask(link_mask(positions, keys_len, (reach, system)), torch.float64)
    q = torch.randn(1, 6, queries, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, keys_len, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, keys_len, 16, generator=g, dtype=torch.float64)
    blocks = query_blocks(mask)
    assert (blocks is None) == (queries <= QUERY_BLOCK)
    if blocks is not None:  # every row in exactly one block
        planned = torch.cat(
            [torch.arange(queries)[b.rows] if isinstance(b.rows, slice) else b.rows for b in blocks]
        )
        assert sorted(planned.tolist()) == list(range(queries))
    fast, _ = gqa_sdpa_attention(Heads(), q, k, v, mask, scaling=0.25, query_blocks=blocks)
    slow, _ = reference_attention(Heads(), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
