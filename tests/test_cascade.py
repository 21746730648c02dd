"""Two-phase attention: merging partial attention by log-sum-exp equals attention over all keys."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rag_kvcache.serving.cascade import (
    PrivateKV,
    SharedKV,
    attention_with_lse,
    cascade_attention,
    fused_attention_with_lse,
    fused_padded_attention_with_lse,
    merge_state,
    merge_states,
    padded_attention_with_lse,
    reference_attention,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("split", [0, 1, 7, 19, 20])  # 0 and 20: one part has no keys
def test_merging_two_parts_equals_attention_over_both(dtype, split) -> None:
    g = torch.Generator().manual_seed(split)
    q = torch.randn(5, 8, 16, generator=g, dtype=dtype)
    k = torch.randn(20, 2, 16, generator=g, dtype=dtype)  # GQA: 2 KV heads for 8 query heads
    v = torch.randn(20, 2, 16, generator=g, dtype=dtype)
    scale = 16**-0.5
    v_a, s_a = attention_with_lse(q, k[:split], v[:split], scale)
    v_b, s_b = attention_with_lse(q, k[split:], v[split:], scale)
    merged, lse = merge_state(v_a, s_a, v_b, s_b)
    expected = reference_attention(q, k, v, scale)
    torch.testing.assert_close(merged, expected, atol=TOL[dtype], rtol=TOL[dtype])
    whole_v, whole_s = attention_with_lse(q, k, v, scale)
    torch.testing.assert_close(lse, whole_s, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(whole_v, expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_merging_two_empty_parts_gives_zero_and_minus_infinity() -> None:
    q = torch.randn(3, 4, 8)
    empty = torch.empty(0, 4, 8)
    v_a, s_a = attention_with_lse(q, empty, empty, 1.0)
    v, s = merge_state(v_a, s_a, v_a, s_a)
    assert torch.equal(v, torch.zeros(3, 4, 8)) and torch.isneginf(s).all()


def test_merge_is_associative_over_many_parts() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(30, 4, 8, generator=g, dtype=torch.float64)
    v = torch.randn(30, 4, 8, generator=g, dtype=torch.float64)
    cuts = [0, 3, 3, 11, 29, 30]
    parts = [attention_with_lse(q, k[a:b], v[a:b], 0.3) for a, b in zip(cuts, cuts[1:])]
    merged, _ = merge_states([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(merged, reference_attention(q, k, v, 0.3), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_cascade_attention_over_random_trees_equals_attention_per_request(seed) -> None:
    """Random prefix trees: every request's path (shared nodes, then its own suffix) attended
    in two phases equals plain attention over that path's concatenated KV."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 6, 3, 8

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64),
            torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64),
        )

    nodes = [kv(rng.randint(1, 12))]  # node 0: the root (system prompt)
    parent = [-1]
    for _ in range(rng.randint(1, 8)):
        parent.append(rng.randrange(len(nodes)))
        nodes.append(kv(rng.randint(0, 12)))
    requests = rng.randint(1, 9)
    paths = []
    for _ in range(requests):
        node, path = rng.randrange(len(nodes)), []
        while node != -1:
            path.insert(0, node)
            node = parent[node]
        paths.append(path)
    suffixes = [kv(rng.randint(1, 5)) for _ in range(requests)]
    q = torch.randn(requests, heads, dim, generator=g, dtype=torch.float64)

    # APE's scale on some nodes: log S on a random run of their tokens (their stale ones)
    biases: list[torch.Tensor | None] = []
    for k, _ in nodes:
        bias = None
        if rng.random() < 0.5:
            bias = torch.zeros(len(k), dtype=torch.float64)
            bias[rng.randint(0, len(k)) :] = -0.7
        biases.append(bias)

    parts = []
    for node, (k, v) in enumerate(nodes):  # shared phase: each node once, for all its rows
        rows = [r for r, path in enumerate(paths) if node in path]
        if rows:
            parts.append(SharedKV(k, v, rows, biases[node]))
    for r, (k, v) in enumerate(suffixes):  # private phase
        parts.append(SharedKV(k, v, [r]))
    out = cascade_attention(q, parts, dim**-0.5)

    for r, path in enumerate(paths):
        keys = torch.cat([nodes[n][0] for n in path] + [suffixes[r][0]])
        values = torch.cat([nodes[n][1] for n in path] + [suffixes[r][1]])
        bias = torch.cat(
            [torch.zeros(len(nodes[n][0])) if biases[n] is None else biases[n] for n in path]
            + [torch.zeros(len(suffixes[r][0]))]
        )
        expected = reference_attention(q[r : r + 1], keys, values, dim**-0.5, bias)
        torch.testing.assert_close(out[r : r + 1], expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_private_attention_equals_attention_per_row(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 6, 8, generator=g, dtype=dtype)
    k = torch.randn(4, 9, 2, 8, generator=g, dtype=dtype)
    v = torch.randn(4, 9, 2, 8, generator=g, dtype=dtype)
    lengths = torch.tensor([9, 1, 5, 0])
    k[1, 1:] = float("nan")  # past a row's length: never read into the result
    v[2, 5:] = 0.0
    out, lse = padded_attention_with_lse(q, k, v, lengths, 0.25)
    for row, n in enumerate(lengths.tolist()):
        want_v, want_s = attention_with_lse(q[row : row + 1], k[row, :n], v[row, :n], 0.25)
        torch.testing.assert_close(out[row : row + 1], want_v, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[row : row + 1], want_s, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows, tokens", [(1, 1), (3, 17), (8, 300)])
def test_the_fused_kernel_equals_the_reference(dtype, tol, rows, tokens) -> None:
    g = torch.Generator().manual_seed(rows * tokens)
    q = torch.randn(rows, 9, 64, generator=g).to(dtype)
    k = torch.randn(tokens, 3, 64, generator=g).to(dtype)
    v = torch.randn(tokens, 3, 64, generator=g).to(dtype)
    bias = torch.where(torch.arange(tokens) % 3 == 0, 0.0, -0.69)  # APE's log S, stale keys
    for b in (None, bias):
        out, lse = fused_attention_with_lse(q, k, v, 0.125, b)
        want_out, want_lse = attention_with_lse(q.double(), k.double(), v.double(), 0.125, b)
        torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_a_bias_on_keys_equals_scaling_their_attention_weights() -> None:
    """log S added to some keys' scores (APE's scale) multiplies their softmax weight by S
    before normalising: the reference against weights computed by hand."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    stale = torch.arange(10) >= 4
    bias = stale.double() * math.log(0.5)
    out, _ = attention_with_lse(q, k, v, 0.3, bias)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    weights = torch.exp(torch.einsum("nhd,thd->nht", q, kk) * 0.3)
    weights = weights * torch.where(stale, 0.5, 1.0).double()
    want = torch.einsum("nht,thd->nhd", weights / weights.sum(-1, keepdim=True), vv)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_padded_kernel_equals_the_reference(dtype, tol) -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(5, 9, 64, generator=g).to(dtype)
    k = torch.randn(5, 40, 3, 64, generator=g).to(dtype)
    v = torch.randn(5, 40, 3, 64, generator=g).to(dtype)
    bias = torch.zeros(5, 48)  # a row's inlined stale tokens get APE's log S; wider than k
    bias[0, 3:30] = bias[2, :10] = -0.69
    full = torch.full((5,), 40)
    masked = torch.tensor([40, 1, 17, 3, 39])
    for lengths, b in ((masked, None), (full, None), (full, bias), (masked, bias)):
        out, lse = fused_padded_attention_with_lse(q, k, v, lengths, 0.125, b)
        want_out, want_lse = padded_attention_with_lse(
            q.double(), k.double(), v.double(), lengths, 0.125, b
        )
        torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
        # a batch with no shared part takes torch's attention, with no LSE to compute
        alone = cascade_attention(q, [], 0.125, PrivateKV(k, v, lengths, b))
        torch.testing.assert_close(alone.double(), want_out, atol=tol, rtol=tol)
        assert alone.dtype == dtype
        if b is not None:  # the bias counts: without it the result differs
            plain, _ = padded_attention_with_lse(q.double(), k.double(), v.double(), lengths, 0.125)
            assert not torch.allclose(plain, want_out, atol=1e-3)
    # PrivateKV's bias is the one the private phase adds
    got = cascade_attention(q.double(), [], 0.125, PrivateKV(k.double(), v.double(), masked, bias))
    want, _ = padded_attention_with_lse(q.double(), k.double(), v.double(), masked, 0.125, bias)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
