"""Float32 CPU attention by oneDNN matmuls (`model.cpu_attention`): equal to torch's
`scaled_dot_product_attention`, its reference, to float32 rounding; taken where it serves and
only there; and the model's forwards (prefill, linking) compute through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_chunks
from torch.profiler import profile

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.masks import link_mask
from rag_kvcache.model import cpu_attention
from rag_kvcache.model.attention import _sdpa, additive_mask
from rag_kvcache.model.cpu_linear import AVAILABLE
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.strategy import Strategy

needs_onednn = pytest.mark.skipif(not AVAILABLE, reason="this torch is built without oneDNN")
ONEDNN_OP = "mkldnn::_linear_pointwise"
MIN = torch.finfo(torch.float32).min


def onednn_calls(fn) -> int:  # type: ignore[no-untyped-def]
    with profile() as p:
        fn()
    return sum(e.count for e in p.key_averages() if e.key == ONEDNN_OP)


def reference(q, k, v, mask, scale=None):  # type: ignore[no-untyped-def]
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[2] > 1,
        scale=scale,
        enable_gqa=True,
    )


def qkv(heads: int, kv_heads: int, queries: int, keys: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, queries, 64, generator=g)
    k = torch.randn(1, kv_heads, keys, 64, generator=g)
    v = torch.randn(1, kv_heads, keys, 64, generator=g)
    return q, k, v


@needs_onednn
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("queries", [1 + 2 * cpu_attention.CAUSAL_BLOCK, 300])
def test_a_causal_prefill_equals_sdpa_across_its_blocks(heads, kv_heads, queries) -> None:
    """Blocks of CAUSAL_BLOCK tokens, the last a single one: each reads the keys up to its
    last token, its diagonal masked."""
    q, k, v = qkv(heads, kv_heads, queries, queries)
    assert cpu_attention.serves(q, k, v, None)
    out = cpu_attention.attention(q, k, v, None)
    torch.testing.assert_close(out, reference(q, k, v, None), rtol=1e-5, atol=1e-5)
    blocks = -(-queries // cpu_attention.CAUSAL_BLOCK)
    assert onednn_calls(lambda: cpu_attention.attention(q, k, v, None)) == 2 * kv_heads * blocks


@needs_onednn
@pytest.mark.parametrize("scale", [None, 0.3])
def test_a_link_forward_over_cached_keys_equals_sdpa(scale) -> None:
    """What the linker's forward attends: recomputed boundary tokens and the question at
    their positions over the whole context, causal by position, a key bias (APE's scale,
    positive and negative) on some keys, with keys and values views of a longer buffer (the
    request's, with room to decode) and the query a transposed view (as transformers hands
    it)."""
    keys, context = 700, 660
    positions = torch.cat((torch.tensor([0, 1, 200, 201, 400, 401]), torch.arange(context, keys)))
    mask = additive_mask(link_mask(positions, keys), torch.float32)  # [1, 1, 46, 700]
    mask[..., 300:350] += torch.linspace(-2, 2, 50)
    buffer_k = torch.randn(1, 3, keys + 20, 64)
    buffer_v = torch.randn(1, 3, keys + 20, 64)
    k, v = buffer_k[:, :, :keys], buffer_v[:, :, :keys]
    q = torch.randn(1, len(positions), 9, 64).transpose(1, 2)
    assert not k.is_contiguous() and not q.is_contiguous()
    assert cpu_attention.serves(q, k, v, mask)
    out = cpu_attention.attention(q, k, v, mask, scale)
    torch.testing.assert_close(out, reference(q, k, v, mask, scale), rtol=1e-5, atol=1e-5)
    assert onednn_calls(lambda: cpu_attention.attention(q, k, v, mask, scale)) == 6


@needs_onednn
def test_a_mask_is_read_again_once_written_and_an_all_zero_mask_adds_nothing() -> None:
    """`_tail` remembers each mask's masked columns for the forward's other layers, but not
    for a mask written in place since, nor for a new mask that reuses a freed one's memory."""
    q, k, v = qkv(9, 3, 32, 1024)
    zeros = torch.zeros(1, 1, 32, 1024)
    assert cpu_attention._tail(zeros) == (1024, None)
    torch.testing.assert_close(
        cpu_attention.attention(q, k, v, zeros), reference(q, k, v, zeros), rtol=1e-5, atol=1e-5
    )
    zeros[..., 5] = MIN  # written in place: key 5 hidden from now on
    first, tail = cpu_attention._tail(zeros)
    assert first == 5 and tail is not None and tail.shape == (32, 1019)
    torch.testing.assert_close(
        cpu_attention.attention(q, k, v, zeros), reference(q, k, v, zeros), rtol=1e-5, atol=1e-5
    )
    del zeros, tail
    for column in (700, 9):  # new masks, maybe at the same address
        mask = torch.zeros(1, 1, 32, 1024)
        mask[..., column] = MIN
        assert cpu_attention._tail(mask)[0] == column
        torch.testing.assert_close(
            cpu_attention.attention(q, k, v, mask), reference(q, k, v, mask), rtol=1e-5, atol=1e-5
        )
        del mask
    remembered = [entry[2] for entry in cpu_attention._firsts.values()]
    assert remembered and all(type(first) is int for first in remembered)  # no mask kept alive


def _refused() -> list[tuple[str, tuple]]:
    q, k, v = qkv(9, 3, 64, 2048)
    causal = additive_mask(torch.ones(64, 2048).tril(2048 - 64).bool(), torch.float32)
    cases: list[tuple[str, tuple]] = [
        ("float64", (q.double(), k.double(), v.double(), causal.double())),
        ("bfloat16", (q.bfloat16(), k.bfloat16(), v.bfloat16(), causal.bfloat16())),
        ("a boolean mask", (q, k, v, causal > MIN / 2)),
        ("a batch of two", tuple(t.expand(2, -1, -1, -1) for t in (q, k, v, causal))),
        ("no mask but fewer queries than keys", (q, k, v, None)),
        ("a decode step", (q[:, :, :1], k, v, None)),
        ("a mask broadcast over the rows", (q, k, v, causal[:, :, -1:])),
        ("too few scores", (q[:, :, :4], k[:, :, :256], v[:, :, :256], causal[:, :, :4, :256])),
        ("a gradient wanted", (q.clone().requires_grad_(), k, v, causal)),
    ]
    return cases


@needs_onednn
@pytest.mark.parametrize("case", range(len(_refused())), ids=[c[0] for c in _refused()])
def test_what_it_does_not_serve_goes_to_sdpa(case: int) -> None:
    """Refused cases are computed by torch's kernel, through the CPU path's `_sdpa`, with the
    result it gives, and no oneDNN call."""
    _, (q, k, v, mask) = _refused()[case]
    assert not cpu_attention.serves(q, k, v, mask)
    expected = reference(q, k, v, mask)
    assert onednn_calls(lambda: _sdpa(q, k, v, mask, None)) == 0
    if q.dtype == torch.float32:
        torch.testing.assert_close(_sdpa(q, k, v, mask, None), expected)


@needs_onednn
def test_autocast_and_onednn_switched_off_are_obeyed() -> None:
    q, k, v = qkv(9, 3, 300, 300)
    assert cpu_attention.serves(q, k, v, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_attention.serves(q, k, v, None)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not cpu_attention.serves(q, k, v, None)


@needs_onednn
def test_a_model_prefills_and_links_through_it_and_full_still_equals_prefill(
    tiny32, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model's attentions are too small to be served by default; served from one
    score up, its prefill and its `full` link (every token recomputed) both go through the
    matmuls, and still agree with each other, and prefill with the fused kernel's."""
    ids = random_chunks([12, 40, 33, 25], seed=3)
    chunks = encode_chunks(tiny32, ids)
    tokens, query = [t for c in ids for t in c], [7, 8, 9, 10, 11]
    _, fused = prefill(tiny32, tokens + query)
    linears = onednn_calls(lambda: prefill(tiny32, tokens + query))
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 1)
    calls = onednn_calls(lambda: prefill(tiny32, tokens + query))
    assert calls - linears == 2 * 2 * tiny32.num_layers  # 2 matmuls, 2 KV heads, 1 block
    _, logits = prefill(tiny32, tokens + query)
    torch.testing.assert_close(logits, fused, rtol=1e-4, atol=1e-4)
    linked = link(tiny32, chunks, query, Strategy.parse("full"))
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-4, atol=1e-4)
    assert int(linked.next_logits.argmax()) == int(logits.argmax())
