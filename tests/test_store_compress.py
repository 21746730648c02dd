"""The durable tier's KV encodings (`compress`): bfloat16 blobs read back as the KV cast to
bfloat16, bit for bit; answers through such a store equal answers from that KV in memory, hot
or cold; blobs of every encoding (and from before the encodings) live in one store; verify and
reads catch damaged bfloat16 blobs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import random_chunks
from safetensors.torch import save

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.engine import reencoder
from rag_kvcache.errors import ConfigError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.blob import (
    CorruptBlobError,
    as_stored,
    checksum,
    from_blob,
    parse_safetensors,
    to_blob,
)
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.storage.store import TieredStore

DOCS = [
    "The lighthouse at Hallam Point was built in 1788 by Ada Crane.",
    "Velmora has three harbor basins; the north one is 14 meters deep.",
    "The festival of kites is held on the first of May in Orly.",
]
QUESTION = "Who built the lighthouse?"


def bf16(kv: ChunkKV) -> ChunkKV:
    """kv rounded to bfloat16 and back: what a bfloat16 blob must read back as."""
    return replace(kv, keys=kv.keys.bfloat16().float(), values=kv.values.bfloat16().float())


def _engine(lm, store) -> RagKVCache:
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=8))
    return RagKVCache(config, lm=lm, store=store)


def _forget_hot(store: TieredStore) -> None:
    for tier in store.hot:
        for cid in list(tier._chunks):
            tier.remove(cid)


def test_a_bfloat16_blob_reads_back_as_the_kv_cast_to_bfloat16(tiny32) -> None:
    kv = encode_chunks(tiny32, random_chunks([40], seed=5))[0]
    data = bytearray(to_blob(kv, "bfloat16"))
    tensors, meta = parse_safetensors(bytearray(data))
    assert meta["compression"] == "bfloat16" and meta["dtype"] == "float32"
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}  # 2 bytes a value on disk
    assert len(data) < len(to_blob(kv)) * 0.51
    back = from_blob(data, checksum(data), kv.cache_id, kv.fingerprint, kv.token_ids, ())
    assert back.keys.dtype == back.values.dtype == torch.float32  # the model's dtype again
    expected = bf16(kv)
    assert torch.equal(back.keys, expected.keys) and torch.equal(back.values, expected.values)
    assert not torch.equal(back.keys, kv.keys)  # it is lossy: the check above is not vacuous
    stored = as_stored(kv, "bfloat16")  # what the hot tiers keep: the same bits
    assert torch.equal(stored.keys, back.keys) and torch.equal(stored.values, back.values)


@pytest.mark.parametrize("compress", [None, "bfloat16", "int8"])
def test_the_hot_copy_is_what_the_blob_reads_back_as(tiny32, tmp_path: Path, compress) -> None:
    """An answer never depends on which tier served the chunk: hot == cold, bit for bit."""
    store = TieredStore(tmp_path / "kv", compress=compress)
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    kvs = encode_chunks(tiny32, random_chunks([12, 30], seed=2))
    for kv in kvs:
        store.put(kv, "t")
    hot = store.get([k.cache_id for k in kvs])
    _forget_hot(store)
    cold = store.get([k.cache_id for k in kvs])
    for a, b, original in zip(hot, cold, kvs, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.keys, original.keys) == (compress is None)
    assert store.catalog.counters()["hits:disk"] == 2  # the second get really read the blobs
    store.close()


def test_an_answer_through_a_bfloat16_store_equals_one_from_bfloat16_kv_in_memory(
    tiny32, tmp_path: Path
) -> None:
    durable = _engine(tiny32, TieredStore(tmp_path / "kv", compress="bfloat16"))
    ids = durable.generate_context_cache(DOCS)
    hot = durable.generate(QUESTION, ids, strategy="naive")
    durable.store.close()  # type: ignore[attr-defined]
    reopened = _engine(tiny32, TieredStore(tmp_path / "kv", compress="bfloat16"))
    cold = reopened.generate(QUESTION, ids, strategy="naive")
    cold_logits = reopened.forced_logits(QUESTION, ids, list(cold.token_ids), "naive")

    memory = _engine(tiny32, MemoryStore())
    assert memory.generate_context_cache(DOCS) == ids
    exact_logits = memory.forced_logits(QUESTION, ids, list(cold.token_ids), "naive")
    chunks = memory.store.get([memory.prefix_id, *ids])
    for kv in chunks:  # the system prompt's KV is a stored chunk too
        memory.store.put(bf16(kv))
    cast = memory.generate(QUESTION, ids, strategy="naive")
    cast_logits = memory.forced_logits(QUESTION, ids, list(cold.token_ids), "naive")

    assert cold.token_ids == hot.token_ids == cast.token_ids and cold.text == cast.text
    assert torch.equal(cold_logits, cast_logits)
    assert not torch.equal(cold_logits, exact_logits)  # bfloat16 KV does change the logits
    assert reopened.store.catalog.counters()["hits:disk"] == 4  # prefix + 3 chunks, cold
    reopened.store.close()  # type: ignore[attr-defined]


def _write_old_blob(store: TieredStore, kv: ChunkKV) -> None:
    """A chunk as the store wrote it before the encodings existed: safetensors `keys` and
    `values` in the model's dtype, no `compression` key (written here without to_blob)."""
    meta = {"cache_id": kv.cache_id, "fingerprint": kv.fingerprint, "start": str(kv.start)}
    data = save({"keys": kv.keys.contiguous(), "values": kv.values.contiguous()}, metadata=meta)
    assert store.catalog.begin_chunk(
        kv.cache_id,
        fingerprint=kv.fingerprint,
        text="old",
        token_ids=kv.token_ids,
        encode_settings=kv.settings.key(),
        start=kv.start,
        pinned=False,
        expires_at=None,
    )
    store.durable.put(kv.cache_id, data)
    store.catalog.commit_chunk(kv.cache_id, len(data), checksum(data), store.durable.name)


def test_float32_blobs_of_an_older_store_still_serve_beside_new_bfloat16_ones(
    tiny32, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    old = TieredStore(root, compress=None)
    old.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    older, newer = encode_chunks(tiny32, random_chunks([20, 24], seed=9))
    _write_old_blob(old, older)
    old.close()

    store = TieredStore(root, compress="bfloat16", reencode=reencoder(tiny32))
    store.put(newer, "new")
    _forget_hot(store)
    got_old, got_new = store.get([older.cache_id, newer.cache_id])
    assert torch.equal(got_old.keys, older.keys) and torch.equal(got_old.values, older.values)
    assert torch.equal(got_new.keys, bf16(newer).keys)
    old_bytes, new_bytes = (len(store.durable.get(k.cache_id) or b"") for k in (older, newer))
    assert new_bytes / newer.num_tokens < 0.55 * old_bytes / older.num_tokens  # half + a header
    report = store.verify()
    assert report.checked == 2 and report.corrupt == [] and report.missing == []
    assert store.catalog.counters().get("reencoded:corrupt") is None  # read, not re-encoded
    store.close()


def test_an_engine_opening_an_older_store_from_the_default_config_serves_its_blobs(
    tiny32, tmp_path: Path
) -> None:
    """A store written before the change, opened by RagKVCache from StoreConfig's default:
    its float32 chunks are read as they are, the answer equals the one from that KV."""
    root = tmp_path / "kv"
    reference = _engine(tiny32, MemoryStore())
    ids = reference.generate_context_cache(DOCS)
    old = TieredStore(root)
    old.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    for kv in reference.store.get([reference.prefix_id, *ids]):
        _write_old_blob(old, kv)
    old.close()
    config = EngineConfig(store=StoreConfig(root), generation=GenerationConfig(max_new_tokens=8))
    engine = RagKVCache(config, lm=tiny32)
    assert engine.generate_context_cache(DOCS) == ids  # all cached already: nothing encoded
    answer = engine.generate(QUESTION, ids, strategy="naive")
    expected = reference.generate(QUESTION, ids, strategy="naive")
    assert answer.token_ids == expected.token_ids
    logits = engine.forced_logits(QUESTION, ids, list(answer.token_ids), "naive")
    expected_logits = reference.forced_logits(QUESTION, ids, list(answer.token_ids), "naive")
    assert torch.equal(logits, expected_logits)
    assert engine.store.catalog.counters()["hits:disk"] == 4  # type: ignore[union-attr]
    # what the engine writes now is the default's: bfloat16, beside the old float32 blobs
    assert StoreConfig().compress == "bfloat16"
    (new_id,) = engine.generate_context_cache(["The bakery on Mill Lane opens at five."])
    blob = engine.store.durable.get(new_id)  # type: ignore[attr-defined]
    assert parse_safetensors(bytearray(blob))[1]["compression"] == "bfloat16"
    old_blob = engine.store.durable.get(ids[0])  # type: ignore[attr-defined]
    assert "compression" not in parse_safetensors(bytearray(old_blob))[1]  # left as it was
    engine.store.close()  # type: ignore[attr-defined]


def _flip_a_byte(store: TieredStore, cache_id: str) -> None:
    path = store.durable.path(cache_id)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the values' bfloat16 payload
    path.write_bytes(bytes(data))


def test_verify_checks_bfloat16_blobs_and_repairs_them_as_bfloat16(tiny32, tmp_path) -> None:
    store = TieredStore(tmp_path / "kv", compress="bfloat16", reencode=reencoder(tiny32))
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    kvs = encode_chunks(tiny32, random_chunks([10, 14], seed=3))
    for kv in kvs:
        store.put(kv, "t")
    assert store.verify(repair=False).corrupt == []
    _flip_a_byte(store, kvs[1].cache_id)
    report = store.verify(repair=False)
    assert report.checked == 2 and report.corrupt == [kvs[1].cache_id]
    assert store.verify(repair=True).repaired == 1
    assert store.verify(repair=False).corrupt == []
    _forget_hot(store)
    (healed,) = store.get([kvs[1].cache_id])
    assert torch.equal(healed.keys, bf16(kvs[1]).keys)  # re-encoded and written as bfloat16
    blob = store.durable.get(kvs[1].cache_id)
    assert blob is not None and parse_safetensors(bytearray(blob))[1]["compression"] == "bfloat16"
    store.close()


def test_verify_parses_what_the_checksum_vouches_for(tiny32, tmp_path: Path) -> None:
    """A blob whose checksum matches but whose bytes are not the KV they claim to be (here
    float32 tensors under a bfloat16 label, as a buggy writer could leave) is corrupt too."""
    store = TieredStore(tmp_path / "kv", compress="bfloat16")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    kv = encode_chunks(tiny32, random_chunks([6], seed=8))[0]
    store.put(kv, "t")
    assert store.verify(repair=False).corrupt == []
    meta = {"cache_id": kv.cache_id, "fingerprint": kv.fingerprint, "start": "0"}
    tensors = {"keys.bf16": kv.keys, "values.bf16": kv.values}
    lying = save(tensors, metadata={**meta, "compression": "bfloat16", "dtype": "float32"})
    store.durable.put(kv.cache_id, lying)
    store.catalog.commit_chunk(kv.cache_id, len(lying), checksum(lying), store.durable.name)
    assert store.verify(repair=False).corrupt == [kv.cache_id]
    store.close()


def test_a_damaged_bfloat16_blob_is_never_served(tiny32, tmp_path: Path) -> None:
    store = TieredStore(tmp_path / "kv", compress="bfloat16")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    kv = encode_chunks(tiny32, random_chunks([16], seed=4))[0]
    store.put(kv, "t")
    _forget_hot(store)
    _flip_a_byte(store, kv.cache_id)
    with pytest.raises(CorruptBlobError, match="is corrupt"):  # no model here to re-encode it
        store.get([kv.cache_id])
    store.close()


def _blob(tensors: dict[str, torch.Tensor], **meta: str) -> bytearray:
    return bytearray(save(tensors, metadata={"cache_id": "c", "start": "0", **meta}))


@pytest.mark.parametrize(
    "data",
    [
        _blob({"keys.bf16": torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)}, compression="bfloat16"),
        _blob(
            {"keys.bf16": torch.zeros(1, 1, 2, 2), "values.bf16": torch.zeros(1, 1, 2, 2)},
            compression="bfloat16",
        ),
        _blob(
            {n: torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16) for n in ("keys", "values")},
            compression="bfloat16",
        ),
        _blob(
            {"keys": torch.zeros(1, 1, 2, 2), "values": torch.zeros(1, 1, 2, 2)}, compression="zip"
        ),
        _blob(
            {
                n: torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
                for n in ("keys.bf16", "values.bf16")
            },
            compression="bfloat16",
            dtype="int64",
        ),
        _blob({"keys.int8": torch.zeros(1, 1, 2, 2, dtype=torch.int8)}, compression="int8"),
    ],
    ids=["no-values", "not-bf16", "plain-names", "unknown-encoding", "not-a-float", "int8-partial"],
)
def test_a_blob_that_does_not_hold_what_it_says_is_corrupt(data: bytearray) -> None:
    """Checksummed right, parsed right, but not the KV its metadata names: CorruptBlobError
    (re-encoded by the store), never a KeyError or KV of the wrong dtype."""
    with pytest.raises(CorruptBlobError, match="blob of chunk c"):
        from_blob(data, checksum(data), "c", "f", (1, 2), ())


def test_compress_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compress 'bf16'"):
        StoreConfig(tmp_path, compress="bf16")
    with pytest.raises(ConfigError, match="compress 'fp8'"):
        TieredStore(tmp_path / "never", compress="fp8")
    assert not (tmp_path / "never").exists()  # refused before any folder was made


def test_bfloat16_stores_kv_of_other_dtypes_as_computed(tiny64) -> None:
    """The option halves float32 KV; float64 (the exact oracle) and 16-bit KV stay as they are."""
    kv = encode_chunks(tiny64, random_chunks([8]))[0]
    assert as_stored(kv, "bfloat16") is kv
    half = replace(kv, keys=kv.keys.half(), values=kv.values.half())
    for given in (kv, half):
        tensors, meta = parse_safetensors(bytearray(to_blob(given, "bfloat16")))
        assert "compression" not in meta and tensors.keys() == {"keys", "values"}
        assert torch.equal(tensors["keys"], given.keys)  # same dtype, same bits
        assert tensors["values"].dtype == given.values.dtype
