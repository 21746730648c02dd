"""Request KV buffers reused across answers (`model.buffers`): a buffer is handed out again
only after it was released, never while an answer still decodes into it."""

from __future__ import annotations

import gc

import pytest
import torch

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.model.buffers import POOL, BufferPool

CPU = torch.device("cpu")
DOCS = [
    "The lighthouse at Hallam Point was built in 1788 by the harbor guild.",
    "Velmora has three harbor basins and a grain quay on the east side.",
    "The ferry to Orrin leaves twice a day from the north pier.",
]


def test_a_released_buffer_is_reused_and_a_lent_one_never_is() -> None:
    pool = BufferPool()
    a = pool.take((2, 1, 3, 100, 4), torch.float32, CPU)
    b = pool.take((2, 1, 3, 100, 4), torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr() and a.is_contiguous()
    a.fill_(7.0)
    pool.release(a[0])  # the first layer's view names the whole buffer
    smaller = pool.take((2, 1, 3, 90, 4), torch.float32, CPU)
    assert smaller.data_ptr() == a.data_ptr() and smaller.shape == (2, 1, 3, 90, 4)
    assert smaller.is_contiguous()
    assert pool.take((2, 1, 3, 90, 4), torch.float32, CPU).data_ptr() not in {
        a.data_ptr(),
        b.data_ptr(),
    }  # both lent: a new one
    pool.release(b)
    assert pool.take((2, 1, 3, 90, 4), torch.float64, CPU).data_ptr() != b.data_ptr()  # dtype
    slightly_longer = pool.take((2, 1, 3, 110, 4), torch.float32, CPU)  # within the spare 1/8
    assert slightly_longer.data_ptr() == b.data_ptr()
    pool.release(torch.empty(3))  # not the pool's: ignored
    assert pool.free_bytes == 0


def test_kept_bytes_are_bounded_and_unreleased_buffers_are_freed() -> None:
    pool = BufferPool(keep_bytes=10_000)
    buffers = [pool.take((1000,), torch.float32, CPU) for _ in range(3)]  # 4,500 bytes each
    pool.release(*buffers)
    assert pool.free_bytes == 9_000  # the two most recent of three
    assert pool.take((1000,), torch.float32, CPU).data_ptr() == buffers[2].data_ptr()
    lost = pool.take((100_000,), torch.float32, CPU)
    del lost, buffers
    gc.collect()
    assert len(pool._lent) == 0  # lent weakly: a buffer never released dies with its views
    assert pool.take((5,), torch.float32, torch.device("meta")).device.type == "meta"  # as is


def test_a_release_never_waits_for_the_pool_and_a_cache_is_released_once(tiny64) -> None:
    """`release` runs in generators' `finally`, which the garbage collector may run while the
    same thread is inside `take`: it queues what it hands back instead of waiting."""
    import threading

    from rag_kvcache.model.adapter import buffered_cache, new_buffers, release_buffers

    pool = BufferPool()
    a = pool.take((1000,), torch.float32, CPU)

    def inside_take() -> None:
        with pool._lock:  # as `take` holds it
            pool.release(a)

    thread = threading.Thread(target=inside_take, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()  # a blocking release would wait for itself forever
    assert pool.take((1000,), torch.float32, CPU).data_ptr() == a.data_ptr()  # sorted in later

    POOL.clear()
    keys, values = new_buffers(tiny64, 40)
    cache = buffered_cache(tiny64, keys, values, 0)
    release_buffers(cache)
    first = new_buffers(tiny64, 40)  # reuses them
    release_buffers(cache)  # again: ignored, or `first` would be handed out a second time
    second = new_buffers(tiny64, 40)
    taken = {first[0].data_ptr(), first[1].data_ptr()}
    assert taken == {keys.data_ptr(), values.data_ptr()}
    assert not taken & {second[0].data_ptr(), second[1].data_ptr()}


def test_a_short_request_leaves_a_long_ones_buffer_and_the_device_is_kept() -> None:
    pool = BufferPool()
    long = pool.take((10_000,), torch.float32, CPU)
    pool.release(long)
    assert pool.take((1_000,), torch.float32, CPU).data_ptr() != long.data_ptr()  # 10x: no
    assert pool.take((6_000,), torch.float32, CPU).data_ptr() == long.data_ptr()
    with torch.device("meta"):  # a default device elsewhere does not move the CPU's buffers
        assert pool.take((10,), torch.float32, CPU).device == CPU


@pytest.fixture
def engine(tiny64):
    return RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=12)), lm=tiny64)


def test_answers_release_their_buffers_and_reuse_them(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    POOL.clear()
    expected = engine.generate("How many basins?", ids[::-1])  # in new buffers
    assert POOL.free_bytes >= engine.lm.kv_bytes_per_token * expected.prompt_tokens  # released
    engine.generate("When was the lighthouse built?", ids)  # leaves its own KV in them
    released = {f.data_ptr() for f in POOL._free}
    again = engine.generate("How many basins?", ids[::-1])
    assert {f.data_ptr() for f in POOL._free} == released  # the same buffers, reused
    assert again.token_ids == expected.token_ids


@pytest.mark.parametrize("strategy", ["legolink:2", "prefill", "naive+reversed+top:1"])
def test_streams_open_at_once_never_share_a_buffer(engine, strategy: str) -> None:
    """Two answers decoding side by side, their pieces taken in turn, equal each answered
    alone: a buffer released before its answer ends would be overwritten by the other's."""
    ids = engine.generate_context_cache(DOCS)
    questions = ["How many basins?", "When was the lighthouse built?"]
    alone = [engine.generate(q, ids, strategy=strategy).token_ids for q in questions]
    streams = [engine.generate(q, ids, strategy=strategy, stream=True) for q in questions]
    pieces = [iter(s) for s in streams]
    while pieces:
        for it in list(pieces):
            if next(it, None) is None:
                pieces.remove(it)
    assert [s.answer.token_ids for s in streams] == alone


def test_a_closed_stream_releases_its_buffers(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    POOL.clear()
    pieces = iter(engine.generate("How many basins?", ids, stream=True))
    next(pieces)
    assert POOL.free_bytes == 0  # still decoding
    pieces.close()
    assert POOL.free_bytes > 0


def test_batched_answers_release_the_buffers_they_link_in(engine) -> None:
    """The batch links a new context in a request's own buffers, then copies it into the
    prefix tree and its row: those buffers are released at once, and answers stay those of
    `generate` alone."""
    from rag_kvcache.serving.batch import BatchRequest

    ids = engine.generate_context_cache(DOCS)
    questions = ["How many basins?", "When was the lighthouse built?"]
    alone = [engine.generate(q, ids[i:]).token_ids for i, q in enumerate(questions)]
    POOL.clear()
    batched = engine.generate_batch([BatchRequest(q, ids[i:]) for i, q in enumerate(questions)])
    assert POOL.free_bytes > 0
    assert [a.token_ids for a in batched.answers] == alone


@pytest.mark.parametrize(
    "strategy",
    [
        "prefill",
        "naive",
        "legolink:2",
        "legolink:2+reversed+top:1+window:1024+ape:1,0.5",
        "naive+reversed+top:1+window:8",
        "cacheblend:0.3",
    ],
)
def test_a_reused_buffer_is_never_read_past_what_this_request_wrote(engine, strategy) -> None:
    """A reused buffer still holds an earlier request's K/V past this one's length. Filled with
    NaN before it is reused, the answer is unchanged: every read stops at what this request
    wrote (a NaN read, even under a mask, would spread into the scores and the answer)."""
    ids = engine.generate_context_cache(DOCS)
    POOL.clear()
    expected = engine.generate("How many basins?", ids, strategy=strategy)  # new buffers
    poisoned = list(POOL._free)
    assert poisoned, "the answer released no buffers to poison"
    for flat in poisoned:
        flat.fill_(float("nan"))
    again = engine.generate("How many basins?", ids, strategy=strategy)
    assert {f.data_ptr() for f in POOL._free} == {f.data_ptr() for f in poisoned}  # reused
    assert again.token_ids == expected.token_ids
    assert again.text == expected.text
