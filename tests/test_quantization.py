"""bitsandbytes 8-bit and 4-bit SmolLM2 on this CPU: its own fingerprint, and linking with every
token recomputed still equals a plain prefill of the same quantized model."""

import pytest
import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt
from helpers import random_chunks

from rag_kvcache.config import GenerationConfig, ModelConfig
from rag_kvcache.errors import FingerprintMismatchError
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.strategy import Strategy

pytestmark = pytest.mark.slow  # every test here loads SmolLM2, quantized

LAYERS = {"8bit": Linear8bitLt, "4bit": Linear4bit}


@pytest.fixture(scope="module", params=["8bit", "4bit"])
def quantized(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model(ModelConfig(quantization=request.param, threads=2))


def test_weights_are_quantized_and_fingerprinted_apart(quantized, smol) -> None:
    attention = quantized.model.model.layers[0].self_attn
    kind = next(k for k, cls in LAYERS.items() if isinstance(attention.k_proj, cls))
    assert isinstance(quantized.model.model.layers[-1].mlp.down_proj, LAYERS[kind])
    assert quantized.fingerprint != smol.fingerprint
    assert quantized.dtype == torch.float32 and quantized.num_layers == smol.num_layers


def test_full_link_equals_plain_prefill_of_the_quantized_model(quantized) -> None:
    ids = random_chunks([12, 40, 33, 25], seed=3, vocab=20000)
    query = random_chunks([9], seed=4, vocab=20000)[0]
    chunks = encode_chunks(quantized, ids)
    linked = link(quantized, chunks, query, Strategy.parse("full"))
    cache, logits = prefill(quantized, [t for c in ids for t in c] + query)
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-4, atol=1e-4)
    config = GenerationConfig(max_new_tokens=10)
    position = linked.length
    assert list(decode(quantized, linked.cache, linked.next_logits, position, config)) == list(
        decode(quantized, cache, logits, position, config)
    )


def test_kv_of_the_unquantized_model_is_refused(quantized, smol) -> None:
    ids = random_chunks([8, 10], seed=1)
    chunks = encode_chunks(smol, ids)
    with pytest.raises(FingerprintMismatchError, match="ingest its text again with this model"):
        link(quantized, chunks, [5, 6], Strategy.parse("naive"))
