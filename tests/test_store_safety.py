"""The store under hostile input and faults (issue 19): deployments that must work from a new
folder, names that must not become paths outside the store, stores that must not share blobs,
damage that must be reported rather than read as emptiness."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Target
from helpers import random_chunks
from hypothesis import given
from hypothesis import strategies as st

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.errors import InvalidNameError, UnknownCacheIdError
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage import MemoryStore
from rag_kvcache.storage.disk import DiskTier
from rag_kvcache.storage.layout import RULES, named_path, redis_prefix, schema_path
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import TieredStore

REDIS_URL = "redis://127.0.0.1:6379/0"
DOCS = ["The lighthouse at Hallam Point was built in 1788.", "Velmora has three harbor basins."]


@pytest.fixture
def redis_namespace() -> Iterator[str]:
    """A key prefix of its own in the shared Redis, emptied afterwards."""
    prefix = f"rag-kvcache-test:{uuid.uuid4().hex}:"
    try:
        tier = RedisTier(REDIS_URL, prefix=prefix)
    except StoreUnavailableError as err:
        pytest.skip(str(err))
    yield prefix
    for cid in list(tier.ids()):
        tier.remove(cid)


def _engine(store: TieredStore, lm) -> RagKVCache:
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=2))
    return RagKVCache(config, lm=lm, store=store)


# ----------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
def test_postgres_catalog_and_redis_blobs_work_from_a_new_store_folder(
    target: Target, redis_namespace: str, tmp_path: Path, tiny32
) -> None:
    """Neither tier makes the folder (no SQLite file, no blob files), yet the vector index is
    saved there: ingest and retrieval must work on a folder that does not exist yet."""
    root = tmp_path / "new" / "store"
    durable = RedisTier(REDIS_URL, prefix=redis_namespace)
    store = TieredStore(root, catalog=target.open(), durable=durable)
    engine = _engine(store, tiny32)
    done = engine.ingest_document("harbor.md", DOCS)
    hits = engine.retrieve("When was the lighthouse built?", 1)
    assert hits[0].cache_id in done.cache_ids and hits[0].source == "harbor.md"
    assert (root / "index.faiss").is_file() and not (root / "blobs").exists()
    store.close()


# ----------------------------------------------------------------------------- item 2: names

VALID_ID = "0123456789abcdef" * 2
HOSTILE = [
    "..",
    ".",
    "../../x",
    "../" * 20 + "etc/passwd",
    "/etc/passwd",
    "/" + VALID_ID,
    VALID_ID[:2] + "/../" + VALID_ID[6:],
    "a\x00b",
    VALID_ID[:31] + "\x00",
    VALID_ID + "\n",
    "\\..\\x",
    "a" * 10_000,
    "",
    VALID_ID.replace("a", "\u0430"),  # Cyrillic a
    VALID_ID.replace("0", "\uff10"),  # fullwidth zero
    VALID_ID.replace("1", "\u0661"),  # Arabic-Indic one (a Unicode decimal digit)
    "travel\u2215..\u2215x",  # division slashes
    "-rf",
    None,
    42,
    b"travel",
]
KINDS = sorted(kind for kind, rule in RULES.items() if rule.relative_path)  # path kinds


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_names_never_become_paths(kind: str, name: object, tmp_path: Path) -> None:
    with pytest.raises(InvalidNameError, match=f"not a {kind}"):
        named_path(tmp_path, kind, name)


@pytest.mark.parametrize("name", ["0" * 31, "0" * 33, VALID_ID.upper(), " " + VALID_ID[1:]])
def test_cache_ids_are_hex_of_one_length(name: str) -> None:
    with pytest.raises(InvalidNameError, match="exactly 32 lowercase hex digits"):
        named_path(Path("/srv/blobs"), "cache ID", name)


@pytest.mark.parametrize("kind", KINDS)
@given(name=st.one_of(st.text(), st.text(alphabet="./\\\x00abc0123456789", max_size=70)))
def test_any_name_is_refused_or_lands_strictly_inside_its_folder(kind: str, name: str) -> None:
    folder = Path("/srv/store/blobs")
    try:
        path = named_path(folder, kind, name)
    except InvalidNameError:
        return
    assert RULES[kind].pattern.fullmatch(name)
    relative = path.relative_to(folder)
    assert ".." not in relative.parts and "." not in relative.parts
    assert Path(os.path.normpath(path)).is_relative_to(folder) and path != folder
    assert all(c.isascii() and c.isprintable() for c in str(relative))


@given(name=st.from_regex(r"[0-9a-f]{32}", fullmatch=True))
def test_every_real_cache_id_has_its_blob_path(name: str) -> None:
    path = named_path(Path("/srv/blobs"), "cache ID", name)
    assert path == Path("/srv/blobs", name[:2], f"{name}.safetensors")


def test_schema_names_are_slugs_under_the_schemas_folder(tmp_path: Path) -> None:
    assert schema_path(tmp_path, "travel-v2.1") == tmp_path / "schemas" / "travel-v2.1.xml"
    for bad in ("../../x", "..", ".hidden", "a/b", "x" * 65):
        with pytest.raises(InvalidNameError, match="not a schema name"):
            schema_path(tmp_path, bad)


def test_the_store_api_refuses_hostile_ids_before_touching_anything(tmp_path: Path, tiny32) -> None:
    """expire_cache, contains, pins and reads with a hostile ID: the project's error, and no
    file outside the store touched (a victim file sits where `../../x` would lead)."""
    root = tmp_path / "a" / "store"
    victim = tmp_path / "x.safetensors"
    victim.write_bytes(b"keep me")
    store = TieredStore(root)
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    for bad in ("../../x", "/etc/passwd", VALID_ID.upper(), VALID_ID + "\x00"):
        with pytest.raises(InvalidNameError):
            engine.expire_cache(bad)
        with pytest.raises(InvalidNameError):
            store.contains(bad)
        with pytest.raises(InvalidNameError):
            store.set_pinned(bad, True)
        with pytest.raises(UnknownCacheIdError, match="unknown cache ID"):
            engine.generate("q", [ids[0], bad])
    with pytest.raises(UnknownCacheIdError, match="None"):
        engine.generate("q", [None])  # type: ignore[list-item]
    assert victim.read_bytes() == b"keep me" and len(store) == 3
    assert sorted(DiskTier(root / "blobs").ids()) == sorted([engine.prefix_id, *ids])
    store.close()


def test_the_memory_store_refuses_hostile_ids_too(tiny32) -> None:
    store = MemoryStore()
    kv = encode_chunks(tiny32, random_chunks([4], seed=1))[0]
    store.put(kv)
    with pytest.raises(UnknownCacheIdError, match="None"):
        store.get([kv.cache_id, None])  # type: ignore[list-item]
    with pytest.raises(InvalidNameError):
        store.remove("../../x")
    assert store.contains(kv.cache_id)


def test_redis_keys_come_only_from_valid_ids(redis_namespace: str) -> None:
    tier = RedisTier(REDIS_URL, prefix=redis_namespace)
    for bad in ("*", "../x", VALID_ID + "*", "\x00"):
        with pytest.raises(InvalidNameError):
            tier.put(bad, b"data")
    assert tier.key(VALID_ID) == redis_namespace + VALID_ID


# ----------------------------------------------------------------------------- item 4: Redis


def test_two_stores_sharing_one_redis_database_never_touch_each_others_blobs(
    redis_namespace: str, tmp_path: Path, tiny32
) -> None:  # redis_namespace: skips without a Redis
    """Each store's keys live under its own namespace: gc on store A, which sees B's blobs
    as nothing it knows, must leave them alone (they are not A's to delete)."""
    stores = [TieredStore(tmp_path / name, redis_url=REDIS_URL) for name in ("a", "b")]
    try:
        a, b = stores
        assert a.durable.prefix != b.durable.prefix  # type: ignore[attr-defined]
        assert a.durable.prefix == redis_prefix(a.catalog.store_id)  # type: ignore[attr-defined]
        ids = {}
        for store, seed in ((a, 1), (b, 2)):
            ids[store] = _engine(store, tiny32).generate_context_cache([f"text {seed}"] + DOCS)
        report = a.gc(pending_after_s=0)
        assert report.orphan_blobs == 0
        assert b.verify(repair=False).missing == [] and len(b) == 4
        assert set(a.durable.ids()) == {r.cache_id for r in a.catalog.all_chunks()}
        assert set(b.durable.ids()) == {r.cache_id for r in b.catalog.all_chunks()}
        shared = set(ids[a]) & set(ids[b])
        assert len(shared) == 2  # the same chunk is kept once per store, in each namespace
    finally:
        for store in stores:
            for cid in list(store.durable.ids()):
                store.durable.remove(cid)
            store.close()
