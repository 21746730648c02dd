"""The store under hostile input and faults (issue 19): deployments that must work from a new
folder, names that must not become paths outside the store, stores that must not share blobs,
damage that must be reported rather than read as emptiness."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import Target
from helpers import random_chunks
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text as sql_text

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.engine import reencoder
from rag_kvcache.errors import (
    ConfigError,
    InvalidNameError,
    StoreDamagedError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
    UnknownCacheIdError,
)
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.retrieval.index import VectorIndex, file_checksums
from rag_kvcache.storage import MemoryStore
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.disk import DiskTier
from rag_kvcache.storage.layout import (
    FORMAT_VERSION,
    RULES,
    StoreMarker,
    named_path,
    read_marker,
    redis_prefix,
    schema_path,
)
from rag_kvcache.storage.records import CatalogError, ChunksGoneError, VerifyReport
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import PUT_TRIES, TieredStore
from rag_kvcache.tools.cli import main
from rag_kvcache.tools.cli.store import index_problem, rebuild_index

REDIS_URL = "redis://127.0.0.1:6379/0"
PG = "postgresql+psycopg://"
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


def test_a_store_opened_with_the_other_durable_tier_says_which_it_needs(
    redis_namespace: str, tmp_path: Path, tiny32
) -> None:
    """A Redis store opened without --redis-url found no blob in its folder and re-encoded
    every chunk asked for, silently, into the folder; a folder store given a --redis-url did
    the same into Redis. Each is refused, naming the tier the store's blobs are in."""
    redis_store = TieredStore(tmp_path / "r", redis_url=REDIS_URL)
    try:
        _engine(redis_store, tiny32).generate_context_cache(DOCS[:1])
    finally:
        redis_store.close()
    try:
        with pytest.raises(StoreError, match="keeps its blobs in Redis: give the --redis-url"):
            TieredStore(tmp_path / "r")
        assert not (tmp_path / "r" / "blobs").exists()
        beside = f"sqlite:///{tmp_path / 'r' / 'catalog.sqlite'}"  # a reader's new folder
        with pytest.raises(StoreError, match="keeps its blobs in Redis"):
            TieredStore(tmp_path / "new", catalog_url=beside, create=False)
        assert not (tmp_path / "new").exists()  # neither the folder nor its marker left
        TieredStore(tmp_path / "r", redis_url=REDIS_URL).close()  # with it, it opens
        disk_store = TieredStore(tmp_path / "d")
        _engine(disk_store, tiny32).generate_context_cache(DOCS[:1])
        disk_store.close()
        with pytest.raises(StoreError, match="in its folder, not in Redis"):
            TieredStore(tmp_path / "d", redis_url=REDIS_URL)
    finally:
        reopened = TieredStore(tmp_path / "r", redis_url=REDIS_URL)
        for cid in list(reopened.durable.ids()):
            reopened.durable.remove(cid)
        reopened.close()


def test_a_store_leaves_no_redis_connection_open_once_closed_or_refused(
    redis_namespace: str, tmp_path: Path, tiny32
) -> None:
    """The Redis tier's connections were never closed: not by `TieredStore.close`, not when
    the store was refused (a folder store given a --redis-url), so a worker retrying in a loop
    ran the server out of connections."""
    import redis

    name = f"rag-kvcache-test-{uuid.uuid4().hex[:12]}"  # its connections, told apart by name
    url = f"{REDIS_URL}?client_name={name}"
    admin = redis.Redis.from_url(REDIS_URL)

    def open_connections() -> int:
        return sum(client["name"] == name for client in admin.client_list())

    disk_store = TieredStore(tmp_path / "d")  # a folder store, holding a chunk
    _engine(disk_store, tiny32).generate_context_cache(DOCS[:1])
    disk_store.close()
    for _ in range(3):
        with pytest.raises(StoreError, match="in its folder, not in Redis"):
            TieredStore(tmp_path / "d", redis_url=url)
    assert open_connections() == 0
    store = TieredStore(tmp_path / "r", redis_url=url)
    store.durable.put(VALID_ID, b"blob")
    assert open_connections() == 1
    store.durable.remove(VALID_ID)
    store.close()
    assert open_connections() == 0
    admin.close()


def test_a_nul_character_is_dropped_from_text_and_refused_in_a_source_on_both_catalogs(
    target: Target, tmp_path: Path, tiny32
) -> None:
    """PostgreSQL's text cannot hold NUL (PDF extraction leaves some): ingesting such a chunk
    or source was the driver's DataError, with the SQL statement, where SQLite kept it. Now
    both catalogs answer alike: NUL is dropped from chunk text (the KV is of the text kept)
    and refused in a document's source, before anything is encoded; a value the database
    still refuses is a one-line CatalogError."""
    from rag_kvcache.storage.records import CatalogError

    store = TieredStore(tmp_path / "s", catalog=target.open())
    engine = _engine(store, tiny32)
    try:
        done = engine.ingest_document("vault.md", ["The vault code is 4417.\x00 Keep it."])
        clean = engine.generate_context_cache(["The vault code is 4417. Keep it."])
        assert list(done.cache_ids) == clean  # the same chunk, its KV of the text kept
        assert store.catalog.chunks(clean)[clean[0]].text == "The vault code is 4417. Keep it."
        assert engine.retrieve("vault code", 1)[0].cache_id == clean[0]
        before = len(store)
        with pytest.raises(InvalidNameError, match="document source: .* none of them NUL"):
            engine.ingest_document("vault\x00.md", ["Another chunk entirely."])
        assert len(store) == before  # nothing encoded
        if target.kind == "postgresql":  # below the engine: the database's own refusal
            with pytest.raises(CatalogError, match="refused a value .*NUL"):
                engine.cache_token_ids([[5, 6, 7]], engine.doc_settings, ["a\x00b"])
    finally:
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


def test_redis_errors_are_the_stores_and_never_show_the_password(
    redis_namespace: str, tmp_path: Path, tiny32
) -> None:  # redis_namespace: skips without a Redis
    """A password the server refuses is named as such without being repeated; a full Redis
    is the store's full error, with nothing recorded and nothing for the next writer to wait
    out; a value of another type under one of the store's keys is a corrupt blob."""
    import redis

    with pytest.raises(StoreUnavailableError) as refused:
        RedisTier("redis://nobody:hunter2@127.0.0.1:6379/0", prefix=redis_namespace)
    assert "hunter2" not in str(refused.value) and "nobody:***@127.0.0.1:6379" in str(refused.value)

    store = TieredStore(tmp_path / "s", redis_url=REDIS_URL, reencode=reencoder(tiny32))
    tier = store.durable
    assert isinstance(tier, RedisTier)
    engine = _engine(store, tiny32)
    [first] = engine.generate_context_cache(DOCS[:1])

    def full(*_: object) -> None:
        raise redis.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'")

    real_set = tier._redis.set
    tier._redis.set = full  # type: ignore[method-assign]
    with pytest.raises(StoreFullError, match="is full"):
        engine.generate_context_cache(DOCS[1:])
    [kv] = encode_chunks(tiny32, [engine.template.chunk_ids(tiny32.tokenizer, DOCS[1])])
    assert store.catalog.chunk(kv.cache_id) is None  # no claim left behind
    tier._redis.set = real_set  # type: ignore[method-assign]
    started = time.monotonic()
    [second] = engine.generate_context_cache(DOCS[1:])
    assert second == kv.cache_id and time.monotonic() - started < 10  # no dead claim waited on

    for cid in (first, second):
        tier._redis.delete(tier.key(cid))
        tier._redis.lpush(tier.key(cid), b"not a blob")
    for hot in store.hot:
        for cid in (first, second):
            hot.remove(cid)
    report = store.verify(repair=True)
    assert sorted(report.corrupt) == sorted([first, second]) and report.repaired == 2
    assert engine.generate("When?", [first, second]).token_ids
    for cid in list(tier.ids()):
        tier.remove(cid)
    store.close()


# ----------------------------------------------------------------------------- item 7: errors


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real small filesystem at `folder` (needs root to mount; the test skips otherwise)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def one_error_line(capsys: pytest.CaptureFixture[str], *phrases: str) -> str:
    """The command printed an error (no traceback) naming each phrase; returns it."""
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())  # rich wraps at 80 columns
    assert text.startswith("error:") and "Traceback" not in text, text
    for phrase in phrases:
        assert phrase in text, text
    return text


def _make_store(root: Path, tiny32) -> list[str]:
    store = TieredStore(root)
    ids = _engine(store, tiny32).generate_context_cache(DOCS)
    store.close()
    return ids


@pytest.mark.parametrize("command", [["stats"], ["verify"], ["gc"], ["query", "When?"]])
def test_reading_commands_never_create_a_store(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --store is an error before any model loads, and nothing is made there."""
    missing = tmp_path / "stroe"
    assert main([*command, "--store", str(missing)]) == 1
    one_error_line(capsys, "no store at", "stroe")
    assert not missing.exists()
    (tmp_path / "empty").mkdir()  # a folder, but no store in it
    assert main([*command, "--store", str(tmp_path / "empty")]) == 1
    one_error_line(capsys, "no catalog at")
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
def test_a_reader_may_open_a_new_folder_beside_an_existing_shared_catalog(
    target: Target, tmp_path: Path, tiny32
) -> None:
    """Workers on several machines share a PostgreSQL catalog, each with its own folder: a
    reader's new folder is fine when the catalog exists, and an error when it does not."""
    writer = _engine(TieredStore(tmp_path / "first", catalog=target.open()), tiny32)
    cached = writer.generate_context_cache(DOCS)
    reader = TieredStore(tmp_path / "second", catalog=target.open(), create=False)
    assert reader.contains(cached[0])
    assert read_marker(tmp_path / "second") == read_marker(tmp_path / "first")
    reader.close()
    writer.store.close()  # type: ignore[attr-defined]
    missing = f"{target.schema}_other"
    with pytest.raises(StoreNotFoundError, match="no catalog in"):
        Catalog(target.url, schema=missing, create=False)
    with target.open().engine.connect() as conn:  # and it made no schema on the way
        assert (
            conn.scalar(
                sql_text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": missing}
            )
            == 0
        )


def test_a_reader_whose_catalog_does_not_open_leaves_no_new_folder(tmp_path: Path, capsys) -> None:
    """`stats --store NEW --catalog-url <unreachable>` said why, and left NEW behind, empty."""
    unreachable = "postgresql+psycopg://postgres@127.0.0.1:1/test"
    assert main(["stats", "--store", str(tmp_path / "new"), "--catalog-url", unreachable]) == 1
    one_error_line(capsys, "cannot open the catalog")
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there before stays
    with pytest.raises(CatalogError, match="cannot open the catalog"):
        TieredStore(tmp_path / "kept", catalog_url=unreachable, create=False)
    assert (tmp_path / "kept").is_dir()


def test_a_store_path_that_is_a_file_is_one_error_line(tmp_path: Path, capsys) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    assert main(["stats", "--store", str(file)]) == 1
    one_error_line(capsys, "is a file, not a store folder")
    assert file.read_text() == "mine"
    with pytest.raises(StoreError, match="cannot make the store folder"):
        TieredStore(file / "sub")


def test_a_read_only_store_folder_is_one_error_line(tmp_path: Path, tiny32, capsys) -> None:
    with tmpfs(tmp_path / "ro", "16m") as root:
        _make_store(root / "store", tiny32)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        assert main(["stats", "--store", str(root / "store")]) == 1
        one_error_line(capsys, "read-only")


@pytest.mark.parametrize(
    ("flags", "phrase"),
    [
        (["--catalog-url", f"{PG}postgres@127.0.0.1:1/test"], "cannot open"),
        (["--catalog-url", f"{PG}postgres@127.0.0.1:5432/no_such_db"], "no_such_db"),
        (["--catalog-url", f"{PG}no_such_user@127.0.0.1:5432/test"], "no_such_user"),
        (["--catalog-url", f"{PG}postgres@no-such-host.invalid/test"], "cannot open"),
        (["--catalog-url", "not a url"], "cannot be parsed"),
        (["--catalog-url", "mysql://x@y/z"], "not supported"),
        (["--redis-url", "::bad"], "Redis URL cannot be parsed"),
        (["--redis-url", "redis://127.0.0.1:notaport/0"], "Redis URL cannot be parsed"),
        (["--redis-url", "redis://127.0.0.1:1/0"], "unreachable"),
    ],
)
def test_bad_catalog_and_redis_urls_are_one_error_line(
    flags: list[str], phrase: str, tmp_path: Path, tiny32, capsys
) -> None:
    _make_store(tmp_path / "store", tiny32)
    assert main(["stats", "--store", str(tmp_path / "store"), *flags]) == 1
    one_error_line(capsys, phrase)


@pytest.mark.parametrize(
    ("flags", "phrase"),
    [
        (["--chunk-tokens", "0"], "--chunk-tokens must be at least 1, got 0"),
        (["--chunk-tokens", "-5"], "--chunk-tokens must be at least 1, got -5"),
        (["--chunk-tokens", "64", "--overlap", "64"], "--overlap must be from 0 to below"),
        (["--chunk-tokens", "64", "--overlap", "-1"], "--overlap must be from 0 to below"),
    ],
)
def test_bad_chunking_flags_are_one_error_line(flags, phrase, tmp_path: Path, capsys) -> None:
    (tmp_path / "a.md").write_text("The ferry leaves at dawn.")
    store = tmp_path / "store"
    assert main(["ingest", str(tmp_path / "a.md"), "--store", str(store), *flags]) == 1
    one_error_line(capsys, phrase)
    assert not store.exists()


def test_an_empty_question_is_one_error_line(tmp_path: Path, tiny32, capsys) -> None:
    _make_store(tmp_path / "store", tiny32)
    assert main(["query", "  ", "--store", str(tmp_path / "store")]) == 1
    one_error_line(capsys, "the question is empty")


def test_a_full_catalog_disk_is_the_store_full_error(tmp_path: Path, tiny32) -> None:
    """SQLite's 'database or disk is full' on a real 1 MiB filesystem holding the catalog."""
    with tmpfs(tmp_path / "small", "1m") as small:
        catalog = Catalog(path=small / "catalog.sqlite")
        store = TieredStore(tmp_path / "kv", catalog=catalog)
        store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
        kvs = encode_chunks(tiny32, random_chunks([8] * 200, seed=5))
        stored = []
        with pytest.raises(StoreFullError, match="the catalog's disk is full"):
            for kv in kvs:
                store.put(kv, "text " * 2000)  # ~10 KB of text per row
                stored.append(kv.cache_id)
        assert 0 < len(stored) < len(kvs)
        assert {r.cache_id for r in store.catalog.all_chunks("stored")} <= set(stored)
        store.close()


def test_a_catalog_that_cannot_open_on_a_full_disk_says_the_disk_is_full(tmp_path: Path) -> None:
    """With no byte free SQLite cannot write its journal and says only "disk I/O error" (or
    "database or disk is full"): the error names the full disk, not the host and user."""
    with tmpfs(tmp_path / "small", "64k") as small:
        with suppress(OSError):
            (small / "filler").write_bytes(bytes(1 << 20))  # fills the filesystem
        with pytest.raises(CatalogError, match="the disk holding it is full"):
            Catalog(path=small / "catalog.sqlite")
    # /proc reports nothing free too, being of size 0: not "full", but not writable
    with pytest.raises(CatalogError, match="check that its folder is writable") as proc:
        Catalog(path=Path("/proc/catalog.sqlite"))
    assert "full" not in str(proc.value)


def test_a_vector_index_saved_on_a_full_disk_leaves_nothing(tmp_path: Path) -> None:
    """Saving the index on a full disk was faiss' RuntimeError (a traceback, from `ingest`
    and from a query that synced the index), and left its temporary file, which ate the
    space a retry needed and which gc kept. A real 64 KiB filesystem."""
    import numpy as np

    index = VectorIndex(64)
    index.add([uuid.uuid4().hex for _ in range(100)], np.ones((100, 64), dtype=np.float32))
    with tmpfs(tmp_path / "small", "64k") as small:
        with suppress(OSError), (small / "filler").open("wb") as filler:
            while True:
                filler.write(bytes(1 << 12))
                filler.flush()
        with pytest.raises(StoreFullError, match="disk full while saving the vector index"):
            index.save(small / "index.faiss", small / "index.ids")
        assert sorted(p.name for p in small.iterdir()) == ["filler"]


def test_retrieval_goes_on_when_the_vector_index_cannot_be_saved(
    tmp_path: Path, tiny32, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index is a cache of the catalog: a document is still ingested and retrieved when
    saving it fails (faiss' own error on a full disk, as `write_index` says it), and no
    temporary file is left."""
    import faiss

    def full(index: object, path: str) -> None:
        Path(path).write_bytes(b"half")
        raise RuntimeError(f"Error: write error in {path}: 4 != 76800 (No space left on device)")

    monkeypatch.setattr(faiss, "write_index", full)
    engine = _engine(TieredStore(tmp_path / "kv"), tiny32)
    engine.ingest_document("a.md", DOCS)
    assert engine.retrieve("When was the lighthouse built?", 1)[0].source == "a.md"
    assert "disk full while saving the vector index" in caplog.text
    assert "retrieval goes on from the index in memory" in caplog.text
    assert list(engine.store.root.glob("index.*")) == []
    engine.store.close()


def test_gc_removes_the_index_temporaries_of_dead_writers(tmp_path: Path) -> None:
    """A save cut by a kill left `index.faiss.<pid>-<thread>.tmp`, which gc never removed."""
    store = TieredStore(tmp_path / "kv")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    names = [
        f"index.faiss.{dead}-1.tmp",
        f"index.ids.{dead}-1.tmp",
        f"index.faiss.{os.getpid()}-1.tmp",
    ]
    for name in names:
        (store.root / name).write_bytes(b"half")
        os.utime(store.root / name, (time.time() - 3600,) * 2)
    (store.root / f"index.faiss.{dead}-2.tmp").write_bytes(b"new")  # younger than the limit
    kept = ["index.notes.tmp", f"index.faiss.{dead}-3.tmp"]  # not the index's; a folder
    (store.root / kept[0]).write_bytes(b"someone's")
    (store.root / kept[1]).mkdir()
    huge = "index.ids.99999999999999999999-1.tmp"  # past any PID (os.kill overflowed)
    for name in [*kept, huge]:
        (store.root / name).touch()
        os.utime(store.root / name, (time.time() - 3600,) * 2)
    assert store.gc().temporaries == 3
    left = sorted(p.name for p in store.root.glob("index.*.tmp"))
    assert left == sorted([f"index.faiss.{os.getpid()}-1.tmp", f"index.faiss.{dead}-2.tmp", *kept])
    store.close()


def test_a_store_answers_when_its_catalog_disk_is_too_full_to_count_uses(
    tmp_path: Path, tiny32, caplog: pytest.LogCaptureFixture
) -> None:
    """Counting a use (LRU time, LFU count, tier hits) is a catalog write: on a full disk every
    answer failed with "the catalog's disk is full ... run gc", and gc freed nothing. Cold
    chunks (read from disk, streamed by layer or whole) and hot ones alike."""
    ids = _make_store(tmp_path / "kv", tiny32)

    def full(*_: object) -> None:
        raise StoreFullError("the catalog's disk is full (sqlite); nothing was recorded")

    for stream_reads in (True, False):
        store = TieredStore(tmp_path / "kv", create=False)
        store.stream_reads = stream_reads
        store.catalog.touch = full  # type: ignore[method-assign]
        store.catalog.count = full  # type: ignore[method-assign]
        engine = _engine(store, tiny32)
        for _ in ("cold", "hot"):
            assert engine.generate("When?", ids).token_ids
        store.close()
    assert "this use of 3 chunks is not counted" in caplog.text
    assert "counter hits:disk not updated" in caplog.text


def test_a_blobs_folder_deleted_under_a_running_store_is_made_again(tmp_path: Path, tiny32) -> None:
    """Every write failed ("cannot write chunk ... check the disk") until a restart; the store
    folder itself is never made again (a disk unmounted there)."""
    import shutil

    store = TieredStore(tmp_path / "kv")
    engine = _engine(store, tiny32)
    engine.generate_context_cache(DOCS[:1])
    shutil.rmtree(store.root / "blobs")
    (fresh,) = engine.generate_context_cache(["A chunk never stored before."])
    assert store.durable.path(fresh).exists()  # type: ignore[attr-defined]
    tier = DiskTier(tmp_path / "gone" / "blobs")
    shutil.rmtree(tmp_path / "gone")
    with pytest.raises(StoreError, match="cannot write chunk"):
        tier.put(fresh, b"x")
    assert not (tmp_path / "gone").exists()
    store.close()


def test_verify_repair_on_a_full_disk_checks_everything_and_says_why_it_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --repair` on a store whose disk is full stopped at the first repair with the
    error alone. It now checks every blob, reports the count, and says repairing stopped for a
    full disk; once space is freed the same command repairs them. A real 8 MiB filesystem."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The Orrin Vale ferry leaves at 7:40 every morning.")
    (docs / "b.md").write_text("Brindle Hill has a stone tower of 31 meters.")
    with tmpfs(tmp_path / "small", "8m") as small:
        store = ["--store", str(small / "kv"), "--model", "random:tiny"]
        assert main(["ingest", str(docs), *store]) == 0
        # the store stays open meanwhile, as a server on it keeps it: SQLite's WAL files exist,
        # so the catalog opens on the full disk (opened with no process on it, it must create
        # them, which a full disk refuses: then a catalog error, said as such)
        opened = TieredStore(small / "kv", create=False)
        ids = sorted(opened.catalog.documented_ids())
        for cache_id in ids:
            opened.durable.path(cache_id).unlink()  # type: ignore[attr-defined]
        with suppress(OSError), (small / "filler").open("wb") as filler:
            while True:
                filler.write(bytes(1 << 16))
                filler.flush()
        capsys.readouterr()
        assert main(["verify", "--repair", *store]) == 1
        out = " ".join(capsys.readouterr().out.split())
        assert f"{len(ids)} missing, 0 repaired" in out, out
        assert "repairing stopped when the store filled up" in out and "disk is full" in out
        (small / "filler").unlink()
        assert main(["verify", "--repair", *store]) == 0
        assert f"{len(ids)} repaired" in " ".join(capsys.readouterr().out.split())
        assert main(["verify", *store]) == 0
        opened.close()


def test_opening_a_missing_catalog_to_read_is_not_found(target: Target, tmp_path: Path) -> None:
    if target.kind == "sqlite":
        with pytest.raises(StoreNotFoundError, match="no catalog at"):
            Catalog(path=tmp_path / "nothing.sqlite", create=False)
        assert not (tmp_path / "nothing.sqlite").exists()
    else:
        with pytest.raises(StoreNotFoundError, match="no catalog in"):
            Catalog(target.url, schema=target.schema, create=False)


# ----------------------------------------------------------------------------- item 6: damage


def _documented_store(root: Path, tiny32) -> tuple[TieredStore, RagKVCache]:
    store = TieredStore(root)
    engine = _engine(store, tiny32)
    engine.ingest_document("harbor.md", DOCS)
    engine.ingest_document("ferry.md", ["The ferry leaves at dawn.", "Tickets cost four marks."])
    return store, engine


def test_a_store_knows_it_exists_and_which_catalog_is_its(tmp_path: Path, tiny32) -> None:
    ids = _make_store(tmp_path / "s", tiny32)
    marker = read_marker(tmp_path / "s")
    store = TieredStore(tmp_path / "s", create=False)
    assert marker == StoreMarker(FORMAT_VERSION, store.catalog.store_id, store.catalog.url)
    assert store.contains(ids[0])
    # readable by the other users the store's other files are (mkstemp made it 0600)
    assert (tmp_path / "s" / "store.json").stat().st_mode & 0o777 == 0o644
    store.close()


@pytest.mark.parametrize("damage", ["deleted", "zero-length"])
def test_a_lost_sqlite_catalog_is_an_error_never_an_empty_store(
    damage: str, tmp_path: Path, tiny32, capsys
) -> None:
    root = tmp_path / "s"
    _make_store(root, tiny32)
    blobs = sorted(DiskTier(root / "blobs").ids())
    catalog = root / "catalog.sqlite"
    catalog.unlink()
    for extra in root.glob("catalog.sqlite-*"):  # the WAL and its index
        extra.unlink()
    if damage == "zero-length":
        catalog.touch()
    for create in (True, False):
        with pytest.raises(StoreDamagedError, match="has lost its catalog"):
            TieredStore(root, create=create)
    assert main(["gc", "--store", str(root)]) == 1
    one_error_line(capsys, "has lost its catalog")
    (root / "store.json").unlink()  # a store from before markers: its blobs still tell
    with pytest.raises(StoreDamagedError, match="has lost its catalog"):
        TieredStore(root)
    assert sorted(DiskTier(root / "blobs").ids()) == blobs  # nothing deleted


@pytest.mark.parametrize("target", ["postgresql"], indirect=True)
def test_a_store_whose_catalog_is_a_database_names_it_when_the_url_is_missing_or_wrong(
    target: Target, tmp_path: Path, capsys
) -> None:
    """Left without --catalog-url, or given another database's, a store kept in PostgreSQL
    said it "has lost its catalog" (with the intact catalog named as the empty one, for a
    wrong URL): nothing is lost, the URL is what is missing."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    assert target.url is not None
    root = tmp_path / "s"
    right = f"{target.url}?options=-csearch_path%3D{target.schema}"
    TieredStore(root, catalog_url=right).close()
    with pytest.raises(StoreNotFoundError, match="keeps its catalog at .*--catalog-url.*password"):
        TieredStore(root)
    assert main(["stats", "--store", str(root)]) == 1
    one_error_line(capsys, "not in its folder: give that --catalog-url")
    empty = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(target.url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{empty}"')
    try:
        wrong = f"{target.url}?options=-csearch_path%3D{empty}"
        with pytest.raises(StoreNotFoundError, match="URL given .* holds no store; .* made with"):
            TieredStore(root, catalog_url=wrong)
        TieredStore(root, catalog_url=right).close()  # the right catalog still opens it
        with admin.begin() as conn:  # and if that one is emptied, the store is damaged
            conn.exec_driver_sql(f'DROP SCHEMA "{target.schema}" CASCADE')
            conn.exec_driver_sql(f'CREATE SCHEMA "{target.schema}"')
        with pytest.raises(StoreDamagedError, match="has lost its catalog"):
            TieredStore(root, catalog_url=right)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{empty}" CASCADE')
        admin.dispose()


def test_a_store_given_the_wrong_sqlite_catalog_says_which_it_was_made_with(
    tmp_path: Path, capsys
) -> None:
    """Given another SQLite file's URL, a store made an empty file there and said it "has lost
    its catalog" (its own, intact in its folder); one whose catalog is an SQLite file
    elsewhere, opened without the URL, said the same."""
    root, other = tmp_path / "s", tmp_path / "other.sqlite"
    TieredStore(root).close()
    with pytest.raises(StoreNotFoundError, match="made with the catalog in its folder: open it wi"):
        TieredStore(root, catalog_url=f"sqlite:///{other}")
    assert not other.exists()  # no empty catalog made
    assert main(["stats", "--store", str(root), "--catalog-url", f"sqlite:///{other}"]) == 1
    one_error_line(capsys, "open it without --catalog-url")
    TieredStore(root, catalog_url=f"sqlite:///{root / 'catalog.sqlite'}").close()  # its own
    apart, kept = tmp_path / "apart", tmp_path / "kept.sqlite"
    TieredStore(apart, catalog_url=f"sqlite:///{kept}").close()
    with pytest.raises(StoreNotFoundError, match=f"keeps its catalog at .*{kept.name}, not in"):
        TieredStore(apart)
    with pytest.raises(StoreNotFoundError, match=f"made with the catalog at .*{kept.name}"):
        TieredStore(apart, catalog_url=f"sqlite:///{other}")
    with pytest.raises(StoreNotFoundError, match="no catalog at .*other.sqlite"):
        TieredStore(tmp_path / "new", catalog_url=f"sqlite:///{other}", create=False)
    assert not other.exists() and not (tmp_path / "new").exists()


def test_a_catalog_file_of_other_bytes_says_it_is_damaged(tmp_path: Path, capsys) -> None:
    """SQLite's "file is not a database" came with "check that its folder is writable"."""
    root = tmp_path / "s"
    TieredStore(root).close()
    (root / "catalog.sqlite").write_bytes(b"not a database at all " * 200)
    assert main(["stats", "--store", str(root)]) == 1
    line = one_error_line(capsys, "file is not a database", "damaged or not a catalog")
    assert "writable" not in line


def test_a_folder_with_another_stores_catalog_is_refused(target: Target, tmp_path: Path) -> None:
    TieredStore(tmp_path / "a").close()
    with pytest.raises(StoreDamagedError, match="belongs to store"):
        TieredStore(tmp_path / "a", catalog=target.open())


def test_gc_refuses_when_the_catalog_and_the_blobs_disagree_wholesale(
    tmp_path: Path, tiny32, capsys
) -> None:
    """A catalog restored from an old backup lists 2 of 8 chunks: the 6 others are not
    garbage; gc deletes them only when forced."""
    root = tmp_path / "s"
    store = TieredStore(root)
    engine = _engine(store, tiny32)
    engine.generate_context_cache(DOCS[:1])
    store.close()
    backup = (root / "catalog.sqlite").read_bytes()
    store = TieredStore(root)
    _engine(store, tiny32).generate_context_cache([f"later text {i}" for i in range(6)])
    store.close()
    for extra in root.glob("catalog.sqlite-*"):
        extra.unlink()
    (root / "catalog.sqlite").write_bytes(backup)
    assert main(["gc", "--store", str(root)]) == 1
    one_error_line(capsys, "gc refused: 6 blobs are not in the catalog")
    assert len(list(DiskTier(root / "blobs").ids())) == 8
    assert main(["gc", "--store", str(root), "--force"]) == 0
    assert "6 orphan blobs" in capsys.readouterr().out
    assert len(list(DiskTier(root / "blobs").ids())) == 2


def test_a_folder_where_a_blob_belongs_and_a_bad_row_do_not_crash_verify_or_gc(
    target: Target, tmp_path: Path, tiny32
) -> None:
    store = TieredStore(tmp_path / "s", catalog=target.open(), reencode=reencoder(tiny32))
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    blob = store.durable.path(ids[0])  # type: ignore[attr-defined]
    blob.unlink()
    (blob / "inside").mkdir(parents=True)
    with store.catalog.engine.begin() as conn:  # a damaged value in a row
        conn.execute(
            sql_text("UPDATE chunks SET token_ids = 'not json' WHERE cache_id = :c"),
            {"c": ids[1]},
        )
    for tier in store.hot:
        for cid in ids:
            tier.remove(cid)
    report = store.verify(repair=False)
    assert report.missing == [ids[0]] and report.unreadable == [ids[1]]
    assert store.gc(pending_after_s=0).orphan_blobs == 0
    report = store.verify(repair=True)
    assert report.repaired == 1 and report.unreadable == [ids[1]]
    assert store.catalog.chunk_ids() == {engine.prefix_id, ids[0]}
    assert blob.is_file() and store.verify(repair=False) == VerifyReport(2, [], [], 0)
    assert engine.generate("When?", ids[:1]).token_ids
    store.close()


def test_damaged_encode_settings_are_an_unreadable_row_and_huge_ids_a_short_error(
    tmp_path: Path, tiny32
) -> None:
    """`verify` named rows with damaged token IDs but crashed on damaged encode settings (read
    only with the blob); an unknown ID of a megabyte was quoted whole in its error."""
    store = TieredStore(tmp_path / "s", reencode=reencoder(tiny32))
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    with store.catalog.engine.begin() as conn:
        conn.execute(
            sql_text("UPDATE chunks SET encode_settings = '{bad' WHERE cache_id = :c"),
            {"c": ids[0]},
        )
    for tier in store.hot:
        tier.remove(ids[0])
    with pytest.raises(StoreDamagedError, match="verify --repair"):  # was a raw ValueError
        store.get(ids[:1])
    assert store.verify(repair=False).unreadable == [ids[0]]
    assert store.verify(repair=True).unreadable == [ids[0]]  # dropped: its document re-ingests
    assert (
        engine.generate_context_cache(DOCS) == ids and store.verify(repair=False).unreadable == []
    )
    with pytest.raises(UnknownCacheIdError) as unknown:
        store.get(["A" * 10**6])
    assert len(str(unknown.value)) < 300
    [kv] = encode_chunks(tiny32, random_chunks([4], seed=5))
    for ttl in (0.0, -1.0, math.nan, math.inf, 1e12, True, "5"):  # raw errors, born expired
        with pytest.raises(ConfigError, match="ttl_s must be > 0"):
            store.put(kv, "t", ttl_s=ttl)
    assert store.catalog.chunk(kv.cache_id) is None
    store.close()


def test_a_fifo_or_a_symlink_loop_where_a_blob_belongs_is_damage_not_a_hang(
    tmp_path: Path, tiny32
) -> None:
    """Opening a FIFO blocks until a writer comes: a blob's place holding one hung every read
    and `verify`. Both are lost blobs: found, re-encoded, replaced by files."""
    store = TieredStore(tmp_path / "s", reencode=reencoder(tiny32))
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    fifo, loop = (store.durable.path(cid) for cid in ids)  # type: ignore[attr-defined]
    fifo.unlink()
    os.mkfifo(fifo)
    loop.unlink()
    loop.symlink_to(loop.name)  # a link to itself: ELOOP
    for tier in store.hot:
        for cid in ids:
            tier.remove(cid)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a blob read hung"))
    signal.alarm(60)
    try:
        assert store.verify(repair=False).missing == sorted(ids)
        assert engine.generate("When?", ids).token_ids  # read through the streamed fetch
        assert fifo.is_file() and loop.is_file() and not loop.is_symlink()
        assert store.verify(repair=False) == VerifyReport(3, [], [], 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    store.close()


def test_a_blob_replaced_by_a_huge_file_is_not_read_before_it_is_found_corrupt(
    tmp_path: Path, tiny32
) -> None:
    """A blob's place holding a link to a 6 GiB file was read whole (6 GiB allocated) before
    its checksum failed. Its size disagrees with the catalog's: damage, found without reading,
    re-encoded, by `get`, the streamed fetch and `verify` alike."""
    import resource

    store = TieredStore(tmp_path / "s", reencode=reencoder(tiny32))
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    expected = engine.generate("When?", ids).token_ids
    huge = tmp_path / "huge"
    with huge.open("wb") as f:
        f.truncate(6 * 2**30)  # sparse: costs no disk
    paths = [store.durable.path(cid) for cid in ids]  # type: ignore[attr-defined]

    def replace_blobs() -> None:
        for path in paths:
            path.unlink()
            path.symlink_to(huge)
        for tier in store.hot:
            for cid in ids:
                tier.remove(cid)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    replace_blobs()
    assert store.verify(repair=False).corrupt == sorted(ids)
    assert [kv.cache_id for kv in store.get(ids)] == ids  # re-encoded
    replace_blobs()
    assert engine.generate("When?", ids).token_ids == expected  # streamed, then re-encoded
    assert all(p.is_file() and not p.is_symlink() for p in paths)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20  # < 1 GiB more
    assert store.verify(repair=False) == VerifyReport(3, [], [], 0)
    store.close()


def test_a_disk_error_reading_or_writing_a_blob_is_damage_or_a_clear_error(
    tmp_path: Path, tiny32, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO while reading a blob escaped raw; it is damage, re-encoded like a corrupt blob.
    An EIO while writing one is a StoreError that names the chunk, the folder and the cause
    (nothing stored), where it was a raw OSError. Faults injected where the disk answers."""
    import errno
    import io

    import rag_kvcache.storage.disk as disk

    store = TieredStore(tmp_path / "s", reencode=reencoder(tiny32))
    engine = _engine(store, tiny32)
    ids = engine.generate_context_cache(DOCS)
    for tier in store.hot:
        for cid in ids:
            tier.remove(cid)

    class FailingFile(io.FileIO):
        def readinto(self, buffer):  # type: ignore[no-untyped-def,override]
            raise OSError(errno.EIO, "Input/output error")

    def failing_open(fd: int, mode: str, buffering: int) -> io.FileIO:
        return FailingFile(fd, mode)

    with monkeypatch.context() as patch:
        patch.setattr(disk, "open", failing_open, raising=False)
        corrupt = store.verify(repair=False).corrupt  # every read fails: the system's too
        assert len(corrupt) == 3 and set(ids) <= set(corrupt)
        assert [kv.cache_id for kv in store.get(ids)] == ids  # re-encoded, and written
        assert store.catalog.stats().counters["reencoded:corrupt"] == 2
    assert store.verify(repair=False) == VerifyReport(3, [], [], 0)

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    kv = encode_chunks(tiny32, random_chunks([6], seed=9))[0]
    with monkeypatch.context() as patch:
        patch.setattr(disk.os, "fsync", failing_fsync)
        with pytest.raises(StoreError, match=r"cannot write chunk .* Input/output error"):
            store.put(kv, "w")
    assert store.catalog.chunk(kv.cache_id) is None  # nothing half-recorded
    assert not list(store.durable.root.glob("*/.tmp-*"))  # type: ignore[attr-defined]
    store.close()


def test_gc_clears_damage_named_like_a_temporary_without_hanging(tmp_path: Path) -> None:
    """No writer makes a FIFO, a folder or a symlink loop: gc removes them as damage, where
    it hung on the FIFO's open or crashed on the others."""
    store = TieredStore(tmp_path / "s")
    folder = store.durable.root / "4b"  # type: ignore[attr-defined]
    folder.mkdir(parents=True, exist_ok=True)
    fifo, loop, dir_ = (folder / f".tmp-999999-{kind}" for kind in "fld")
    os.mkfifo(fifo)
    loop.symlink_to(loop.name)
    (dir_ / "inside").mkdir(parents=True)
    old = time.time() - 7200
    for path in (fifo, loop, dir_):
        os.utime(path, (old, old), follow_symlinks=False)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("gc hung"))
    signal.alarm(60)
    try:
        assert store.gc(pending_after_s=600).temporaries == 3
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert list(folder.iterdir()) == []
    store.close()


def test_redis_urls_are_shown_without_passwords() -> None:
    from rag_kvcache.storage.redis_tier import without_password

    for url, shown in [
        ("redis://:pw@h:6379/3", "redis://:***@h:6379/3"),
        ("redis://bob:pw@h:6379/3", "redis://bob:***@h:6379/3"),
        (
            "redis://h:6379/3?password=pw&socket_timeout=3",
            "redis://h:6379/3?password=***&socket_timeout=3",
        ),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ]:
        assert without_password(url) == shown


def test_an_index_behind_another_processs_ingest_is_not_damage(
    tmp_path: Path, tiny32, capsys
) -> None:
    """A replica's folder keeps its own copy of the index, which falls behind when another
    folder's process ingests into the shared catalog; any retrieval here syncs it. `verify`
    called that damage (exit 1, "verify --repair rebuilds it"): a health check on it alarmed
    after every ingest."""
    from rag_kvcache.tools.cli.store import index_lag

    root = tmp_path / "s"
    store, engine = _documented_store(root, tiny32)
    ids = engine.generate_context_cache(["The Grey Gull ferry leaves at 06:40 on Tuesdays."])
    store.catalog.set_document("gull.md", "f" * 64, ids)  # as another folder's ingest does
    assert index_problem(store) is None and index_lag(store) == (1, 0)
    store.close()
    assert main(["verify", "--store", str(root)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 chunks to add and 0 to drop" in out and "not damage" in out
    assert main(["verify", "--store", str(root), "--repair"]) == 0
    assert "brought up to date" in " ".join(capsys.readouterr().out.split())
    store = TieredStore(root)
    assert index_lag(store) == (0, 0) and index_problem(store) is None
    store.close()
    for name in ("index.faiss", "index.ids", "index.faiss.sha256"):  # a new replica's folder:
        (root / name).unlink()  # none saved yet
    assert main(["verify", "--store", str(root)]) == 0
    assert " chunks to add and 0 to drop" in " ".join(capsys.readouterr().out.split())


def test_a_tampered_or_unreadable_vector_index_is_found_and_rebuilt(
    tmp_path: Path, tiny32, capsys
) -> None:
    import faiss
    import numpy as np

    root = tmp_path / "s"
    store, engine = _documented_store(root, tiny32)
    want = engine.retrieve("When was the lighthouse built?", 1)[0].cache_id
    assert index_problem(store) is None
    index = faiss.read_index(str(root / "index.faiss"))
    ids = (root / "index.ids").read_text().split()
    keys = np.array([int(c[:15], 16) for c in ids], dtype=np.int64)
    vectors = np.stack([index.reconstruct(int(k)) for k in keys])
    vectors[0] = -vectors[0]  # one vector flipped: a quiet, wrong retrieval
    index.remove_ids(keys)
    index.add_with_ids(vectors, keys)
    faiss.write_index(index, str(root / "index.faiss"))
    assert "do not match their checksums" in index_problem(store)  # type: ignore[operator]
    rebuild_index(store)
    (root / "index.faiss.sha256").unlink()  # as a version before checksums saved it
    assert index_problem(store) is None  # (it was "do not match their checksums")
    index.remove_ids(keys)
    index.add_with_ids(vectors, keys)
    faiss.write_index(index, str(root / "index.faiss"))
    assert index_problem(store) == "1 vectors differ from their chunk's embedding"
    loaded = VectorIndex.load(root / "index.faiss", root / "index.ids", Embedder().dim)
    assert len(loaded) == 0  # never used: the corpus rebuilds it from the catalog
    sums = root / "index.faiss.sha256"  # checksums rewritten to match: the vectors still tell
    sums.write_text(json.dumps(file_checksums(root / "index.faiss", root / "index.ids")))
    assert index_problem(store) == "1 vectors differ from their chunk's embedding"
    store.close()
    assert main(["verify", "--store", str(root)]) == 1
    assert "1 vectors differ" in capsys.readouterr().out
    store = TieredStore(root)
    assert rebuild_index(store) == 4 and index_problem(store) is None
    with open(root / "index.ids", "a") as ids_file:
        ids_file.write("not-a-cache-id\n")  # one bad line
    assert index_problem(store).startswith("unreadable")  # type: ignore[union-attr]
    # queries go on meanwhile: the unreadable index is rebuilt from the catalog, not fatal
    assert _engine(store, tiny32).retrieve("When was the lighthouse built?", 1)[0].cache_id == want
    rebuild_index(store)
    assert _engine(store, tiny32).retrieve("When was the lighthouse built?", 1)[0].cache_id == want
    store.close()


# ----------------------------------------------------------------------------- item 3: gc


WRITER = """
import sys
from pathlib import Path
from rag_kvcache.storage.disk import DiskTier
tier, data = DiskTier(Path(sys.argv[1])), bytes(16 << 20)
while True:  # one blob, written over and over (an orphan: gc may delete it, harmlessly)
    tier.put("0" * 32, data)
"""


def test_gc_leaves_a_live_writers_temporary_file_alone(tmp_path: Path) -> None:
    """A writer frozen mid-write (SIGSTOP: alive, just slow) keeps its temporary file through
    gc, even gc(pending_after_s=0), and finishes; a killed writer's is removed."""
    store = TieredStore(tmp_path / "s")
    blobs = tmp_path / "s" / "blobs"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(blobs)], stderr=subprocess.PIPE)
    try:
        # catch it between creating and renaming a temporary; by a deadline, not a count of
        # tries: on a loaded machine the writer's start (imports) alone can take many seconds
        deadline, held = time.monotonic() + 180, []
        while not held and time.monotonic() < deadline and child.poll() is None:
            child.send_signal(signal.SIGSTOP)
            held = list(blobs.glob("*/.tmp-*"))
            if not held:
                child.send_signal(signal.SIGCONT)
                time.sleep(0.002)
        assert held, f"never caught the writer mid-write (exit {child.poll()})"
        assert store.gc(pending_after_s=0).temporaries == 0
        assert all(t.exists() for t in held)
        child.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        assert child.poll() is None, child.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
    finally:
        child.kill()
        child.wait()
    assert store.gc(pending_after_s=0).temporaries <= 1  # the killed writer's, if any
    assert list(blobs.glob("*/.tmp-*")) == []
    store.close()


def test_a_dead_writers_recent_temporary_waits_for_the_grace_period(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "blobs")
    (tmp_path / "blobs" / "ab").mkdir()
    dead = tmp_path / "blobs" / "ab" / ".tmp-dead"
    dead.write_bytes(b"half")
    assert tier.remove_temporaries(older_than_s=600) == 0 and dead.exists()
    old = time.time() - 601
    os.utime(dead, (old, old))
    assert tier.remove_temporaries(older_than_s=600) == 1 and not dead.exists()


# ----------------------------------------------------------------------------- item 5: orphans

REPLACER = """
import os, signal, sys
from pathlib import Path
import torch
from helpers import TINY_VOCAB, build_tiny
from tiny_tokenizer import build_tokenizer
from rag_kvcache import EngineConfig, RagKVCache
from rag_kvcache.storage.store import TieredStore

store = TieredStore(Path(sys.argv[1]))
lm = build_tiny(torch.float32, tokenizer=build_tokenizer(TINY_VOCAB))
engine = RagKVCache(EngineConfig(), lm=lm, store=store)
engine.ingest_document("a.md", ["one", "two", "three"])
print(" ".join(engine.corpus.catalog.document_chunks("a.md")), flush=True)
set_document = store.catalog.set_document

def set_document_then_die(*args, **kwargs):  # the kill lands right after the commit
    set_document(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

store.catalog.set_document = set_document_then_die
engine.ingest_document("a.md", ["one", "two, changed", "three, changed"])
"""


def test_a_kill_right_after_a_document_is_replaced_leaks_no_chunk(tmp_path: Path) -> None:
    root = tmp_path / "s"
    done = subprocess.run(
        [sys.executable, "-c", REPLACER, str(root)],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    old = done.stdout.split()
    store = TieredStore(root)
    listed = store.catalog.document_chunks("a.md")
    assert listed[0] == old[0] and set(old[1:]).isdisjoint(listed)
    rows = store.catalog.chunk_ids()
    assert set(old[1:]).isdisjoint(rows)  # the dropped chunks' rows went with the commit
    report = store.verify(repair=False)
    assert sorted(report.orphans) == sorted(old[1:])  # their blobs are found...
    assert report.corrupt == report.missing == report.unreadable == []
    assert store.gc(pending_after_s=0).orphan_blobs == 2  # ...and dropped
    assert set(store.durable.ids()) == rows and store.verify(repair=False).orphans == []
    store.close()


def test_verify_repair_drops_orphan_blobs(tmp_path: Path, tiny32) -> None:
    store = TieredStore(tmp_path / "s")
    ids = _engine(store, tiny32).generate_context_cache(DOCS)
    store.catalog.remove_chunk(ids[0])  # a row gone, its blob left behind
    assert store.verify(repair=True).orphans == [ids[0]]
    assert not store.durable.contains(ids[0]) and store.durable.contains(ids[1])
    store.close()


def test_gc_counts_the_orphan_blobs_it_removed_and_no_misplaced_file(
    tmp_path: Path, tiny32
) -> None:
    """A blob-named file under another ID's folder was listed as an orphan that gc "removed"
    on every run (its removal looked where that ID's blob belongs, found nothing, and was
    counted anyway); no read reaches such a file, so it is no blob. A real orphan is removed
    and counted once."""
    store = TieredStore(tmp_path / "s")
    ids = _engine(store, tiny32).generate_context_cache(DOCS)
    root = store.durable.root  # type: ignore[attr-defined]
    stray = root / ("cf" if ids[0][:2] != "cf" else "ab") / f"{ids[0]}.safetensors"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"junk")
    listed = list(store.durable.ids())
    assert sorted(listed) == sorted(store.catalog.chunk_ids()) and set(ids) <= set(listed)
    store.catalog.remove_chunk(ids[1])  # a row gone, its blob left behind
    assert store.gc().orphan_blobs == 1
    assert store.gc().orphan_blobs == 0 and not store.durable.contains(ids[1])
    assert stray.read_bytes() == b"junk"  # not the store's to read or remove
    store.close()


def test_writers_saving_the_vector_index_into_one_folder_at_once_never_collide(
    tmp_path: Path,
) -> None:
    """Replicas sharing a folder save the index at the same moment: each writes its own
    temporaries (fixed names made one writer's rename fail), and what is left loads whole."""
    import threading

    import numpy as np

    vectors = np.eye(8, dtype=np.float32)
    indexes = []
    for n in (3, 5):
        index = VectorIndex(8)
        index.add([uuid.uuid4().hex for _ in range(n)], vectors[:n])
        indexes.append(index)
    failures: list[BaseException] = []

    def save_often(index: VectorIndex) -> None:
        try:
            for _ in range(60):
                index.save(tmp_path / "index.faiss", tmp_path / "index.ids")
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            failures.append(error)

    writers = [threading.Thread(target=save_often, args=(i,)) for i in indexes]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert failures == []
    loaded = VectorIndex.load(tmp_path / "index.faiss", tmp_path / "index.ids", 8)
    # the last complete save wins, or a mix the checksums catch (then empty: rebuilt)
    assert len(loaded.cache_ids()) in {0, 3, 5}
    assert not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------------------- workers racing


def _two_workers(target: Target, root: Path, lm) -> tuple[RagKVCache, RagKVCache]:
    """Two engines on one store, each with its own catalog connection: two processes."""
    a = _engine(TieredStore(root, catalog=target.open()), lm)
    b = _engine(TieredStore(root, catalog=target.open()), lm)
    return a, b


def test_a_shared_chunk_another_worker_drops_meanwhile_is_cached_again(
    target: Target, tmp_path: Path, tiny32, monkeypatch
) -> None:
    """Worker B found a chunk stored (worker A's document lists it), A then removed its
    document, dropping the chunk as no document's, and B's ingest failed ("a chunk it lists is
    not in the catalog (begin_chunk first)"): the document was not recorded. B now caches the
    chunk again and records its document."""
    shared, ours = "The tide bell rings at noon.", "Only worker B has this."
    a, b = _two_workers(target, tmp_path / "s", tiny32)
    a.ingest_document("a.md", [shared, "Only worker A has this."])
    real = b.corpus.set_document
    calls = []

    def a_removes_first(*args, **kwargs):  # A's removal lands between B's two steps
        calls.append(args[0])
        if len(calls) == 1:
            assert a.remove_document("a.md") == 2
        return real(*args, **kwargs)

    monkeypatch.setattr(b.corpus, "set_document", a_removes_first)
    told: list[int] = []
    done = b.ingest_document("b.md", [shared, ours], on_encoded=told.append)
    assert calls == ["b.md", "b.md"] and done.encoded == 2  # ours, then the shared one again
    assert sum(told) == 2  # progress: each chunk once (the second try's were told again)
    assert b.store.catalog.document_chunks("b.md") == list(done.cache_ids)
    assert all(a.store.contains(cid) for cid in done.cache_ids)
    assert b.generate("When does the bell ring?", list(done.cache_ids)).text is not None
    with pytest.raises(CatalogError, match="never begun") as refused:  # no one began it:
        b.store.catalog.set_document("c.md", "0" * 64, ["f" * 32])  # the same error names it
    assert refused.value.cache_ids == ["f" * 32]  # type: ignore[attr-defined]
    for engine in (a, b):
        engine.store.close()


def test_an_ingested_file_whose_shared_chunk_another_worker_drops_is_read_again(
    tmp_path: Path, tiny32, monkeypatch
) -> None:
    """The same race for `rag-kvcache ingest`'s files (`run_ingest`): the file is read again."""
    from rag_kvcache.ingest import plan_ingest, run_ingest

    shared = "The tide bell rings at noon."
    a, b = _two_workers(Target("sqlite", None, tmp_path / "c.db", None), tmp_path / "s", tiny32)
    a.ingest_document("a.md", [shared])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.md").write_text(f"{shared}\n\nOnly worker B has this.\n")
    real, calls = b.corpus.set_document, []

    def a_removes_first(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            a.remove_document("a.md")
        return real(*args, **kwargs)

    monkeypatch.setattr(b.corpus, "set_document", a_removes_first)
    plan = plan_ingest(b, [docs], lambda text: [p for p in text.split("\n\n") if p.strip()])
    [done] = run_ingest(b, plan)
    assert len(calls) == 2 and b.store.catalog.document_chunks(done.source) == list(done.cache_ids)
    assert all(b.store.contains(cid) for cid in done.cache_ids)
    for engine in (a, b):
        engine.store.close()


def test_gc_keeps_a_row_that_changed_between_its_list_and_its_delete(
    target: Target, tmp_path: Path, tiny32, monkeypatch
) -> None:
    """gc lists the pending and the expired rows, then deletes them: a writer that committed
    its row in between (with `--pending-after 0`), or a chunk whose expiry another process's
    re-ingest moved, lost its row and blob, and that writer's ingest then failed. A row is
    now deleted only if it still is what it was listed as."""
    store = TieredStore(tmp_path / "s", catalog=target.open())
    engine = _engine(store, tiny32)
    committed, lasting = engine.generate_context_cache(DOCS)
    store.catalog.set_expiry(lasting, datetime.now(UTC) + timedelta(days=1))  # moved on
    # listed as a live writer's pending row, then committed by it before the delete
    monkeypatch.setattr(store.catalog, "pending_older_than", lambda seconds: [committed])
    # listed as expired, then its expiry moved on by a re-ingest before the delete
    monkeypatch.setattr(store.catalog, "expired", lambda now=None: [lasting])
    report = store.gc(pending_after_s=0)
    assert (report.expired, report.pending, report.orphan_blobs) == (0, 0, 0)
    assert store.contains(committed) and store.contains(lasting)
    assert engine.generate("When?", [committed, lasting]).text is not None
    monkeypatch.undo()
    store.catalog.set_expiry(lasting, datetime.now(UTC) - timedelta(seconds=1))  # truly expired
    assert store.gc(pending_after_s=0).expired == 1 and not store.contains(lasting)
    store.close()


def test_verify_beside_a_worker_that_removes_chunks_finds_no_false_damage(
    tmp_path: Path, tiny32
) -> None:
    """verify lists the stored rows, then reads their blobs: chunks another worker removed
    in between (a document removed or replaced, gc) were reported missing, exit 1 (a health
    check alarmed), and `--repair` crashed with UnknownCacheIdError where a row went while
    its blob was re-encoded, leaving that blob as an orphan."""
    store, engine = _documented_store(tmp_path / "s", tiny32)
    other = _engine(TieredStore(tmp_path / "s"), tiny32)  # the other worker
    calls: list[int] = []

    def removes_everything_after_the_first() -> None:
        calls.append(1)
        if len(calls) == 1:
            other.remove_document("harbor.md")
            other.remove_document("ferry.md")

    report = store.verify(repair=False, on_checked=removes_everything_after_the_first)
    assert (report.missing, report.corrupt, report.orphans) == ([], [], [])
    assert report.checked == len(calls) > 1
    # a real loss is still found, and a row removed while it is re-encoded is skipped
    lost, kept = engine.generate_context_cache(["The gate shuts at dusk.", "Gulls nest here."])
    store.durable.remove(lost)
    assert store.verify(repair=False).missing == [lost]
    real = reencoder(tiny32)

    def removed_meanwhile(row):
        store.catalog.remove_chunk(row.cache_id)  # another worker's, during the re-encode
        return real(row)

    store.reencode = removed_meanwhile
    report = store.verify(repair=True)
    assert (report.missing, report.repaired) == ([], 0)  # gone meanwhile: not damage either
    assert store.verify(repair=False).orphans == []  # the blob written for no one: gone
    assert store.contains(kept) and not store.contains(lost)
    for s in (store, other.store):
        s.close()


def test_verify_and_stats_name_a_damaged_calibration(tmp_path: Path, tiny32, capsys) -> None:
    """`verify` called a store clean whose link calibration was damaged (every `+calibrated`
    answer failed on it), and `stats` did not show that a store holds one."""
    import torch
    from sqlalchemy import update

    from rag_kvcache.link.calibration import Calibration
    from rag_kvcache.storage.tables import LinkCalibration

    root = tmp_path / "s"
    store, engine = _documented_store(root, tiny32)
    vectors = torch.zeros(2, 64)
    engine.set_calibration(Calibration(vectors, tiny32.fingerprint, engine.doc_settings.key(), ""))
    with store.catalog._write() as conn:  # damaged behind the catalog's back
        conn.execute(update(LinkCalibration).values(data=b"\x00" * 40))
    store.close()
    capsys.readouterr()
    assert main(["stats", "--store", str(root)]) == 0
    rows = [
        " ".join(line.replace("│", " ").split()) for line in capsys.readouterr().out.splitlines()
    ]
    assert "link calibrations 1 (1 damaged)" in rows
    assert main(["verify", "--store", str(root)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"the link calibration of model {tiny32.fingerprint} (sinks=) is damaged" in out
    assert "`verify --repair` drops it, then train it again (`rag-kvcache calibrate`)" in out


def test_a_killed_writers_claim_is_waited_for_aloud_then_taken_over(
    tmp_path: Path, tiny32, monkeypatch, caplog
) -> None:
    """A writer killed between claiming a chunk and storing it left the next writer of that
    chunk waiting 30 s in silence (an ingest after a restart looked hung); it now says so."""
    import logging

    from rag_kvcache.storage import store as store_module

    [kv] = encode_chunks(tiny32, [tiny32.tokenizer.encode("The quay floods at spring tide.")])
    dead = _engine(TieredStore(tmp_path / "s"), tiny32).store  # (the model registered)
    # its writer claims the chunk, then is killed
    assert dead.catalog.begin_chunk(
        kv.cache_id, fingerprint=kv.fingerprint, text="t", token_ids=kv.token_ids,
        encode_settings=kv.settings.key(), start=kv.start, pinned=False, expires_at=None,
    )  # fmt: skip
    live = TieredStore(tmp_path / "s")
    live.takeover_s = 0.5
    monkeypatch.setattr(store_module, "WAIT_SAID_S", 0.1)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        live.put(kv, "t")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "claimed by another writer that has not stored it" in said[0]
    assert live.contains(kv.cache_id) and live.get([kv.cache_id])[0].num_tokens == kv.num_tokens
    for s in (dead, live):
        s.close()


def test_a_chunk_cached_anew_meanwhile_survives_the_removal_of_its_old_document(
    tmp_path: Path, tiny32, monkeypatch
) -> None:
    """A document removed drops its chunks' rows in one transaction, then their blobs: a
    chunk another worker cached anew in between (the retry of a document sharing it) lost
    its new row and blob to that second step."""
    shared = "The tide bell rings at noon."
    a, b = _two_workers(Target("sqlite", None, tmp_path / "c.db", None), tmp_path / "s", tiny32)
    [cid] = a.ingest_document("a.md", [shared]).cache_ids
    real = a.corpus.catalog.remove_document

    def b_caches_it_anew(source: str) -> list[str]:
        dropped = real(source)
        assert dropped == [cid] and b.generate_context_cache([shared]) == [cid]
        return dropped

    monkeypatch.setattr(a.corpus.catalog, "remove_document", b_caches_it_anew)
    a.remove_document("a.md")
    assert b.store.contains(cid) and b.store.get([cid])[0].cache_id == cid  # row and blob
    for engine in (a, b):
        engine.store.close()


def test_a_chunk_whose_other_writer_withdraws_its_claim_is_claimed_again(
    tmp_path: Path, tiny32, monkeypatch
) -> None:
    """A worker found a chunk claimed by another and waited; the other withdrew its claim (or
    its document's removal dropped the chunk) meanwhile, and the waiter then wrote a blob for
    a row no longer there: UnknownCacheIdError (seen with two workers sharing a chunk on
    PostgreSQL). It now claims the chunk again and stores it."""
    [kv] = encode_chunks(tiny32, [tiny32.tokenizer.encode("The quay floods at spring tide.")])
    other = _engine(TieredStore(tmp_path / "s"), tiny32).store
    assert other.catalog.begin_chunk(
        kv.cache_id, fingerprint=kv.fingerprint, text="t", token_ids=kv.token_ids,
        encode_settings=kv.settings.key(), start=kv.start, pinned=False, expires_at=None,
    )  # fmt: skip
    live = TieredStore(tmp_path / "s")
    real = live._wait_stored

    def withdrawn_meanwhile(cache_id: str) -> bool:
        other.catalog.remove_chunk(cache_id)  # the other writer's claim goes
        return real(cache_id)

    monkeypatch.setattr(live, "_wait_stored", withdrawn_meanwhile)
    live.put(kv, "t")
    assert live.contains(kv.cache_id) and live.get([kv.cache_id])[0].num_tokens == kv.num_tokens
    for s in (other, live):
        s.close()


def test_a_chunk_removed_each_time_it_is_claimed_fails_clearly_after_every_try(
    tmp_path: Path, tiny32, monkeypatch
) -> None:
    """Another process holds the chunk at each of our claims and removes it before we read
    its row, PUT_TRIES times over: the put gives up with ChunksGoneError naming the chunk, and
    leaves nothing of its own behind (no row, no blob, no hot copy)."""
    [kv] = encode_chunks(tiny32, [tiny32.tokenizer.encode("The quay floods at spring tide.")])
    live = TieredStore(tmp_path / "s")
    claims: list[str] = []

    def held_by_another(cache_id: str, **_: object) -> bool:
        claims.append(cache_id)
        return False  # refused: another writer claimed it

    monkeypatch.setattr(live.catalog, "begin_chunk", held_by_another)
    monkeypatch.setattr(live.catalog, "chunk", lambda cache_id: None)  # then removed it
    with pytest.raises(
        ChunksGoneError,
        match=f"chunk {kv.cache_id} was removed by another "
        f"process each of the {PUT_TRIES} times it was stored here",
    ) as caught:
        live.put(kv, "t")
    assert caught.value.cache_ids == [kv.cache_id] and claims == [kv.cache_id] * PUT_TRIES
    monkeypatch.undo()
    assert not live.contains(kv.cache_id) and live.catalog.chunk(kv.cache_id) is None
    assert not [p for p in (tmp_path / "s").rglob("*") if kv.cache_id in p.name]
    live.close()
