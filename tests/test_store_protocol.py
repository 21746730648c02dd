"""The KVStore protocol: what each store does with it. That both stores satisfy it (and that a
broken store does not) is checked by mypy in `make lint`: tests/typecheck/store_protocol.py."""

from pathlib import Path

import pytest
import torch
from helpers import random_chunks

from rag_kvcache import EngineConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.engine import open_store, reencoder
from rag_kvcache.errors import ConfigError, UnknownCacheIdError
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.storage.store import TieredStore


def test_memory_store_keeps_no_documents_and_has_nothing_to_verify(tiny32) -> None:
    store = MemoryStore()
    kvs = encode_chunks(tiny32, random_chunks([3, 5], seed=1))
    for kv in kvs:
        store.put(kv, "t")
    assert store.catalog is None and store.root is None
    checked: list[int] = []
    report = store.verify(on_checked=lambda: checked.append(1))
    assert (report.checked, report.corrupt, report.missing, report.repaired) == (2, [], [], 0)
    assert len(checked) == 2
    store.set_pinned(kvs[0].cache_id, True)  # nothing to evict: a no-op, but a known ID
    with pytest.raises(UnknownCacheIdError):
        store.set_pinned("0" * 32, True)


def test_retrieval_on_a_memory_store_is_a_config_error(tiny32) -> None:
    engine = RagKVCache(EngineConfig(), lm=tiny32)
    assert isinstance(engine.store, MemoryStore)
    with pytest.raises(ConfigError, match="documents and retrieval need a durable store"):
        _ = engine.corpus


def test_tiered_store_pins_and_unpins_in_the_catalog_and_the_hot_tiers(
    tiny32, tmp_path: Path
) -> None:
    a, b = encode_chunks(tiny32, random_chunks([4, 4], seed=2))
    store = TieredStore(tmp_path / "kv", cpu_bytes=a.nbytes)  # room for one chunk
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    (cpu,) = store.hot
    store.put(a, "a")
    store.set_pinned(a.cache_id, True)
    store.put(b, "b")  # no room beside the pinned chunk
    assert cpu.contains(a.cache_id) and not cpu.contains(b.cache_id)
    row = store.catalog.chunk(a.cache_id)
    assert row is not None and row.pinned
    store.set_pinned(a.cache_id, False)
    store.get([b.cache_id])  # read from disk, now kept hot in a's place
    assert cpu.contains(b.cache_id) and not cpu.contains(a.cache_id)
    row = store.catalog.chunk(a.cache_id)
    assert row is not None and not row.pinned
    assert store.root == tmp_path / "kv"
    with pytest.raises(UnknownCacheIdError):
        store.set_pinned("0" * 32, True)
    store.close()


def test_open_store_builds_the_tiered_store_with_the_hook_it_is_given(
    tiny32, tmp_path: Path
) -> None:
    hook = reencoder(tiny32)
    store = open_store(StoreConfig(root=tmp_path), hook)
    assert isinstance(store, TieredStore) and store.reencode is hook
    store.close()
    assert isinstance(open_store(StoreConfig(), hook), MemoryStore)  # memory loses nothing
    kv = encode_chunks(tiny32, random_chunks([6], seed=3))[0]
    tiered = TieredStore(tmp_path / "other", reencode=hook)
    tiered.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    tiered.put(kv, "t")
    row = tiered.catalog.chunk(kv.cache_id)
    assert row is not None
    rebuilt = hook(row)  # what the store would serve for a lost blob
    assert torch.equal(rebuilt.keys, kv.keys) and rebuilt.cache_id == kv.cache_id
    tiered.close()
