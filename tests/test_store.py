"""The tiered store, on SQLite and PostgreSQL catalogs: restart, corruption, eviction, gc."""

import json
import os
import random
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import Target
from helpers import random_chunks

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache, UnknownCacheIdError
from rag_kvcache.engine import reencoder
from rag_kvcache.errors import StoreError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.blob import CorruptBlobError
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.disk import DiskTier, StoreFullError
from rag_kvcache.storage.hot import MemoryTier
from rag_kvcache.storage.records import ChunkRow
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import TieredStore

DOCS = ["The lighthouse at Hallam Point was built in 1788.", "Velmora has three harbor basins."]


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["disk", "redis"])
def durable(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "disk":
        yield DiskTier(tmp_path / "blobs")
        return
    try:
        tier = RedisTier(REDIS_URL, prefix=f"rag-kvcache-test:{uuid.uuid4().hex}:")
    except StoreUnavailableError as err:
        pytest.skip(str(err))
    yield tier
    for cid in list(tier.ids()):
        tier.remove(cid)


@pytest.fixture
def store(target: Target, durable, tmp_path: Path, tiny64):
    s = TieredStore(
        tmp_path / "kv", catalog=target.open(), durable=durable, reencode=reencoder(tiny64)
    )
    yield s
    s.close()


def _engine(store, lm, tokens=6):
    return RagKVCache(
        EngineConfig(generation=GenerationConfig(max_new_tokens=tokens)), lm=lm, store=store
    )


def test_store_round_trip_is_exact_and_counted(store, tiny64) -> None:
    kvs = encode_chunks(tiny64, random_chunks([5, 9], seed=4))
    store.register_model(tiny64.fingerprint, "tiny", "float64", 3, 2, 16)
    for kv in kvs:
        store.put(kv, "text")
    for tier in store.hot:
        tier.remove(kvs[0].cache_id)  # force a read from disk
    got = store.get([k.cache_id for k in kvs])
    for a, b in zip(got, kvs, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.token_ids == b.token_ids and a.cache_id == b.cache_id
    counters = store.catalog.counters()
    assert counters[f"hits:{store.durable.name}"] == 1 and counters["hits:cpu"] == 1
    assert len(store) == 2 and store.durable.contains(kvs[0].cache_id)


def test_answers_survive_a_restart_without_reencoding(target: Target, tmp_path, tiny64) -> None:
    first = _engine(TieredStore(tmp_path / "kv", catalog=target.open()), tiny64)
    ids = first.generate_context_cache(DOCS)
    before = first.generate("When?", ids, strategy="legolink:2")
    first.store.close()  # type: ignore[attr-defined]
    reopened = _engine(TieredStore(tmp_path / "kv", catalog=target.open()), tiny64)
    encoded = []
    reopened.lm.model.register_forward_hook(lambda *a: encoded.append(1))
    after = reopened.generate("When?", ids, strategy="legolink:2")
    assert after.token_ids == before.token_ids
    assert reopened.store.catalog.counters().get("hits:disk") == 3  # prefix + 2 chunks
    # only the decode forwards ran: 1 link forward + 5 decode steps, no encoding
    assert len(encoded) == 6
    reopened.store.close()  # type: ignore[attr-defined]


def test_corrupt_or_missing_blob_is_reencoded_and_the_answer_unchanged(store, tiny64) -> None:
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS)
    before = engine.generate("When?", ids, strategy="full").token_ids
    data = bytearray(store.durable.get(ids[0]))
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    store.durable.put(ids[0], bytes(data))
    store.durable.remove(ids[1])
    for tier in store.hot:  # a new process would have nothing hot
        for cid in ids:
            tier.remove(cid)
    assert engine.generate("When?", ids, strategy="full").token_ids == before
    counters = store.catalog.counters()
    assert counters["reencoded:corrupt"] == 1 and counters["reencoded:missing"] == 1
    report = store.verify()
    assert report.corrupt == [] and report.missing == [] and report.checked == 3


def test_corrupt_blob_without_a_model_is_a_clear_error(store, tiny64) -> None:
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS[:1])
    store.reencode = None
    store.durable.put(ids[0], b"not safetensors")
    for tier in store.hot:
        tier.remove(ids[0])
    with pytest.raises(CorruptBlobError, match="no model to re-encode"):
        store.get(ids)


def test_the_reencode_hook_given_at_construction_heals_a_corrupt_blob(
    target: Target, tmp_path, tiny64
) -> None:
    """The hook a store is built with is the one called for a bad blob (with that chunk's row),
    an engine on the store keeps it, and what it returns is served and written back."""
    rebuild = reencoder(tiny64)
    asked: list[str] = []

    def hook(row: ChunkRow) -> ChunkKV:
        asked.append(row.cache_id)
        return rebuild(row)

    store = TieredStore(tmp_path / "kv", catalog=target.open(), reencode=hook)
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS[:1])
    (kv,) = store.get(ids)
    before = engine.generate("When?", ids, strategy="full").token_ids
    store.durable.put(ids[0], b"not safetensors")
    for tier in store.hot:
        tier.remove(ids[0])
    (healed,) = store.get(ids)
    assert asked == ids and store.reencode is hook
    assert torch.equal(healed.keys, kv.keys) and torch.equal(healed.values, kv.values)
    assert store.catalog.counters()["reencoded:corrupt"] == 1
    assert store.verify().corrupt == []  # the rebuilt blob replaced the bad one
    assert engine.generate("When?", ids, strategy="full").token_ids == before
    store.close()


def test_a_repair_that_cannot_write_keeps_the_chunk_and_heals_once_the_disk_can(
    target: Target, tmp_path, tiny64
) -> None:
    """A missing blob whose rewrite fails (a file where its folder belongs) is a StoreError
    naming the cause, and the chunk's row stays: it deleted the row (the chunk then unknown,
    its document silently answered without it) and showed a raw FileExistsError."""
    store = TieredStore(tmp_path / "kv", catalog=target.open(), reencode=reencoder(tiny64))
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS)
    before = engine.generate("When?", ids, strategy="full").token_ids
    folder = store.durable.path(ids[1]).parent  # type: ignore[attr-defined]
    for tier in store.hot:
        tier.remove(ids[1])
    moved = folder.rename(tmp_path / "moved")
    folder.touch()  # the blob's folder is now a file: no blob, and none can be written
    with pytest.raises(StoreError, match=f"cannot write chunk {ids[1]}"):
        engine.generate("When?", ids, strategy="full")
    row = store.catalog.chunk(ids[1])
    assert row is not None and row.state == "stored"  # kept, text and all
    folder.unlink()
    moved.rename(folder)
    store.durable.remove(ids[1])  # still lost: the next read re-encodes it
    assert engine.generate("When?", ids, strategy="full").token_ids == before
    assert store.catalog.counters()["reencoded:missing"] == 2
    assert store.verify().missing == []
    store.close()


def test_an_engine_gives_no_hook_to_a_store_built_without_one(
    target: Target, tmp_path, tiny64
) -> None:
    store = TieredStore(tmp_path / "kv", catalog=target.open())
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS[:1])
    assert store.reencode is None
    store.durable.remove(ids[0])
    for tier in store.hot:
        tier.remove(ids[0])
    with pytest.raises(CorruptBlobError, match="missing and this store has no model to re-encode"):
        engine.generate("When?", ids)
    store.close()


def test_expiry_ttl_and_gc(store, tiny64) -> None:
    engine = _engine(store, tiny64)
    ids = engine.generate_context_cache(DOCS)
    assert engine.expire_cache(ids[0])
    with pytest.raises(UnknownCacheIdError, match=ids[0]):
        engine.generate("q", ids)
    assert not store.durable.contains(ids[0])
    kv = encode_chunks(tiny64, random_chunks([4], seed=9))[0]
    store.put(kv, "short-lived", ttl_s=1e-6)
    assert not store.contains(kv.cache_id)  # already past its TTL
    orphan = encode_chunks(tiny64, random_chunks([3], seed=10))[0]
    store.durable.put(orphan.cache_id, b"left by a writer killed before its catalog commit")
    on_disk = isinstance(store.durable, DiskTier)
    if on_disk:  # a file half-written by a killed writer (Redis SETs are atomic)
        (store.durable.root / "ab").mkdir(exist_ok=True)
        dead = store.durable.root / "ab" / ".tmp-dead"
        dead.write_bytes(b"half")
        os.utime(dead, (time.time() - 3600, time.time() - 3600))  # its writer died long ago
    report = store.gc()
    assert (report.expired, report.orphan_blobs, report.temporaries) == (1, 1, int(on_disk))
    assert not store.durable.contains(orphan.cache_id) and not store.durable.contains(kv.cache_id)
    assert sorted(store.durable.ids()) == sorted([engine.prefix_id, ids[1]])


def test_unreachable_redis_is_a_clear_error() -> None:
    with pytest.raises(StoreUnavailableError, match="redis://127.0.0.1:1/0 is unreachable"):
        RedisTier("redis://127.0.0.1:1/0", prefix="rag-kvcache-test:")


def test_a_server_that_is_not_redis_is_a_clear_error() -> None:
    """An HTTP proxy on the port answers "HTTP/1.1 400": redis-py's InvalidResponse escaped."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_http() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                connection.recv(1024)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    try:
        with pytest.raises(StoreUnavailableError, match="did not answer as a Redis server"):
            RedisTier(url, prefix="rag-kvcache-test:")
    finally:
        listener.close()


def test_paths_cannot_escape_the_store(tmp_path) -> None:
    disk = DiskTier(tmp_path)
    for bad in ["../../etc/passwd", "ab/../../x", "ABCDEF0123456789", "short"]:
        with pytest.raises(ValueError, match="not a cache ID"):
            disk.path(bad)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hot_tier_budget_and_pins_hold_under_random_traffic(tiny64, policy: str) -> None:
    kvs = encode_chunks(tiny64, random_chunks([random.Random(i).randint(1, 12) for i in range(30)]))
    budget = sum(k.nbytes for k in kvs) // 3
    tier = MemoryTier("cpu", budget, policy=policy)
    pinned = {kvs[0].cache_id, kvs[1].cache_id}
    rng = random.Random(policy)
    placed_pins: set[str] = set()
    for step in range(600):
        kv = rng.choice(kvs)
        if rng.random() < 0.5:
            tier.put(kv, pinned=kv.cache_id in pinned)
            if kv.cache_id in pinned:
                placed_pins.add(kv.cache_id)
        else:
            tier.get(kv.cache_id)
        assert tier.nbytes() <= budget, step
        assert tier.nbytes() == sum(k.nbytes for k in kvs if tier.contains(k.cache_id))
        assert all(tier.contains(c) for c in placed_pins), step  # a placed pin never leaves
    assert placed_pins == pinned


def test_hot_tier_stays_exact_under_threads(tiny64) -> None:
    """The engine loop's thread and worker threads (LlamaIndex's async calls encode there)
    put and evict in one tier: its byte count and its budget hold. The interpreter switches
    threads every microsecond here, so an unlocked check-then-insert would race."""
    import threading

    kvs = encode_chunks(tiny64, random_chunks([random.Random(i).randint(1, 12) for i in range(20)]))
    budget = sum(k.nbytes for k in kvs) // 2
    tier = MemoryTier("cpu", budget)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def traffic(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(3000):
            kv = rng.choice(kvs)
            if rng.random() < 0.6:
                tier.put(kv)
            elif rng.random() < 0.5:
                tier.get(kv.cache_id)
            else:
                tier.remove(kv.cache_id)

    try:
        threads = [threading.Thread(target=traffic, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert tier.nbytes() == sum(k.nbytes for k in kvs if tier.contains(k.cache_id))
    assert tier.nbytes() <= budget


def test_lru_and_lfu_choose_different_victims(tiny64) -> None:
    a, b, c = encode_chunks(tiny64, random_chunks([4, 4, 4], seed=2))
    for policy, survivor in [("lru", a), ("lfu", b)]:
        tier = MemoryTier("cpu", 2 * a.nbytes, policy=policy)
        tier.put(a)
        tier.put(b)
        tier.get(b.cache_id)
        tier.get(b.cache_id)
        tier.get(a.cache_id)  # a: most recent; b: most frequent
        tier.put(c)
        assert tier.contains(survivor.cache_id) and tier.contains(c.cache_id)


def test_killed_writer_leaves_a_consistent_store(tmp_path) -> None:
    """A writer SIGKILLed between claiming a row and storing its blob: the row stays pending,
    is invisible to readers, and gc removes it; a later writer can store the chunk."""
    root = tmp_path / "kv"
    script = textwrap.dedent(f"""
        import os, signal
        from helpers import build_tiny, random_chunks
        import torch
        from rag_kvcache.link.encoder import encode_chunks
        from rag_kvcache.storage.store import TieredStore
        lm = build_tiny(torch.float64)
        store = TieredStore({str(root)!r})
        store.register_model(lm.fingerprint, "tiny", "float64", 3, 2, 16)
        kv = encode_chunks(lm, random_chunks([6], seed=1))[0]
        store.catalog.begin_chunk(kv.cache_id, fingerprint=kv.fingerprint, text="t",
            token_ids=kv.token_ids, encode_settings=kv.settings.key())
        print(kv.cache_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    tests_dir = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tests_dir, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, done.stderr
    cache_id = done.stdout.split()[0]
    store = TieredStore(root)
    assert not store.contains(cache_id) and len(store) == 0
    assert store.gc(pending_after_s=0).pending == 1
    assert store.catalog.chunk(cache_id) is None
    store.close()


@pytest.mark.stress
def test_four_writers_and_four_readers_at_once(target: Target, tmp_path) -> None:
    """Overlapping ingest from 4 processes while 4 others read: every chunk stored exactly
    once, every read equal to a local encoding of the same tokens."""
    root = tmp_path / "kv"
    common = {
        "root": str(root),
        "url": target.url,
        "schema": target.schema,
        "path": str(target.path) if target.path else None,
        "seconds": 8,
    }
    target.open().close()  # create the schema first, so the children only race on data
    procs = [
        subprocess.Popen(
            [sys.executable, "store_worker.py", role, json.dumps({**common, "index": i})],
            cwd=Path(__file__).parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("writer", "reader")
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sum(r.get("stored", 0) for r in results) == 72  # 24 chunks x 3 writers each
    assert sum(r.get("checked", 0) for r in results) > 0
    store = TieredStore(root, catalog=target.open())
    rows = store.catalog.all_chunks()
    assert len(rows) == 24 and {r.state for r in rows} == {"stored"}
    assert sorted(store.durable.ids()) == sorted(r.cache_id for r in rows)  # one blob each
    report = store.verify(repair=False)
    assert report.checked == 24 and report.corrupt == [] and report.missing == []
    store.close()


@pytest.mark.stress
def test_writers_killed_at_random_points_never_break_the_store(tmp_path) -> None:
    """20 times: SIGKILL an ingesting process at a random moment, reopen, verify, gc.
    Nothing reported stored is lost; no row points at a missing or bad blob; after gc no
    blob or temporary is unaccounted for."""
    root, rng = tmp_path / "kv", random.Random(20)
    reported: set[str] = set()
    for attempt in range(20):
        child = subprocess.Popen(
            [sys.executable, "ingest_worker.py", str(root), str(attempt)],
            cwd=Path(__file__).parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        first = child.stdout.readline().strip()  # a kill after some work, however slow
        time.sleep(rng.uniform(0.0, 0.4))
        child.kill()
        out, _ = child.communicate(timeout=60)
        reported.update(line for line in [first, *out.split()] if line)
        store = TieredStore(root)
        stored = {r.cache_id for r in store.catalog.all_chunks("stored")}
        assert reported <= stored, attempt  # every chunk reported stored survived
        report = store.verify(repair=False)
        assert report.corrupt == [] and report.missing == [], attempt
        store.gc(pending_after_s=0)  # the dead writer's claim, if any
        assert set(store.durable.ids()) == stored and store.durable.remove_temporaries(0) == 0
        assert {r.state for r in store.catalog.all_chunks()} <= {"stored"}
        store.close()
    assert len(reported) > 20  # the kills did land mid-ingest, after some work


def test_full_disk_is_a_clear_error_and_records_nothing(tmp_path, tiny64) -> None:
    """A real 256 KiB filesystem (tmpfs; needs root to mount) fills up mid-ingest."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        store = TieredStore(mount, catalog=Catalog(path=tmp_path / "catalog.sqlite"))
        store.register_model(tiny64.fingerprint, "tiny", "float64", 3, 2, 16)
        kvs = encode_chunks(tiny64, random_chunks([40] * 40, seed=7))  # ~15 KiB each
        stored = []
        with pytest.raises(StoreFullError, match="disk full while writing chunk"):
            for kv in kvs:
                store.put(kv, "x")
                stored.append(kv.cache_id)
        assert 0 < len(stored) < len(kvs)
        rows = store.catalog.all_chunks()
        assert sorted(r.cache_id for r in rows) == sorted(stored)  # the failed one unrecorded
        assert {r.state for r in rows} == {"stored"}
        assert store.durable.remove_temporaries(0) == 0  # the partial file was removed
        assert [k.cache_id for k in store.get(stored)] == stored
        store.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_int8_quantization_error_is_within_half_a_step() -> None:
    from rag_kvcache.storage.compress import dequantize, quantize

    x = torch.randn(3, 2, 50, 16, dtype=torch.float64) * torch.linspace(0.01, 10, 16)
    codes, scale = quantize(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 2, 1, 16)
    error = (dequantize(codes, scale, torch.float64) - x).abs()
    assert (error <= scale / 2 + 1e-9).all()
    assert error.max() > 0  # it is lossy: the check above is not vacuous


def test_int8_store_shrinks_blobs_and_serves_the_dequantized_kv(tiny32, tmp_path) -> None:
    from rag_kvcache.storage.compress import dequantize, quantize

    plain = TieredStore(tmp_path / "plain")
    small = TieredStore(tmp_path / "int8", compress="int8")
    kv = encode_chunks(tiny32, random_chunks([64], seed=11))[0]
    for store in (plain, small):
        store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
        store.put(kv, "t")
        store.hot[0].remove(kv.cache_id)
    ratio = small.durable.nbytes() / plain.durable.nbytes()
    assert ratio < 0.3  # int8 codes + per-channel scales vs float32
    (got,) = small.get([kv.cache_id])
    assert got.keys.dtype == torch.float32
    assert torch.equal(got.keys, dequantize(*quantize(kv.keys), torch.float32))
    assert torch.equal(got.values, dequantize(*quantize(kv.values), torch.float32))
    assert small.verify().corrupt == []
    plain.close()
    small.close()


def test_prefetch_reads_cold_chunks_ahead_into_the_hot_tier(store, tiny64) -> None:
    """What retrieval starts: cold chunks read from the durable tier in the background, so the
    answer's fetch finds them hot (one durable read each, not two), and IDs it cannot use are
    left for fetch to report."""
    kvs = encode_chunks(tiny64, random_chunks([5, 9, 7], seed=4))
    store.register_model(tiny64.fingerprint, "tiny", "float64", 3, 2, 16)
    for kv in kvs:
        store.put(kv, "text")
    ids = [k.cache_id for k in kvs]
    for tier in store.hot:
        tier.remove(ids[0])
        tier.remove(ids[1])  # two cold chunks, one hot
    reads: list[str] = []
    get = store.durable.get

    def counted(cid: str, nbytes: int | None = None) -> bytes | bytearray | None:
        reads.append(cid)
        return get(cid, nbytes)

    store.durable.get = counted  # type: ignore[method-assign]
    store.prefetch([*ids, "0" * 32, "../not-a-name"])  # unknown and malformed: ignored here
    fetched = store.fetch(ids)  # waits for the reads in flight, if any
    fetched.settle()
    for a, b in zip(fetched.chunks, kvs, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert sorted(reads) == sorted(ids[:2])  # each cold chunk read once, by the prefetch
    counters = store.catalog.counters()
    assert counters[f"prefetched:{store.durable.name}"] == 2
    assert counters.get(f"hits:{store.durable.name}", 0) == 0  # fetch read nothing itself
    assert all(any(t.get(c) is not None for t in store.hot) for c in ids)
    store.prefetch(ids)  # all hot: nothing to read
    assert sorted(reads) == sorted(ids[:2])
    with pytest.raises(UnknownCacheIdError):
        store.fetch(["0" * 32])


def test_a_prefetch_whose_read_is_done_at_once_returns(store, tiny64) -> None:
    """A read that has finished before its completion callback is added calls back in the
    caller's thread: that must not wait for a lock the caller holds (it once hung here)."""
    import threading
    from concurrent.futures import Future

    kv = encode_chunks(tiny64, random_chunks([6], seed=8))[0]
    store.register_model(tiny64.fingerprint, "tiny", "float64", 3, 2, 16)
    store.put(kv, "text")
    for tier in store.hot:
        tier.remove(kv.cache_id)

    def at_once(fn, *args):  # the read runs and finishes before submit returns
        done: Future[None] = Future()
        fn(*args)
        done.set_result(None)
        return done

    store._readers.submit = at_once  # type: ignore[method-assign]
    caller = threading.Thread(target=store.prefetch, args=([kv.cache_id],), daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive()
    assert any(t.get(kv.cache_id) is not None for t in store.hot)
    assert not store._prefetching  # its callback ran: nothing left in flight
