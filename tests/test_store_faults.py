"""Fault injection: a process that ingests, replaces and removes documents, runs gc and
verify, is SIGKILLed at random moments, again and again, on SQLite and on PostgreSQL + Redis.
After each kill the store is checked, then repaired (verify --repair, gc):

- nothing lost: every document version reported committed is still there (or a later one),
  and every chunk a document lists is stored, with a blob that verifies;
- nothing orphaned: after repair, every blob has a row, no row is pending, no temporary left;
- nothing shared: a second store on the same Redis database (and PostgreSQL server) is
  untouched.

The children are forked from a forkserver that has imported torch once, so a kill costs
tens of milliseconds, not a Python start: 20 kills per backend in well under a minute.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import uuid
from collections.abc import Iterator
from multiprocessing import forkserver as forkserver_module
from pathlib import Path

import pytest
import torch
from conftest import postgres_url
from helpers import build_tiny, random_chunks
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool
from store_worker import SOURCES, churn, version_hash

from rag_kvcache.engine import reencoder
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import TieredStore

REDIS_URL = "redis://127.0.0.1:6379/0"
KILLS = 20
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.stress


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.BaseContext:
    """A forkserver that has imported the worker (torch and all) once. Python 3.11's forkserver
    ignores the parent's sys.path, so the tests folder reaches it through PYTHONPATH."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["store_worker"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved]))
    try:
        forkserver_module.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict]:
    """Where the stores live: SQLite + disk, or PostgreSQL (a schema each) + one Redis."""
    if request.param == "sqlite":
        yield {"url": None, "schema": None, "redis_url": None, "sqlite": True}
        return
    url, reason = postgres_url()
    if url is None:
        pytest.skip(reason)
    try:
        RedisTier(REDIS_URL, prefix="rag-kvcache-test:")
    except StoreUnavailableError as err:
        pytest.skip(str(err))
    schemas = [f"t_{uuid.uuid4().hex[:16]}" for _ in range(2)]
    yield {"url": url, "schemas": schemas, "redis_url": REDIS_URL, "sqlite": False}
    admin = create_engine(url, poolclass=NullPool)
    with admin.begin() as conn:
        for schema in schemas:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    admin.dispose()


def _args(backend: dict, root: Path, which: int) -> dict:
    if backend["sqlite"]:
        return {
            "root": str(root),
            "url": None,
            "path": str(root / "catalog.sqlite"),
            "schema": None,
            "redis_url": None,
        }
    return {
        "root": str(root),
        "url": backend["url"],
        "path": None,
        "schema": backend["schemas"][which],
        "redis_url": backend["redis_url"],
    }


def _open(args: dict, lm) -> TieredStore:
    catalog = Catalog(
        args["url"], path=Path(args["path"]) if args["path"] else None, schema=args["schema"]
    )
    return TieredStore(
        Path(args["root"]), catalog=catalog, redis_url=args["redis_url"], reencode=reencoder(lm)
    )


def _bystander(args: dict, lm) -> tuple[TieredStore, set[str]]:
    """Store B: a few chunks, the same as the churning store's first ones (same cache IDs)."""
    store = _open(args, lm)
    store.register_model(lm.fingerprint, "tiny", "float64", 3, 2, 16)
    chunks = [[7, 7, 7, s.encode()[0]] for s in SOURCES] + random_chunks([5, 6], seed=99)
    for kv in encode_chunks(lm, chunks):
        store.put(kv, "bystander")
    return store, store.catalog.chunk_ids()


def test_random_sigkills_lose_nothing_orphan_nothing_share_nothing(
    backend: dict, forkserver, tmp_path: Path
) -> None:
    lm = build_tiny(torch.float64)
    a_args, b_args = _args(backend, tmp_path / "a", 0), _args(backend, tmp_path / "b", 1)
    bystander, b_ids = _bystander(b_args, lm)
    _open(a_args, lm).close()  # make store A (and its schema) before the children race
    rng, reported, kills_mid_work = random.Random(19), {}, 0
    try:
        for attempt in range(KILLS):
            receive, send = forkserver.Pipe(duplex=False)
            child = forkserver.Process(target=churn, args=({**a_args, "seed": attempt}, send))
            child.start()
            send.close()
            assert receive.poll(120) and receive.recv()[0] == "ready", attempt
            time.sleep(rng.uniform(0.0, 0.8))
            child.kill()
            child.join(30)
            assert child.exitcode == -9, f"attempt {attempt}: the child died on its own"
            while receive.poll():
                try:
                    what, source, version = receive.recv()
                except EOFError:
                    break
                reported[source] = version if what == "committed" else None  # or removing
                kills_mid_work += 1
            receive.close()
            _check_after_a_kill(a_args, lm, reported, attempt)
        assert bystander.verify(repair=False).checked == len(b_ids)
        assert bystander.catalog.chunk_ids() == b_ids == set(bystander.durable.ids())
        assert kills_mid_work >= KILLS  # the kills landed after real work, not at start-up
    finally:
        bystander.close()
        if not backend["sqlite"]:
            for args in (a_args, b_args):
                store = _open(args, lm)
                for cid in list(store.durable.ids()):
                    store.durable.remove(cid)
                store.close()


def _check_after_a_kill(args: dict, lm, reported: dict, attempt: int) -> None:
    store = _open(args, lm)
    try:
        before = store.verify(repair=False)
        assert before.corrupt == [] and before.missing == [], attempt  # writes are atomic
        assert before.unreadable == [], attempt
        store.verify(repair=True)  # drops orphan blobs (a kill after a document commit)
        store.gc(pending_after_s=0)  # the dead writer's claim and temporaries
        rows = store.catalog.chunk_ids()
        assert set(store.durable.ids()) == rows, attempt  # no orphan, no blob missing
        assert store.catalog.chunk_ids("pending") == set(), attempt
        if args["redis_url"] is None:
            assert store.durable.remove_temporaries(0) == 0, attempt  # type: ignore[call-arg]
        for source in SOURCES:  # nothing lost
            doc = store.catalog.document(source)
            version = reported.get(source)
            if version is not None:
                assert doc is not None, (attempt, source)
                hashes = {version_hash(source, v) for v in range(version, (attempt + 1) * 1000)}
                assert doc.content_hash in hashes, (attempt, source)  # that version or later
            if doc is not None:
                listed = store.catalog.document_chunks(source)
                assert len(listed) == doc.chunk_count and set(listed) <= rows, (attempt, source)
        assert store.verify(repair=False).orphans == [], attempt
    finally:
        store.close()
