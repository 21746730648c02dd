"""Float32 CPU attention by oneDNN matmuls (`model.cpu_attention`): equal to torch's
`scaled_dot_product_attention`, its reference, to float32 rounding; taken where it serves and
only there; and the model's forwards (prefill, linking) compute through it."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import needs_onednn, onednn_calls, random_chunks

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.masks import link_mask
from rag_kvcache.model import cpu_attention
from rag_kvcache.model.attention import _sdpa, additive_mask
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.strategy import Strategy

# oneDNN's path whatever this CPU's maker (the library takes it on AMD processors only)
pytestmark = pytest.mark.usefixtures("onednn_chosen")

MIN = torch.finfo(torch.float32).min
FIRST_ROW = torch.tensor([0])


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
@pytest.mark.parametrize("queries", [1 + 2 * cpu_attention.ROW_BLOCK, 300])
def test_a_causal_prefill_equals_sdpa_across_its_blocks(heads, kv_heads, queries) -> None:
    """Blocks of ROW_BLOCK tokens, the last a single one: each reads the keys up to its last
    token, its diagonal masked."""
    q, k, v = qkv(heads, kv_heads, queries, queries)
    assert cpu_attention.serves(q, k, v, None)
    out = cpu_attention.attention(q, k, v, None)
    torch.testing.assert_close(out, reference(q, k, v, None), rtol=1e-5, atol=1e-5)
    blocks = -(-queries // cpu_attention.ROW_BLOCK)
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
def test_keys_and_values_in_transformers_layout_and_values_of_another_width() -> None:
    """Keys and values as transformers computes them (heads interleaved per token: a key row
    stride of kv_heads x head_dim), values narrower than keys, a tall masked query attended
    ROW_BLOCK rows at a time."""
    queries, keys = 300, 600
    k = torch.randn(1, keys, 3, 64).transpose(1, 2)
    v = torch.randn(1, keys, 3, 48).transpose(1, 2)
    q = torch.randn(1, queries, 9, 64).transpose(1, 2)
    mask = additive_mask(torch.ones(queries, keys).tril(keys - queries).bool(), torch.float32)
    assert k.stride(2) == 3 * 64 and cpu_attention.serves(q, k, v, mask)
    out = cpu_attention.attention(q, k, v, mask)
    assert out.shape == (1, 9, queries, 48)
    torch.testing.assert_close(out, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    blocks = -(-queries // cpu_attention.ROW_BLOCK)
    assert onednn_calls(lambda: cpu_attention.attention(q, k, v, mask)) == 2 * 3 * blocks


@needs_onednn
def test_a_mask_is_scanned_once_and_again_once_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mask_facts` scans each mask once for the forward's layers, and again for a mask written
    in place since, or for a new mask at the address of a freed one; what it keeps of a mask
    does not keep the mask alive. An all-zero mask adds nothing."""
    scans = []
    real_scan = cpu_attention._scan

    def counted(mask: torch.Tensor) -> cpu_attention.MaskFacts:
        scans.append(tuple(mask.shape))  # (not the mask: it would keep it alive)
        return real_scan(mask)

    monkeypatch.setattr(cpu_attention, "_scan", counted)
    q, k, v = qkv(9, 3, 32, 1024)
    zeros = torch.zeros(1, 1, 32, 1024)
    for _ in range(3):  # three layers
        torch.testing.assert_close(
            cpu_attention.attention(q, k, v, zeros), reference(q, k, v, zeros), rtol=1e-5, atol=1e-5
        )
    assert len(scans) == 1 and cpu_attention.mask_facts(zeros) == (1024, True)
    zeros[..., 5] = MIN  # written in place: key 5 hidden from now on
    assert cpu_attention.mask_facts(zeros) == (5, True) and len(scans) == 2
    torch.testing.assert_close(
        cpu_attention.attention(q, k, v, zeros), reference(q, k, v, zeros), rtol=1e-5, atol=1e-5
    )
    assert len(scans) == 2
    # a freed mask's entry, at the address of a new one: its weak reference is dead
    mask = torch.zeros(1, 1, 32, 1024)
    mask[..., 700] = MIN
    stale = torch.zeros(1)
    cpu_attention._facts[id(mask)] = (
        weakref.ref(stale),
        mask._version,
        cpu_attention.MaskFacts(3, True),
    )
    del stale
    assert cpu_attention.mask_facts(mask) == (700, True) and len(scans) == 3
    gone = weakref.ref(mask)
    del mask
    assert gone() is None


@needs_onednn
def test_under_inference_mode_masks_are_scanned_each_time(tiny32) -> None:
    """Tensors made under `torch.inference_mode` have no version to check a write by: their
    masks are scanned at every call, and a link under it gives what it gives outside."""
    q, k, v = qkv(9, 3, 32, 1024)
    with torch.inference_mode():
        mask = torch.zeros(1, 1, 32, 1024)
        mask[..., 9] = MIN
        assert cpu_attention.serves(q, k, v, mask)
        out = cpu_attention.attention(q, k, v, mask)
        torch.testing.assert_close(out, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    ids = random_chunks([12, 40, 33, 25], seed=3)
    chunks = encode_chunks(tiny32, ids)
    outside = link(tiny32, chunks, [7, 8, 9], Strategy.parse("legolink:2"))
    with torch.inference_mode():
        inside = link(tiny32, chunks, [7, 8, 9], Strategy.parse("legolink:2"))
    torch.testing.assert_close(inside.next_logits, outside.next_logits)


def _refused() -> list[tuple[str, tuple]]:
    q, k, v = qkv(9, 3, 64, 2048)
    causal = additive_mask(torch.ones(64, 2048).tril(2048 - 64).bool(), torch.float32)
    cases: list[tuple[str, tuple]] = [
        ("float64", (q.double(), k.double(), v.double(), causal.double())),
        ("bfloat16", (q.bfloat16(), k.bfloat16(), v.bfloat16(), causal.bfloat16())),
        ("a boolean mask", (q, k, v, causal > MIN / 2)),
        ("-inf in the mask", (q, k, v, causal.masked_fill(causal < 0, float("-inf")))),
        (
            "a row masked whole by -inf",
            (q, k, v, causal.index_fill(2, torch.tensor([0]), -math.inf)),
        ),
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
    """Refused cases go to torch's kernel through the CPU path's `_sdpa`: no oneDNN call (the
    result is then torch's own, NaN-free for the row masked whole)."""
    _, (q, k, v, mask) = _refused()[case]
    assert not cpu_attention.serves(q, k, v, mask)
    expected = reference(q, k, v, mask)
    assert onednn_calls(lambda: _sdpa(q, k, v, mask, None)) == 0
    if q.dtype == torch.float32:
        got = _sdpa(q, k, v, mask, None)
        torch.testing.assert_close(got, expected, equal_nan=True)
        assert not got.isnan().any()


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
    full = Strategy.parse("full")
    link_linears = onednn_calls(lambda: link(tiny32, chunks, query, full))
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 1)
    calls = onednn_calls(lambda: prefill(tiny32, tokens + query))
    assert calls - linears == 2 * 2 * tiny32.num_layers  # 2 matmuls, 2 KV heads, 1 block
    _, logits = prefill(tiny32, tokens + query)
    torch.testing.assert_close(logits, fused, rtol=1e-4, atol=1e-4)
    assert onednn_calls(lambda: link(tiny32, chunks, query, full)) > link_linears
    linked = link(tiny32, chunks, query, full)
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-4, atol=1e-4)
    assert int(linked.next_logits.argmax()) == int(logits.argmax())
