import pytest
import torch
from helpers import random_chunks

from rag_kvcache.errors import ContextTooLongError, EmptyChunkError
from rag_kvcache.kv import EncodeSettings, make_cache_id
from rag_kvcache.link.encoder import encode_chunks


@pytest.mark.parametrize("batch_size", [2, 8])
def test_batched_encoding_equals_one_by_one(tiny64, batch_size: int) -> None:
    chunks = random_chunks([5, 17, 1, 30, 9], seed=1)
    batched = encode_chunks(tiny64, chunks, batch_size=batch_size)
    for ids, kv in zip(chunks, batched):
        alone = encode_chunks(tiny64, [ids])[0]
        assert kv.token_ids == tuple(ids) and kv.cache_id == alone.cache_id
        assert kv.keys.shape == (3, 2, len(ids), 16)  # [layers, kv_heads, tokens, head_dim]
        torch.testing.assert_close(kv.keys, alone.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(kv.values, alone.values, rtol=0, atol=1e-12)


def test_sink_encoding_keeps_the_chunk_part_of_a_prefill_with_sinks(tiny64) -> None:
    sinks, chunk = random_chunks([3, 11], seed=2)
    kv = encode_chunks(tiny64, [chunk], EncodeSettings(tuple(sinks)))[0]
    with_sinks = encode_chunks(tiny64, [sinks + chunk])[0]
    assert kv.start == 3 and kv.num_tokens == 11
    torch.testing.assert_close(kv.keys, with_sinks.keys[:, :, 3:], rtol=0, atol=1e-12)
    assert kv.cache_id != encode_chunks(tiny64, [chunk])[0].cache_id  # settings are in the ID


def test_cache_id_is_a_stable_content_hash() -> None:
    a = make_cache_id("fp", EncodeSettings(), [1, 2, 3])
    assert a == make_cache_id("fp", EncodeSettings(), [1, 2, 3])
    assert a == "4503cc4b11b1b4ece5d22a374f73a449"  # pinned: the same in every process and release
    assert a != make_cache_id("fp2", EncodeSettings(), [1, 2, 3])
    assert a != make_cache_id("fp", EncodeSettings(), [1, 2, 4])
    assert a != make_cache_id("fp", EncodeSettings((5,)), [1, 2, 3])


def test_bad_chunks_are_refused(tiny64) -> None:
    with pytest.raises(EmptyChunkError, match="chunk 1 has no tokens"):
        encode_chunks(tiny64, [[5], []])
    with pytest.raises(ContextTooLongError, match="window is 512"):
        encode_chunks(tiny64, [[5] * 513])
