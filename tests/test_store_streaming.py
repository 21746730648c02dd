"""Cold chunks read from disk layer by layer behind the link's forward (`storage.streaming`):
the answers equal those from memory, token for token, whatever the strategy; a blob that
fails its checksum after the forward read it is answered again from a repaired copy; buffers
are reused only once nothing reads them."""

from __future__ import annotations

import errno
import gc
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import build_tiny, random_chunks

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache, StrategyError
from rag_kvcache.engine import reencoder
from rag_kvcache.kv import ChunkKV, EncodeSettings, make_cache_id
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.layer_feed import LayerFeed
from rag_kvcache.link.linker import link
from rag_kvcache.link.placement import place_into
from rag_kvcache.model.adapter import new_buffers
from rag_kvcache.storage import streaming
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import Strategy

DOCS = [
    "The lighthouse at Hallam Point was built in 1788 by the harbor guild.",
    "Velmora has three harbor basins and a fish market on the north quay.",
    "The ferry to Orrin leaves at dawn and returns before the evening bell.",
]


@pytest.fixture(params=["direct", "page cache"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """O_DIRECT reads where the system has them, and the page-cache fallback."""
    if request.param == "page cache":
        monkeypatch.setattr(streaming, "DIRECT", 0)
    return request.param == "direct"


@pytest.fixture
def buffers(monkeypatch: pytest.MonkeyPatch) -> streaming.ReadBuffers:
    """A fresh pool of read buffers for this test alone (buffers of earlier tests' chunks
    may be collected at any time, and would go back to the shared one)."""
    fresh = streaming.ReadBuffers()
    monkeypatch.setattr(streaming, "BUFFERS", fresh)
    return fresh


def _engine(root: Path, lm, cpu_bytes: int = 2 << 30, compress: str | None = None):
    store = TieredStore(root, reencode=reencoder(lm), cpu_bytes=cpu_bytes, compress=compress)
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=6))
    return RagKVCache(config, lm=lm, store=store), store


def _forget_hot(store: TieredStore, ids: list[str]) -> None:
    for tier in store.hot:
        for cid in ids:
            tier.remove(cid)


def test_fetch_streams_cold_blobs_and_settles_into_the_hot_tier(tmp_path, tiny32, direct) -> None:
    kvs = encode_chunks(tiny32, random_chunks([5, 9, 7], seed=3))
    store = TieredStore(tmp_path / "kv")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    for kv in kvs:
        store.put(kv, "text")
    ids = [kv.cache_id for kv in kvs]
    _forget_hot(store, ids[1:])  # the first stays hot
    blob = _blobs(store, ids[:1])[0]
    assert blob.direct == (direct and _direct_io_works(tmp_path))
    os.close(blob.fd)
    fetched = store.fetch(ids)
    assert fetched.chunks[0].arrival is None
    assert all(c.arrival is not None for c in fetched.chunks[1:])
    for got, kv in zip(fetched.chunks, kvs, strict=True):
        got.whole()
        assert torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)
        assert got.token_ids == kv.token_ids and got.start == kv.start
    assert fetched.settle()
    for kv in kvs:
        held = store.hot[-1].get(kv.cache_id)
        assert held is not None and held.arrival is None and torch.equal(held.keys, kv.keys)
    assert store.catalog.counters()["hits:disk"] == 2
    store.close()


@pytest.mark.parametrize(
    "strategy",
    [
        "legolink:2",
        "full",
        "naive+reversed+top:1+window:4",
        "cacheblend:0.5",
        "legolink:2+ape:0.7,0.8",
        "prefill",
    ],
)
def test_answers_from_streamed_reads_equal_answers_from_memory(
    tmp_path, tiny32, strategy: str
) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS)
    hot = engine.generate("Who built it?", ids, strategy=strategy)
    for streamed in (True, False):
        store.stream_reads = streamed
        _forget_hot(store, [engine.prefix_id, *ids])
        cold = engine.generate("Who built it?", ids, strategy=strategy)
        assert cold.token_ids == hot.token_ids, streamed
    assert store.catalog.counters().get("reencoded:corrupt") is None
    store.close()


def test_a_blob_failing_its_checksum_after_the_forward_is_answered_from_a_repair(
    tmp_path, tiny32, direct
) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS)
    before = engine.generate("Who built it?", ids, strategy="legolink:2").token_ids
    data = bytearray(store.durable.get(ids[1]))
    data[-3] ^= 0xFF  # the last layer's values: the header parses, the bytes do not check out
    store.durable.put(ids[1], bytes(data))
    _forget_hot(store, [engine.prefix_id, *ids])
    fetched = store.fetch(ids)
    assert fetched.chunks[1].arrival is not None  # it streams: the damage is found after
    assert not fetched.settle()
    assert store.hot[-1].get(ids[1]) is None  # the damaged chunk is not kept
    _forget_hot(store, [engine.prefix_id, *ids])
    assert engine.generate("Who built it?", ids, strategy="legolink:2").token_ids == before
    assert store.catalog.counters()["reencoded:corrupt"] == 1
    assert store.verify().corrupt == []
    store.close()


def test_a_truncated_or_missing_blob_is_read_whole_and_repaired(tmp_path, tiny32) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS)
    before = engine.generate("Who built it?", ids, strategy="legolink:2").token_ids
    store.durable.put(ids[0], store.durable.get(ids[0])[:-100])  # header past the end
    store.durable.remove(ids[1])
    _forget_hot(store, [engine.prefix_id, *ids])
    fetched = store.fetch(ids)  # neither streams: read whole, which repairs them at once
    assert fetched.chunks[0].arrival is None and fetched.chunks[1].arrival is None
    assert fetched.chunks[2].arrival is not None  # the sound one does
    assert fetched.settle()
    _forget_hot(store, [engine.prefix_id, *ids])
    assert engine.generate("Who built it?", ids, strategy="legolink:2").token_ids == before
    counters = store.catalog.counters()
    assert counters["reencoded:corrupt"] == 1 and counters["reencoded:missing"] == 1
    store.close()


def test_bfloat16_blobs_stream_as_stored_and_widen_exactly(tmp_path, tiny32) -> None:
    """A float32 model's bfloat16 blobs arrive as stored (half the bytes) and are widened as
    they are placed: the answers equal those from the same blobs read whole (widened first),
    and the hot tier then keeps them widened, as a whole read does."""
    engine, store = _engine(tmp_path / "kv", tiny32, compress="bfloat16")
    ids = engine.generate_context_cache(DOCS)
    everything = [engine.prefix_id, *ids]
    _forget_hot(store, everything)
    whole = [c.keys for c in store.get(everything)]
    for strategy in ("legolink:2", "naive+reversed+top:1+window:4", "cacheblend:0.5"):
        store.stream_reads = False
        _forget_hot(store, everything)
        expected = engine.generate("Who built it?", ids, strategy=strategy).token_ids
        store.stream_reads = True
        _forget_hot(store, everything)
        fetched = store.fetch(everything)
        assert all(c.arrival is not None for c in fetched.chunks)
        assert all(c.keys.dtype == torch.bfloat16 for c in fetched.chunks)
        assert fetched.settle()
        _forget_hot(store, everything)
        assert engine.generate("Who built it?", ids, strategy=strategy).token_ids == expected
    store.close()  # waits for the widened copies to be kept
    for cid, keys in zip(everything, whole, strict=True):
        held = store.hot[-1].get(cid)
        assert held is not None and held.keys.dtype == torch.float32
        assert torch.equal(held.keys, keys)


def test_a_bfloat16_model_s_blobs_stream_and_stay_bfloat16(tmp_path, tiny_tokenizer) -> None:
    """A 16-bit model's KV is stored as computed whatever `compress` says: it streams, and the
    hot tier keeps it in the model's dtype."""
    lm = build_tiny(torch.bfloat16, tokenizer=tiny_tokenizer)
    engine, store = _engine(tmp_path / "kv", lm, compress="bfloat16")
    ids = engine.generate_context_cache(DOCS)
    hot = engine.generate("Who built it?", ids, strategy="legolink:2").token_ids
    _forget_hot(store, [engine.prefix_id, *ids])
    assert engine.generate("Who built it?", ids, strategy="legolink:2").token_ids == hot
    store.close()
    held = store.hot[-1].get(ids[0])
    assert held is not None and held.keys.dtype == torch.bfloat16


def test_int8_blobs_are_decoded_whole(tmp_path, tiny32) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32, compress="int8")
    ids = engine.generate_context_cache(DOCS)
    hot = engine.generate("Who built it?", ids, strategy="legolink:2").token_ids
    _forget_hot(store, [engine.prefix_id, *ids])
    fetched = store.fetch([engine.prefix_id, *ids])
    assert all(c.arrival is None for c in fetched.chunks)
    _forget_hot(store, [engine.prefix_id, *ids])
    assert engine.generate("Who built it?", ids, strategy="legolink:2").token_ids == hot
    store.close()


def test_read_buffers_are_reused_once_nothing_reads_them(tmp_path, tiny32, buffers) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32, cpu_bytes=0)  # no hot copies
    ids = engine.generate_context_cache(DOCS)
    _forget_hot(store, [engine.prefix_id, *ids])
    first = engine.generate("Who built it?", ids, strategy="legolink:2")
    released = {id(b) for b in buffers.free}
    assert len(released) == 4  # the system prefix and three chunks, handed back
    second = engine.generate("Who built it?", ids, strategy="legolink:2")
    assert {id(b) for b in buffers.free} == released  # the same ones, reused
    assert second.token_ids == first.token_ids
    store.close()

    buffers.clear()  # a chunk a hot tier keeps holds its buffer until evicted
    engine, store = _engine(tmp_path / "kv2", tiny32)
    ids = engine.generate_context_cache(DOCS)
    _forget_hot(store, [engine.prefix_id, *ids])
    engine.generate("Who built it?", ids, strategy="legolink:2")
    assert buffers.free == []
    _forget_hot(store, ids[:1])
    gc.collect()
    assert len(buffers.free) == 1
    store.close()


class ScriptedArrival:
    """Layers arrive as scripted: `arrived()` answers from a list, one value per call."""

    def __init__(self, arrived: list[int]):
        self.script, self.waited = list(arrived), []

    def wait(self, layer: int) -> None:
        self.waited.append(layer)

    def wait_all(self) -> None:
        pass

    def arrived(self) -> int:
        return self.script.pop(0)


def test_layer_feed_places_every_layer_already_arrived_at_once(tiny32) -> None:
    """Off CUDA, chunks arriving from disk are placed in groups of the layers already there
    (here layer 0, then layers 1-2); the result equals placing them all first."""
    chunks = encode_chunks(tiny32, random_chunks([4, 6, 5], seed=9))
    arrival = ScriptedArrival([1, 3])
    arriving = [replace(c, arrival=arrival) for c in chunks]
    keys, values = new_buffers(tiny32, 15)
    feed = LayerFeed(keys[:, 0], values[:, 0], arriving, tiny32.inv_freq)
    for call in feed.calls():
        call()
    assert arrival.waited == [0, 1] and feed.placed == tiny32.num_layers == 3
    ref_keys, ref_values = new_buffers(tiny32, 15)
    place_into(ref_keys[:, 0], ref_values[:, 0], chunks, tiny32.inv_freq)
    assert torch.equal(keys[:, 0, :, :15], ref_keys[:, 0, :, :15])
    assert torch.equal(values[:, 0, :, :15], ref_values[:, 0, :, :15])
    arriving = [replace(c, arrival=ScriptedArrival([1, 3])) for c in chunks]
    linked = link(tiny32, arriving, [5, 6, 7], Strategy.parse("legolink:1"))  # layerwise
    eager = link(tiny32, chunks, [5, 6, 7], Strategy.parse("legolink:1"), layerwise=False)
    assert torch.equal(linked.next_logits, eager.next_logits)


def test_a_blob_cut_short_while_read_settles_as_bad_without_hanging(tmp_path, tiny32) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS[:1])
    row = store.catalog.chunk(ids[0])
    path = store.durable.path(ids[0])
    blob = streaming.open_blob(path, row)
    assert blob is not None
    os.truncate(path, path.stat().st_size // 2)  # after its header was read
    with ThreadPoolExecutor(2) as pool:
        reads = streaming.LayerReads([blob], pool, keep=lambda kv: None)
        reads.wait(tiny32.num_layers - 1)
        assert not reads.settle()
    store.close()


class ManualPool:
    """An executor that runs what is submitted only when told, in order."""

    def __init__(self) -> None:
        self.queue: list = []

    def submit(self, fn, *args):
        self.queue.append((fn, args))

    def run(self, n: int) -> None:
        for _ in range(n):
            fn, args = self.queue.pop(0)
            fn(*args)


def _blobs(store: TieredStore, ids: list[str]) -> list:
    blobs = [streaming.open_blob(store.durable.path(c), store.catalog.chunk(c)) for c in ids]
    assert all(b is not None for b in blobs)
    return blobs


def test_layers_are_read_in_growing_groups_and_arrive_in_order(tmp_path, tiny32) -> None:
    assert [list(g) for g in streaming.layer_groups(30)] == [
        [0],
        [1],
        [2, 3],
        [4, 5, 6, 7],
        list(range(8, 16)),
        list(range(16, 30)),
    ]
    kvs = encode_chunks(tiny32, random_chunks([5, 9], seed=3))
    store = TieredStore(tmp_path / "kv")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    for kv in kvs:
        store.put(kv, "text")
    pool = ManualPool()
    reads = streaming.LayerReads(_blobs(store, [k.cache_id for k in kvs]), pool, lambda kv: None)
    # groups [0], [1], [2] for 3 layers; each group: one read per blob
    assert [(args[1]) for _, args in pool.queue] == [range(0, 1)] * 2 + [range(1, 2)] * 2 + [
        range(2, 3)
    ] * 2
    arrived = []
    for _ in range(6):
        pool.run(1)
        arrived.append(reads.arrived())
    assert arrived == [0, 1, 1, 2, 2, 3]  # a layer counts once every blob has it
    assert reads.settle()
    store.close()


def test_chunks_of_models_with_other_layer_counts_read_without_hanging(tmp_path, tiny32) -> None:
    kv = encode_chunks(tiny32, random_chunks([5], seed=3))[0]
    two = ChunkKV(
        make_cache_id("other-model", EncodeSettings(), [7, 8, 9]),
        "other-model",
        (7, 8, 9),
        torch.randn(2, 2, 3, 16),
        torch.randn(2, 2, 3, 16),
    )
    store = TieredStore(tmp_path / "kv")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    store.register_model("other-model", "other", "float32", 2, 2, 16)
    store.put(kv, "text")
    store.put(two, "text")
    with ThreadPoolExecutor(2) as pool:
        reads = streaming.LayerReads(_blobs(store, [kv.cache_id, two.cache_id]), pool, print)
        for layer in range(3):  # as the link waits: in order; only one chunk has layer 2
            reads.wait(layer)
        assert reads.arrived() == 3
        assert reads.settle()
    store.close()


def test_direct_reads_fall_back_to_the_page_cache_when_refused_midway(
    tmp_path, tiny32, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system has no direct I/O")
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS)
    hot = engine.generate("Who built it?", ids, strategy="legolink:2").token_ids
    refused = []
    preadv = os.preadv

    def refuse_once(fd, buffers, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "refused")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(streaming.os, "preadv", refuse_once)
    everything = [engine.prefix_id, *ids]
    _forget_hot(store, everything)
    fetched = store.fetch(everything)
    assert fetched.settle()  # read right after all, not answered again
    assert refused
    _forget_hot(store, everything)
    assert engine.generate("Who built it?", ids, strategy="legolink:2").token_ids == hot
    store.close()


def _direct_io_works(folder: Path) -> bool:
    if not streaming.DIRECT:
        return False
    probe = folder / "probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | streaming.DIRECT))
    except OSError:
        return False
    return True


def test_a_view_kept_after_eviction_is_never_overwritten(
    tmp_path, tiny32, tiny_tokenizer, buffers
) -> None:
    engine, store = _engine(tmp_path / "kv", tiny32)
    ids = engine.generate_context_cache(DOCS)
    _forget_hot(store, [engine.prefix_id, *ids])
    engine.generate("Who built it?", ids, strategy="legolink:2")  # read from disk, kept hot
    view = store.hot[-1].get(ids[0]).keys[1]  # a caller's view of a hot chunk
    before = view.clone()
    _forget_hot(store, [engine.prefix_id, *ids])  # evicted: its buffer is still viewed
    gc.collect()
    # another model's chunks of the same texts: blobs of the same sizes, other bytes
    other_lm = build_tiny(torch.float32, seed=1, tokenizer=tiny_tokenizer)
    other, other_store = _engine(tmp_path / "kv2", other_lm, cpu_bytes=0)
    more = other.generate_context_cache(DOCS)
    for _ in range(2):  # cold reads that would reuse any buffer handed back
        _forget_hot(other_store, [other.prefix_id, *more])
        other.generate("Who built it?", more, strategy="legolink:2")
    assert torch.equal(view, before)
    store.close()
    other_store.close()


def test_an_answer_refused_after_the_fetch_leaves_nothing_waiting(
    tmp_path, tiny32, buffers, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = []
    take = buffers.take
    monkeypatch.setattr(buffers, "take", lambda size: taken.append(take(size)) or taken[-1])
    engine, store = _engine(tmp_path / "kv", tiny32, cpu_bytes=0)
    ids = engine.generate_context_cache(DOCS)
    _forget_hot(store, [engine.prefix_id, *ids])
    with pytest.raises(StrategyError, match="sink"):  # refused by the linker, after fetch
        engine.generate("Who built it?", ids, strategy="legolink0")
    assert len(taken) == 4  # the system prefix and three chunks, being read
    answer = engine.generate("Who built it?", ids, strategy="legolink:2")
    assert answer.token_ids
    gc.collect()
    # every buffer taken came back: the refused request's too, once its traceback is gone
    assert {id(b) for b in taken} == {id(b) for b in buffers.free}
    store.close()


def test_releasing_a_buffer_never_waits_for_the_pool_s_lock() -> None:
    """The garbage collector may release a buffer while `take` holds the lock, on the same
    thread: release must not wait for it."""
    buffers = streaming.ReadBuffers()
    with buffers._lock:
        buffers.release(mmap.mmap(-1, streaming.BLOCK))
    assert len(buffers.free) == 1
