"""The store under hostile input and faults (issue 19): deployments that must work from a new
folder, names that must not become paths outside the store, stores that must not share blobs,
damage that must be reported rather than read as emptiness."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Target

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import TieredStore

REDIS_URL = "redis://127.0.0.1:6379/0"
DOCS = ["The lighthouse at Hallam Point was built in 1788.", "Velmora has three harbor basins."]


@pytest.fixture
def redis_prefix() -> Iterator[str]:
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
    target: Target, redis_prefix: str, tmp_path: Path, tiny32
) -> None:
    """Neither tier makes the folder (no SQLite file, no blob files), yet the vector index is
    saved there: ingest and retrieval must work on a folder that does not exist yet."""
    root = tmp_path / "new" / "store"
    durable = RedisTier(REDIS_URL, prefix=redis_prefix)
    store = TieredStore(root, catalog=target.open(), durable=durable)
    engine = _engine(store, tiny32)
    done = engine.ingest_document("harbor.md", DOCS)
    hits = engine.retrieve("When was the lighthouse built?", 1)
    assert hits[0].cache_id in done.cache_ids and hits[0].source == "harbor.md"
    assert (root / "index.faiss").is_file() and not (root / "blobs").exists()
    store.close()
