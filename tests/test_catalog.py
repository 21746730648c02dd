"""The SQL catalog of the KV store, against a real SQLite file and a real PostgreSQL.

Every test runs on both backends. PostgreSQL tests each get a fresh schema (dropped afterwards)
and are skipped, with the reason shown, when no server answers; set RAG_KVCACHE_TEST_PG_URL to
point them at another server.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from conftest import Target
from sqlalchemy import create_engine, inspect
from sqlalchemy import text as sql_text
from sqlalchemy.pool import NullPool

from rag_kvcache.errors import StoreUnavailableError, UnknownCacheIdError
from rag_kvcache.storage import database
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.database import alembic_config, head_revision
from rag_kvcache.storage.records import CatalogError, CatalogStats, CatalogUnavailableError
from rag_kvcache.storage.tables import Base

TABLES = {
    "models",
    "calibrations",
    "adapters",
    "documents",
    "document_chunks",
    "chunks",
    "placements",
    "counters",
    "store_identity",
}
FP = "ab" * 12  # a model fingerprint
SUM = "0123456789abcdef" * 4  # a sha256 hex checksum


@pytest.fixture
def cat(target: Target) -> Iterator[Catalog]:
    with target.open() as catalog:
        catalog.register_model(FP, "tiny", "float32", 3, 2, 16)
        yield catalog


def begin(cat: Catalog, cache_id: str, **overrides: Any) -> bool:
    fields: dict[str, Any] = dict(
        fingerprint=FP, text=f"text of {cache_id}", token_ids=[1, 2, 3], encode_settings="sinks="
    )
    fields.update(overrides)
    return cat.begin_chunk(cache_id, **fields)


def stored(cat: Catalog, cache_id: str, nbytes: int = 100, tier: str = "disk", **kw: Any) -> None:
    begin(cat, cache_id, **kw)
    cat.commit_chunk(cache_id, nbytes, SUM, tier)


def table_names(cat: Catalog) -> set[str]:
    return set(inspect(cat.engine).get_table_names())


def version_rows(cat: Catalog) -> list[str]:
    with cat.engine.connect() as conn:
        return list(conn.scalars(sql_text("SELECT version_num FROM alembic_version")))


# ----------------------------------------------------------------------------- schema


def test_fresh_open_creates_the_tables_with_the_connection_settings(target: Target) -> None:
    with target.open() as cat:
        assert table_names(cat) == TABLES | {"alembic_version"}
        assert version_rows(cat) == [head_revision()]
        with cat.engine.connect() as conn:
            if target.kind == "sqlite":
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
                assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            else:  # the tables are in the test's own schema, not in public
                assert conn.scalar(sql_text("SELECT current_schema()")) == target.schema
                assert not TABLES & set(inspect(conn).get_table_names(schema="public"))
                assert set(inspect(conn).get_table_names(schema=target.schema)) >= TABLES


def test_reopen_is_a_no_op_and_keeps_the_data(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    with target.open() as cat:
        cat.register_model(FP, "tiny", "float32", 3, 2, 16)
        cat.count("hits:disk", 3)

    def no_upgrade(*args: object, **kwargs: object) -> None:
        raise AssertionError("reopening an up-to-date catalog ran a migration")

    monkeypatch.setattr(database.command, "upgrade", no_upgrade)
    with target.open() as again:
        assert version_rows(again) == [head_revision()]
        assert again.stats().models == 1
        assert again.counters() == {"hits:disk": 3}


def test_models_and_migrations_agree(target: Target) -> None:
    with target.open() as cat, cat.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        diffs = compare_metadata(context, Base.metadata)
    if cat.dialect == "sqlite":  # migration 0002 leaves two always-NULL columns there
        diffs = [d for d in diffs if not _legacy_chunk_column(d)]
    assert diffs == []


def _legacy_chunk_column(diff: Any) -> bool:
    """A diff about chunks.document_id / chunks.ordinal, which SQLite keeps unmapped."""
    kind, obj = diff[0], diff[-1]
    if kind == "remove_column":
        return diff[2] == "chunks" and obj.name in ("document_id", "ordinal")
    if kind == "remove_fk":
        return obj.table.name == "chunks" and [c.name for c in obj.columns] == ["document_id"]
    return False


def test_downgrade_removes_everything_and_reopen_restores_it(target: Target) -> None:
    with target.open() as cat:
        with cat.engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        assert table_names(cat) == {"alembic_version"}
        assert version_rows(cat) == []
    with target.open() as cat:
        assert table_names(cat) == TABLES | {"alembic_version"}
        assert version_rows(cat) == [head_revision()]


def test_a_catalog_of_a_newer_version_or_changed_by_hand_is_one_clear_error(
    target: Target,
) -> None:
    """A revision this version does not know was alembic's CommandError traceback; a column
    dropped by hand, PostgreSQL's UndefinedColumn (SQLite's "no such column") in every
    command."""
    with target.open() as cat:
        cat.register_model(FP, "tiny", "float32", 3, 2, 16)
        stored(cat, "a0")
        with cat.engine.begin() as conn:
            conn.execute(sql_text("UPDATE alembic_version SET version_num = '0099'"))
    with pytest.raises(CatalogError, match="revision '0099', which this rag-kvcache does not"):
        target.open()
    with _restamped(target) as cat:
        with cat.engine.begin() as conn:
            conn.execute(sql_text("ALTER TABLE chunks DROP COLUMN hit_count"))
        with pytest.raises(CatalogError, match="does not have the tables this rag-kvcache"):
            cat.chunks(["a0"])


def _restamped(target: Target) -> Catalog:
    """The target's catalog with its revision set back to the newest one known."""
    from sqlalchemy import create_engine

    engine = create_engine(target.url) if target.url else create_engine(f"sqlite:///{target.path}")
    try:
        with engine.begin() as conn:
            if target.schema:
                conn.exec_driver_sql(f'SET search_path TO "{target.schema}"')
            conn.execute(
                sql_text("UPDATE alembic_version SET version_num = :v"), {"v": head_revision()}
            )
    finally:
        engine.dispose()
    return target.open()


def test_upgrade_from_0001_moves_document_links_into_document_chunks(target: Target) -> None:
    with target.open() as cat:
        cat.register_model(FP, "tiny", "float32", 3, 2, 16)
        stored(cat, "a0")
        stored(cat, "a1")
        with cat.engine.begin() as conn:
            command.downgrade(alembic_config(conn), "0001")
            conn.execute(
                sql_text(
                    "INSERT INTO documents (source, content_hash, ingested_at) "
                    "VALUES ('a.txt', :h, CURRENT_TIMESTAMP)"
                ),
                {"h": "1" * 64},
            )
            conn.execute(
                sql_text(
                    "UPDATE chunks SET document_id = (SELECT id FROM documents), "
                    "ordinal = CASE cache_id WHEN 'a0' THEN 1 ELSE 0 END"
                )
            )
    with target.open() as cat:
        assert version_rows(cat) == [head_revision()]
        assert cat.document_chunks("a.txt") == ["a1", "a0"]
        doc = cat.document("a.txt")
        assert doc is not None and doc.chunk_count == 2
        cat.set_document("b.txt", "2" * 64, ["a0", "a1"])  # keeps both chunks' rows
        assert cat.remove_document("a.txt") == []
        assert set(cat.chunks(["a0", "a1"])) == {"a0", "a1"}  # no cascade from the old column


def test_a_postgresql_host_that_never_answers_is_given_up_on(monkeypatch) -> None:
    """A catalog URL at a port that accepts and says nothing (another service's) waited for
    libpq's 130 s in silence; the catalog gives up after PG_CONNECT_TIMEOUT_S, or the URL's."""
    import socket

    pytest.importorskip("psycopg")
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    port = listener.getsockname()[1]
    monkeypatch.setattr(database, "PG_CONNECT_TIMEOUT_S", 1)
    try:
        began = time.monotonic()
        with pytest.raises(CatalogError, match="cannot open the catalog"):
            Catalog(f"postgresql+psycopg://u@127.0.0.1:{port}/x")
        assert time.monotonic() - began < 30
        url = f"postgresql+psycopg://u@127.0.0.1:{port}/x?connect_timeout=2"
        assert database._pg_connect_args(database.make_url(url)) == {}  # the URL's own
    finally:
        listener.close()


def test_bad_arguments_are_refused(tmp_path: Path, target: Target) -> None:
    with pytest.raises(CatalogError, match="URL or an SQLite file path"):
        Catalog()
    with pytest.raises(CatalogError, match="not supported"):
        Catalog("mysql://x@localhost/db")
    if target.kind == "sqlite":
        with pytest.raises(CatalogError, match="only for PostgreSQL"):
            Catalog(path=tmp_path / "x.db", schema="s")
    else:
        with pytest.raises(CatalogError, match="not allowed"):
            Catalog(target.url, schema='x"; DROP TABLE models; --')


# ----------------------------------------------------------------------------- models, chunks


def test_register_model_is_idempotent(cat: Catalog) -> None:
    cat.register_model(FP, "renamed", "bfloat16", 3, 2, 16)  # same fingerprint: ignored
    cat.register_model("cd" * 12, "other", "float16", 30, 3, 64)
    assert cat.stats().models == 2
    with pytest.raises(CatalogError, match="num_layers"):
        cat.register_model("ef" * 12, "bad", "float32", 0, 2, 16)


def test_begin_chunk_claims_once(cat: Catalog) -> None:
    assert begin(cat, "c1", token_ids=[5, 6, 7, 8], start=2) is True
    assert begin(cat, "c1") is False
    row = cat.chunk("c1")
    assert row is not None
    assert (row.state, row.nbytes, row.checksum, row.hit_count, row.pinned) == (
        "pending",
        0,
        None,
        0,
        False,
    )
    assert (row.token_ids, row.token_count, row.start) == ((5, 6, 7, 8), 4, 2)
    assert row.created_at.tzinfo is UTC and row.last_used_at == row.created_at

    assert begin(cat, "c1", token_ids=[9]) is False
    row = cat.chunk("c1")
    assert row is not None and row.token_ids == (5, 6, 7, 8)  # the first writer's row is kept

    with pytest.raises(CatalogError, match="register_model"):
        begin(cat, "c2", fingerprint="99" * 12)
    assert cat.chunk("c2") is None


def test_commit_chunk_stores_and_places(cat: Catalog) -> None:
    begin(cat, "c1")
    begin(cat, "c2")
    cat.commit_chunk("c1", 4096, SUM, "disk")
    row = cat.chunk("c1")
    assert row is not None and (row.state, row.nbytes, row.checksum) == ("stored", 4096, SUM)
    assert cat.placements("c1") == {"disk"}
    assert cat.placements("c2") == set()
    assert [r.cache_id for r in cat.all_chunks(state="stored")] == ["c1"]
    assert [r.cache_id for r in cat.all_chunks(state="pending")] == ["c2"]
    assert {r.cache_id for r in cat.all_chunks()} == {"c1", "c2"}
    with pytest.raises(UnknownCacheIdError):
        cat.commit_chunk("nope", 1, SUM, "disk")
    with pytest.raises(CatalogError, match="checksum"):
        cat.commit_chunk("c2", 1, "not-hex", "disk")
    with pytest.raises(CatalogError, match="state"):
        cat.all_chunks(state="lost")


def test_chunks_returns_only_known_ids(cat: Catalog) -> None:
    for cid in ("a", "b", "c"):
        begin(cat, cid)
    found = cat.chunks(["a", "c", "missing", "a"])
    assert set(found) == {"a", "c"}
    assert found["c"].text == "text of c"
    assert cat.chunk("missing") is None
    assert cat.chunks([]) == {}


def test_touch_counts_hits_and_moves_last_used(cat: Catalog) -> None:
    for cid in ("a", "b", "c"):
        begin(cat, cid)
    before = cat.chunks(["a", "b", "c"])
    time.sleep(0.01)
    cat.touch(["a", "b", "a"])  # a repeated id in one call is one use
    cat.touch(["a"])
    cat.touch([])
    after = cat.chunks(["a", "b", "c"])
    assert [after[c].hit_count for c in "abc"] == [2, 1, 0]
    assert after["a"].last_used_at > before["a"].last_used_at
    assert after["b"].last_used_at > before["b"].last_used_at
    assert after["a"].last_used_at >= after["b"].last_used_at
    assert after["c"].last_used_at == before["c"].last_used_at


def test_concurrent_touches_of_overlapping_chunks_never_deadlock(target: Target) -> None:
    """Every answer touches its chunks. Four workers touching random overlapping sets, each on
    its own connection: PostgreSQL found some of them deadlocked (a raw error, and a 1 s stall
    each) while the rows were locked in whatever order each UPDATE met them."""
    first = target.open()
    first.register_model(FP, "tiny", "float32", 3, 2, 16)
    ids = [f"{i:032x}" for i in range(30)]
    for cid in ids:
        begin(first, cid)
    catalogs = [target.open() for _ in range(4)]

    def work(seed: int) -> int:
        rng = random.Random(seed)
        for _ in range(60):
            catalogs[seed].touch(rng.sample(ids, 16))
        return 60 * 16

    with ThreadPoolExecutor(len(catalogs)) as pool:
        touched = sum(pool.map(work, range(len(catalogs))))  # re-raises any worker's error
    assert sum(row.hit_count for row in first.chunks(ids).values()) == touched
    for cat in (first, *catalogs):
        cat.close()


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
def test_a_connection_cut_mid_call_is_one_clear_error(target: Target) -> None:
    """The database restarted, or an admin cut the connection: the call's transaction is rolled
    back and named in one line (it was a page of driver traceback), and the next call works."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    cat = target.open()
    admin = create_engine(str(target.url), poolclass=NullPool)
    cut = pytest.raises(CatalogUnavailableError, match="did not answer .*check that the database")
    with cut, cat._write() as conn:  # the connection any write runs on
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with admin.begin() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        conn.exec_driver_sql("SELECT 1")
    admin.dispose()
    cat.register_model(FP, "tiny", "float32", 3, 2, 16)  # a fresh connection from the pool
    assert begin(cat, "a" * 32) and cat.chunk("a" * 32) is not None
    cat.close()


def test_a_lock_not_granted_in_time_is_the_store_unavailable_not_a_bad_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding SQLite's write lock past the busy timeout: a
    `StoreUnavailableError` (a server answers 503, worth a retry), where it was a plain
    CatalogError, which reads as the caller's bad value (400)."""
    import sqlite3

    monkeypatch.setattr(database, "_SQLITE_BUSY_MS", 200)
    cat = Catalog(path=tmp_path / "c.sqlite")
    cat.register_model(FP, "tiny", "float32", 3, 2, 16)
    begin(cat, "a" * 32)
    holder = sqlite3.connect(tmp_path / "c.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(CatalogUnavailableError, match="did not answer .*locked") as refused:
            cat.touch(["a" * 32])
        assert isinstance(refused.value, StoreUnavailableError)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    cat.touch(["a" * 32])  # the lock gone, the next call works
    assert cat.chunk("a" * 32).hit_count == 1
    cat.close()


def test_pins(cat: Catalog) -> None:
    begin(cat, "a")
    begin(cat, "b", pinned=True)
    cat.set_pinned("a", True)
    cat.set_pinned("b", False)
    rows = cat.chunks(["a", "b"])
    assert (rows["a"].pinned, rows["b"].pinned) == (True, False)
    with pytest.raises(UnknownCacheIdError):
        cat.set_pinned("nope", True)


def test_expiry(cat: Catalog) -> None:
    now = datetime.now(UTC)
    for cid in ("old", "older", "later", "never"):
        begin(cat, cid)
    cat.set_expiry("old", now - timedelta(minutes=1))
    # Another offset, same instant rules: stored and compared as UTC.
    cat.set_expiry("older", (now - timedelta(hours=1)).astimezone(timezone(timedelta(hours=5))))
    cat.set_expiry("later", now + timedelta(hours=1))
    row = cat.chunk("older")
    assert row is not None and row.expires_at == now - timedelta(hours=1)
    assert row.expires_at.tzinfo is UTC
    assert cat.expired(now) == ["older", "old"]
    assert cat.expired() == ["older", "old"]
    assert cat.expired(now + timedelta(hours=2)) == ["older", "old", "later"]
    assert cat.expired(now - timedelta(hours=2)) == []
    cat.set_expiry("old", None)
    assert cat.expired(now) == ["older"]
    with pytest.raises(CatalogError, match="timezone-aware"):
        cat.set_expiry("later", datetime(2030, 1, 1))
    with pytest.raises(CatalogError, match="timezone-aware"):
        cat.expired(datetime(2030, 1, 1))
    with pytest.raises(UnknownCacheIdError):
        cat.set_expiry("nope", now)


def test_pending_older_than(cat: Catalog) -> None:
    begin(cat, "dead")
    stored(cat, "done")
    time.sleep(0.01)
    assert cat.pending_older_than(0) == ["dead"]
    assert cat.pending_older_than(3600) == []


# ----------------------------------------------------------------------------- documents, cascades


def test_upsert_document_inserts_then_updates(cat: Catalog) -> None:
    first = cat.upsert_document("a.txt", "1" * 64)
    cat.upsert_document("b.txt", "2" * 64)
    again = cat.upsert_document("a.txt", "3" * 64)
    assert again.id == first.id
    assert again.content_hash == "3" * 64
    assert again.ingested_at >= first.ingested_at
    assert cat.document("a.txt") == again
    assert cat.document("missing.txt") is None
    assert [(d.source, d.content_hash) for d in cat.documents()] == [
        ("a.txt", "3" * 64),
        ("b.txt", "2" * 64),
    ]


def test_set_document_lists_chunks_and_returns_orphans(cat: Catalog) -> None:
    for cid in ("a0", "a1", "shared", "b0", "a2"):
        stored(cat, cid)
    doc, orphans = cat.set_document("a.txt", "1" * 64, ["a0", "a1", "shared"])
    assert (doc.source, doc.content_hash, doc.chunk_count, orphans) == ("a.txt", "1" * 64, 3, [])
    cat.set_document("b.txt", "2" * 64, ["shared", "b0"])
    assert cat.document_chunks("a.txt") == ["a0", "a1", "shared"]
    assert cat.documented_ids() == {"a0", "a1", "shared", "b0"}
    assert cat.sources(["shared", "b0", "a2"]) == {"shared": "a.txt", "b0": "b.txt"}
    assert cat.document_models("a.txt") == {FP} and cat.document_models("none.txt") == set()

    # a.txt changes: a1 is dropped (orphan), a2 is new, shared stays (b.txt lists it too)
    again, orphans = cat.set_document("a.txt", "3" * 64, ["a0", "a2", "shared"])
    assert (again.id, again.content_hash, orphans) == (doc.id, "3" * 64, ["a1"])
    assert cat.document_chunks("a.txt") == ["a0", "a2", "shared"]
    assert cat.chunk("a1") is None  # its row went in the same transaction

    with pytest.raises(CatalogError, match="not in the catalog"):
        cat.set_document("a.txt", "4" * 64, ["a0", "never-begun"])
    assert cat.document("a.txt") == again  # the failed call changed nothing
    assert cat.document_chunks("a.txt") == ["a0", "a2", "shared"]


def test_remove_document_returns_chunks_no_other_document_lists(cat: Catalog) -> None:
    for cid in ("a0", "a1", "b0"):
        stored(cat, cid)
    cat.add_placement("a1", "cpu", 100)
    cat.set_document("a.txt", "1" * 64, ["a0", "a1"])
    cat.set_document("b.txt", "2" * 64, ["b0", "a1"])

    assert cat.remove_document("a.txt") == ["a0"]  # a1 is still b.txt's
    assert cat.document("a.txt") is None
    assert set(cat.chunks(["a0", "a1", "b0"])) == {"a1", "b0"}  # a0's row went with it
    assert cat.placements("a1") == {"disk", "cpu"}
    assert cat.remove_document("b.txt") == ["b0", "a1"]
    assert cat.remove_document("a.txt") == []
    assert cat.documented_ids() == set()


def test_removing_a_chunk_unlinks_it_from_documents(cat: Catalog) -> None:
    for cid in ("a0", "a1"):
        stored(cat, cid)
    cat.set_document("a.txt", "1" * 64, ["a0", "a1"])
    assert cat.remove_chunk("a0")
    assert cat.document_chunks("a.txt") == ["a1"]
    doc = cat.document("a.txt")
    assert doc is not None and doc.chunk_count == 2  # so re-ingestion can tell it is incomplete


def test_placements_and_remove_chunk_cascade(cat: Catalog) -> None:
    stored(cat, "a", nbytes=100)
    stored(cat, "b", nbytes=200)
    cat.add_placement("a", "cpu", 100)
    cat.add_placement("a", "gpu", 100)
    cat.add_placement("b", "cpu", 200)
    cat.add_placement("b", "cpu", 250)  # upsert: refreshed, not duplicated
    assert cat.placements("a") == {"disk", "cpu", "gpu"}
    assert sorted(cat.placed_on("cpu")) == ["a", "b"]
    assert cat.stats().bytes_per_tier == {"disk": 300, "cpu": 350, "gpu": 100}
    assert cat.remove_placement("a", "gpu") is True
    assert cat.remove_placement("a", "gpu") is False
    assert cat.placements("a") == {"disk", "cpu"}
    with pytest.raises(UnknownCacheIdError):
        cat.add_placement("nope", "cpu", 1)

    assert cat.remove_chunk("a") is True
    assert cat.remove_chunk("a") is False
    assert cat.placements("a") == set()
    assert cat.placed_on("cpu") == ["b"]
    assert cat.placed_on("disk") == ["b"]


# ----------------------------------------------------------------------------- counters, stats


def test_counters(cat: Catalog) -> None:
    cat.count("re-encoded")
    cat.count("hits:cpu", 5)
    cat.count("re-encoded")
    cat.count("hits:cpu", -2)
    assert cat.counters() == {"hits:cpu": 3, "re-encoded": 2}


def test_counters_from_four_threads_each_with_its_own_catalog(target: Target, cat: Catalog) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work() -> None:
        try:
            with target.open() as mine:
                start.wait(timeout=30)
                for _ in range(50):
                    mine.count("hits:disk")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert cat.counters() == {"hits:disk": 200}


def test_stats(cat: Catalog) -> None:
    assert cat.stats() == CatalogStats(
        models=1, documents=0, chunks=0, bytes_per_tier={}, chunks_per_state={}, counters={}
    )
    stored(cat, "a", nbytes=1000)
    cat.set_document("a.txt", "1" * 64, ["a"])
    cat.upsert_document("b.txt", "2" * 64)
    stored(cat, "b", nbytes=500, tier="redis")
    begin(cat, "c")
    cat.add_placement("a", "cpu", 1000)
    cat.count("checksum-failures", 2)
    assert cat.stats() == CatalogStats(
        models=1,
        documents=2,
        chunks=3,
        bytes_per_tier={"disk": 1000, "redis": 500, "cpu": 1000},
        chunks_per_state={"stored": 2, "pending": 1},
        counters={"checksum-failures": 2},
    )


# ----------------------------------------------------------------------------- processes


def _claim_in_process(
    url: str | None,
    path: Path | None,
    schema: str | None,
    ids: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """Child process: open the (fresh) catalog at the same moment as the others, claim ids."""
    try:
        barrier.wait(timeout=60)
        with Catalog(url, path=path, schema=schema) as cat:
            cat.register_model(FP, "tiny", "float32", 3, 2, 16)
            won = [cid for cid in ids if begin(cat, cid)]
        results.put(("ok", won))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def test_begin_chunk_across_processes_claims_each_id_once(target: Target) -> None:
    ids = [f"chunk-{i:02d}" for i in range(50)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    rng = random.Random(0)
    procs = []
    for k in range(4):
        # Overlapping sets: each process tries 40 of the 50 ids, in its own order.
        mine = [cid for i, cid in enumerate(ids) if i % 5 != k]
        rng.shuffle(mine)
        procs.append(
            ctx.Process(
                target=_claim_in_process,
                args=(target.url, target.path, target.schema, mine, barrier, results),
            )
        )
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [detail for status, detail in outcomes if status == "error"]
    assert errors == []
    won = [cid for _, claimed in outcomes for cid in claimed]
    assert sorted(won) == ids  # every id claimed, and exactly once
    with target.open() as cat:
        assert sorted(r.cache_id for r in cat.all_chunks()) == ids
        assert cat.stats().chunks == 50 and cat.stats().models == 1
        assert version_rows(cat) == [head_revision()]


def _two_workers_and_chunk_x_of_b(target: Target) -> tuple[Catalog, Catalog]:
    """Two catalogs on one database (two workers), which holds chunk X listed by b.md."""
    with target.open() as setup:
        setup.register_model(FP, "tiny", "float32", 3, 2, 16)
        stored(setup, "x" * 32)
        setup.set_document("b.md", "b" * 64, ["x" * 32])
    return target.open(), target.open()


def _outcome_of(outcome: dict[str, object], name: str, call: Any) -> None:
    """What `call()` returned or raised (a thread's body), as outcome[name]."""
    try:
        outcome[name] = call()
    except Exception as e:  # checked by the test
        outcome[name] = e


# a backend waiting on a lock it was not granted, which holds locks in the test's schema
_WAITING = """
SELECT count(DISTINCT waiting.pid) FROM pg_locks waiting
JOIN pg_locks held ON held.pid = waiting.pid
JOIN pg_class c ON c.oid = held.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE NOT waiting.granted AND n.nspname = :schema
"""


def _waits_on_a_lock(target: Target, within_s: float = 10.0) -> bool:
    """Does some transaction on the test's schema wait on a lock within `within_s` (asked of
    PostgreSQL's pg_locks from a connection of its own)?"""
    engine = create_engine(str(target.url), poolclass=NullPool)
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                if conn.execute(sql_text(_WAITING), {"schema": target.schema}).scalar():
                    return True
            time.sleep(0.02)
        return False
    finally:
        engine.dispose()


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
@pytest.mark.parametrize("listed_first", [True, False])
def test_a_chunk_listed_while_another_drops_it_is_neither_lost_nor_listed_dangling(
    target: Target, listed_first: bool, monkeypatch
) -> None:
    """Worker A lists chunk X for its document while worker B removes the only document that
    listed X. B read "no document lists X" before A's listing committed, then deleted X once
    A committed, and the cascade took A's listing with it: A's document silently lost a
    chunk. Now the two go one after the other: A listed first, X stays listed; B first, A's
    listing fails as ChunksGoneError (the engine caches X again)."""
    from rag_kvcache.storage.records import ChunksGoneError

    a, b = _two_workers_and_chunk_x_of_b(target)
    inside, go = threading.Event(), threading.Event()
    first, second = (a, b) if listed_first else (b, a)
    real = Catalog._drop_orphans

    def held_open(conn, cache_ids):  # the first worker's transaction, held open
        dropped = real(conn, cache_ids)
        if threading.current_thread().name == "first":
            inside.set()
            go.wait(10)
        return dropped

    monkeypatch.setattr(first, "_drop_orphans", held_open)
    listing = lambda: a.set_document("a.md", "a" * 64, ["x" * 32])  # noqa: E731
    removal = lambda: b.remove_document("b.md")  # noqa: E731
    outcome: dict[str, object] = {}
    run = partial(_outcome_of, outcome)

    calls = (listing, removal) if listed_first else (removal, listing)
    one = threading.Thread(target=run, args=("first", calls[0]), name="first")
    one.start()
    assert inside.wait(10)
    two = threading.Thread(target=run, args=("second", calls[1]), name="second")
    two.start()
    try:
        assert _waits_on_a_lock(target)  # the second waits on the first's locks (not a race)
    finally:  # (a failed wait lets both finish and go, not hold their transactions)
        go.set()
        one.join(10)
        two.join(10)
    listed = a.document_chunks("a.md")
    if listed_first:  # X stays, listed by A's document
        assert listed == ["x" * 32] and a.chunk("x" * 32) is not None
        assert outcome["second"] == []  # B dropped nothing
    else:  # X went with B's document; A's listing was refused, not kept dangling
        assert outcome["first"] == ["x" * 32] and a.chunk("x" * 32) is None
        assert isinstance(outcome["second"], ChunksGoneError) and listed == []
    for catalog in (a, b):
        catalog.close()


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
def test_a_document_removed_while_gc_removes_its_chunk_does_not_deadlock(
    target: Target, monkeypatch
) -> None:
    """A document's removal dropped its chunk listings, then locked the chunks' rows; gc
    (or expire_cache) deleting one of those chunks locks its row, then its listings (the
    cascade): each waited for the other, and PostgreSQL aborted one ("did not answer").
    Rows are now locked in one order everywhere: chunks, then listings."""
    a, b = _two_workers_and_chunk_x_of_b(target)
    paused, go = threading.Event(), threading.Event()
    real = Catalog._lock_chunks

    def pausing(conn, cache_ids):  # the removal, stopped where it takes the chunks' locks
        if threading.current_thread().name == "removal" and not paused.is_set():
            paused.set()
            go.wait(10)
        return real(conn, cache_ids)

    monkeypatch.setattr(Catalog, "_lock_chunks", staticmethod(pausing))
    outcome: dict[str, object] = {}
    run = partial(_outcome_of, outcome)

    removal = threading.Thread(
        target=run, args=("removal", lambda: a.remove_document("b.md")), name="removal"
    )
    removal.start()
    assert paused.wait(10)
    gc = threading.Thread(target=run, args=("gc", lambda: b.remove_chunk("x" * 32)))
    gc.start()
    gc.join(3)  # it finishes (the removal holds no lock it needs) or waits on one
    go.set()
    removal.join(15)
    gc.join(15)
    assert not isinstance(outcome.get("removal"), Exception), outcome
    assert not isinstance(outcome.get("gc"), Exception), outcome
    assert a.document("b.md") is None and a.chunk("x" * 32) is None
    for catalog in (a, b):
        catalog.close()
