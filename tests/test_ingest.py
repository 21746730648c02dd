"""Ingestion: reading files (bad ones reported, never fatal), incremental and resumable runs,
pruning, the FAISS index kept consistent with the catalog, and the `ingest` / `query` / `chat`
commands. Engine tests use the tiny model (SmolLM2's tokenizer); the commands use SmolLM2."""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import re
import shutil
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from helpers import TINY_VOCAB
from tiny_tokenizer import build_tokenizer

import rag_kvcache.engine as engine_module
import rag_kvcache.ingest as ingest_module
from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.errors import (
    ConfigError,
    FingerprintMismatchError,
    InvalidNameError,
    StoreFullError,
)
from rag_kvcache.ingest import plan_ingest, prune, read_text, run_ingest
from rag_kvcache.integrations.llama_index.splitter import split_text, token_splitter
from rag_kvcache.retrieval.corpus import Corpus
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.tools.cli import main
from rag_kvcache.tools.cli.documents import counted, ingest_command

INGEST_DEFAULTS = {"chunk_tokens": 256, "overlap": 0}

DATA = Path(__file__).resolve().parents[1] / "demos" / "data"
PARAGRAPHS = {
    "ferry.md": [
        "The Quell Island ferry leaves Velmora at dawn and returns at dusk.",
        "Its captain, Ilse Varro, has sailed the route for nineteen years.",
        "Tickets cost four silver marks, or two for children.",
    ],
    "bakery.md": [
        "The Tallow Street bakery sells rye loaves shaped like anchors.",
        "It opens at five in the morning, an hour before the fish market.",
    ],
    "league.md": [
        "The Grennick Bay rowing league has six crews.",
        "The oldest crew, the Saltreach Oars, was founded in 1901.",
    ],
}


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in Helvetica, written by hand (offsets and all)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def write_docs(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, paragraphs in PARAGRAPHS.items():
        (folder / name).write_text("\n\n".join(paragraphs) + "\n")


def paragraphs(text: str) -> list[str]:
    """A splitter that makes one chunk per paragraph, so tests can count chunks exactly."""
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def kv_readers() -> list[threading.Thread]:
    """The store's reader threads alive now."""
    return [t for t in threading.enumerate() if t.name.startswith("kv-read")]


@pytest.fixture
def engine(tiny32, tmp_path: Path) -> RagKVCache:
    config = EngineConfig(
        store=StoreConfig(root=tmp_path / "store"), generation=GenerationConfig(max_new_tokens=4)
    )
    return RagKVCache(config, lm=tiny32)


def ingest(engine: RagKVCache, *paths: Path, **kw):
    plan = plan_ingest(engine, list(paths), paragraphs, **kw)
    return plan, run_ingest(engine, plan)


# ----------------------------------------------------------------------------- reading files


def test_a_nul_past_the_binary_sniff_is_dropped_as_ingest_document_drops_it(
    engine, tmp_path: Path
) -> None:
    """A text file is sniffed for NUL in its first 8 KiB only: one later (or in a PDF's text)
    reached the catalog, which PostgreSQL refuses (the whole run then stopped) and SQLite
    kept."""
    docs = tmp_path / "docs"
    docs.mkdir()
    late = ("Words go here. " * 30 + "\n\n") * 20 + "The gate code is 4417.\x00 Keep it."
    (docs / "late.txt").write_text(late)  # its NUL at ~9 KB
    plan, done = ingest(engine, docs)
    assert plan.skipped == [] and len(done) == 1
    texts = [row.text for row in engine.store.catalog.chunks(done[0].cache_ids).values()]
    assert any("The gate code is 4417. Keep it." in t for t in texts)
    assert not any("\x00" in t for t in texts)
    assert "\x00" not in read_text(docs / "late.txt")[0]


def test_bad_files_are_reported_and_the_good_ones_ingested(
    engine, tmp_path: Path, monkeypatch
) -> None:
    docs = tmp_path / "docs"
    write_docs(docs)
    (docs / "empty.txt").write_bytes(b"")
    (docs / "blanks.txt").write_text("  \n\n \n")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    (docs / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (docs / "notes16.txt").write_bytes("Tide at noon.".encode("utf-16"))  # (a BOM first)
    (docs / "huge.txt").write_text("word " * 2000)
    (docs / "scan.pdf").write_bytes(minimal_pdf("The Quell Island lighthouse is painted red."))
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4\nnot really a pdf")
    (docs / "page.pdf").write_text("<html>404 Not Found</html>")  # a download gone wrong
    (docs / "loop").symlink_to(docs)
    (docs / "dangling.md").symlink_to(tmp_path / "missing.md")
    (docs / ".hidden.md").write_text("never read")
    (docs / os.fsdecode(b"caf\xe9.md")).write_text("A name in latin-1.")  # not UTF-8

    monkeypatch.chdir(tmp_path)  # named relative: reported absolute, as the files read are
    plan, done = ingest(engine, Path("docs"), Path("nowhere"), max_bytes=4096)
    assert all(Path(s.path).is_absolute() for s in plan.skipped)
    reasons = {Path(s.path).name: s.reason for s in plan.skipped}
    assert reasons.pop("empty.txt") == "empty file"
    assert reasons.pop("blanks.txt") == "no text in it"
    assert reasons.pop("image.png") == "binary file"
    assert reasons.pop("latin1.txt") == "not UTF-8 text (invalid byte at offset 3)"
    assert reasons.pop("notes16.txt") == "UTF-16 text, not UTF-8: save it as UTF-8"  # "binary"
    assert reasons.pop("huge.txt") == "9.8 KiB is over the 4.0 KiB limit"  # was "0.0 MiB"
    assert reasons.pop("broken.pdf").startswith("unreadable PDF")
    assert reasons.pop("page.pdf") == "named .pdf but not a PDF (it does not start with %PDF)"
    assert reasons.pop("loop").startswith("symlink loop")
    assert reasons.pop("dangling.md") == f"a broken symbolic link (to {tmp_path / 'missing.md'})"
    assert reasons.pop("nowhere") == "no such file or folder"
    assert reasons.pop("caf\\xe9.md") == "its name is not valid UTF-8: rename it"
    assert reasons == {}
    ingested = {Path(d.source).name: len(d.cache_ids) for d in done}
    assert ingested == {"bakery.md": 2, "ferry.md": 3, "league.md": 2, "scan.pdf": 1}
    assert engine.retrieve("What colour is the lighthouse on Quell Island?", 1)[0].text == (
        "The Quell Island lighthouse is painted red."
    )


def test_a_path_longer_than_the_catalog_keeps_is_skipped_before_encoding(
    engine, tmp_path: Path
) -> None:
    """A document's source is its path, and the catalog keeps 1024 characters of it: a longer
    one was encoded, then failed the catalog's check and stopped the whole run."""
    deep = tmp_path / "docs"
    while len(str(deep)) <= 1024:
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    (deep / "far.md").write_text("The far file says the vault opens at dawn.")
    (tmp_path / "docs" / "near.md").write_text("The near file says the gate opens at noon.")
    plan, done = ingest(engine, tmp_path / "docs")
    assert [Path(d.source).name for d in done] == ["near.md"]
    ((skipped),) = plan.skipped
    assert skipped.path == str(deep / "far.md")
    assert skipped.reason == f"its path is {len(str(deep / 'far.md'))} characters: at most 1024"


def test_a_file_growing_while_read_is_read_as_it_was_opened(
    engine, tmp_path: Path, monkeypatch
) -> None:
    """A live log appended to faster than it is split was read for ever (past the size
    limit, hundreds of MB): a reading stops at the size the file had when opened."""
    monkeypatch.setattr(ingest_module, "READ_BYTES", 1024)  # small reads and segments: the
    monkeypatch.setattr(ingest_module, "SEGMENT_CHARS", 1024)  # writer gets in between them
    docs = tmp_path / "docs"
    docs.mkdir()
    log = docs / "live.log"
    log.write_text("\n\n".join(f"Entry {i}: the ferry left on time." for i in range(400)))
    size = log.stat().st_size
    appended: list[int] = []

    def split_while_written(text: str) -> list[str]:
        if len(appended) < 100:  # a writer appends a little more than each read takes
            with log.open("a") as f:
                f.write("\n\nAnother entry." * 80)
            appended.append(1)
        return paragraphs(text)

    plan = plan_ingest(engine, [docs], split_while_written, max_bytes=100 * size)
    assert len(appended) > 5 and log.stat().st_size > 2 * size  # it grew while read
    assert [d.chunk_count for d in plan.todo] == [400]  # what it held when opened


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_file_replaced_by_a_fifo_after_listing_is_said_not_waited_on(engine, tmp_path):
    docs = tmp_path / "docs"
    write_docs(docs)

    def swap() -> None:  # between listing the folder and reading its files
        ferry = docs / "ferry.md"
        if ferry.is_file():
            ferry.unlink()
            os.mkfifo(ferry)

    plan = plan_ingest(engine, [docs], paragraphs, on_file=swap)
    assert {Path(s.path).name: s.reason for s in plan.skipped} == {"ferry.md": "not a regular file"}


def test_a_pdf_is_parsed_from_the_bytes_read(tmp_path: Path, monkeypatch) -> None:
    """A PDF's text comes from the bytes hashed for it: the path opened again could be
    another file by then (a FIFO waited on for ever, or a text the digest does not match)."""
    path = tmp_path / "scan.pdf"
    path.write_bytes(minimal_pdf("The Quell Island lighthouse is painted red."))
    blocks = ingest_module._blocks

    def then_replaced(f, size):
        yield from blocks(f, size)
        path.unlink()
        os.mkfifo(path)

    monkeypatch.setattr(ingest_module, "_blocks", then_replaced)
    text, digest = read_text(path)
    assert text == "The Quell Island lighthouse is painted red."
    assert digest == hashlib.sha256(minimal_pdf(text)).hexdigest()


def test_read_text_strips_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello".encode())
    assert read_text(path)[0] == "hello"


# ----------------------------------------------------------------------------- incremental runs


def test_editing_one_file_reencodes_only_its_changed_chunks(engine, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    write_docs(docs)
    _, first = ingest(engine, docs)
    assert sum(d.encoded for d in first) == 7
    old_price = engine.retrieve("How much does a ferry ticket cost?", 1)[0]
    assert "four silver marks" in old_price.text

    edited = PARAGRAPHS["ferry.md"][:2] + ["Tickets now cost six silver marks since the storm."]
    (docs / "ferry.md").write_text("\n\n".join(edited))
    plan, second = ingest(engine, docs)
    assert [Path(p.source).name for p in plan.todo] == ["ferry.md"]
    assert sorted(Path(s).name for s in plan.unchanged) == ["bakery.md", "league.md"]
    assert [(d.encoded, d.removed) for d in second] == [(1, 1)]  # one new chunk, one stale

    assert not engine.store.contains(old_price.cache_id)
    for query in ("How much does a ferry ticket cost?", "four silver marks ferry price"):
        hits = engine.retrieve(query, 10)
        assert old_price.cache_id not in [h.cache_id for h in hits]
        assert len(hits) == 7 and all(engine.store.contains(h.cache_id) for h in hits)
    assert "six silver marks" in engine.retrieve("How much does a ferry ticket cost?", 1)[0].text

    plan, third = ingest(engine, docs)
    assert (plan.todo, third, len(plan.unchanged)) == ([], [], 3)


def test_ingesting_again_with_another_model_encodes_for_it(engine, tiny64, tmp_path) -> None:
    """Unchanged files whose chunks another model encoded are not "unchanged" for this one:
    skipping them left a store no question could be answered from with the new model."""
    docs = tmp_path / "docs"
    write_docs(docs)
    ingest(engine, docs)
    other = RagKVCache(engine.config, lm=tiny64)
    plan, done = ingest(other, docs)
    assert (len(plan.todo), plan.unchanged) == (3, [])
    assert sum(d.encoded for d in done) == 7
    hits = other.retrieve("How much does a ferry ticket cost?", 2)
    assert other.generate("How much?", [h.cache_id for h in hits]).token_ids
    assert ingest(other, docs)[0].unchanged  # and then unchanged for it
    # the first model's copies were replaced: its retrieval says so and what to do, where
    # linking named a chunk and said "re-encode it" (a server answered 400 to every question)
    with pytest.raises(FingerprintMismatchError, match="'.*ferry.*'.* ingest them again"):
        engine.retrieve("How much does a ferry ticket cost?", 2)
    ingest(engine, docs)
    assert engine.retrieve("How much does a ferry ticket cost?", 2)


def test_an_interrupted_run_resumes_without_reencoding(engine, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    write_docs(docs)
    plan = plan_ingest(engine, [docs], paragraphs)
    encoded = 0

    def die_after_four(n: int) -> None:
        nonlocal encoded
        encoded += n
        if encoded >= 4:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-document

    engine.config = EngineConfig(store=engine.config.store)  # batch_size 8: a chunk at a time?
    with pytest.raises(KeyboardInterrupt):
        run_ingest(engine, plan, die_after_four)
    recorded = {Path(d.source).name for d in engine.corpus.catalog.documents()}
    assert recorded == {"bakery.md"}  # the document being encoded was not recorded
    stored_before = len(engine.store)

    plan, done = ingest(engine, docs)
    assert sorted(Path(d.source).name for d in done) == ["ferry.md", "league.md"]
    assert sum(len(d.cache_ids) for d in done) == 5
    assert sum(d.encoded for d in done) == 5 - (stored_before - 1 - 2)  # prefix, bakery
    assert len(engine.retrieve("rowing crews", 10)) == 7


def test_progress_adds_up_to_the_plan_when_files_change_before_encoding(engine, tmp_path):
    """A file edited between planning and encoding took the progress bar past its total, and
    one gone since left it short: each document now reports the chunks planned for it."""
    docs = tmp_path / "docs"
    write_docs(docs)
    plan = plan_ingest(engine, [docs], paragraphs)
    (docs / "bakery.md").write_text("\n\n".join(f"Loaf {i} was rye." for i in range(12)))
    (docs / "ferry.md").unlink()
    reported: list[int] = []
    done = run_ingest(engine, plan, reported.append)
    assert sorted(Path(d.source).name for d in done) == ["bakery.md", "league.md"]
    assert len(next(d for d in done if d.source.endswith("bakery.md")).cache_ids) == 12
    assert [Path(s.path).name for s in plan.skipped] == ["ferry.md"]
    assert sum(reported) == plan.total_chunks and min(reported) > 0


def test_progress_counts_a_skipped_files_chunks_as_dropped_not_done(engine, tmp_path):
    """With `on_dropped`, a file gone since planning takes its planned chunks out of the
    total instead of counting them as encoded at once (which made the bar's chunks/s jump)."""
    docs = tmp_path / "docs"
    write_docs(docs)
    plan = plan_ingest(engine, [docs], paragraphs)
    ferry = next(d.chunk_count for d in plan.todo if d.source.endswith("ferry.md"))
    (docs / "ferry.md").unlink()
    reported: list[int] = []
    dropped: list[int] = []
    done = run_ingest(engine, plan, reported.append, dropped.append)
    assert sorted(Path(d.source).name for d in done) == ["bakery.md", "league.md"]
    assert dropped == [ferry] and ferry > 0
    assert sum(reported) == sum(len(d.cache_ids) for d in done) == plan.total_chunks - ferry


def test_prune_removes_documents_whose_file_is_gone(engine, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    write_docs(docs)
    other = tmp_path / "other.md"
    other.write_text("A note outside the folder.")
    ingest(engine, docs, other)
    (docs / "league.md").unlink()
    other.unlink()
    gone = prune(engine, [docs])
    assert [Path(s).name for s in gone] == ["league.md"]  # other.md is not under docs/
    sources = {Path(d.source).name for d in engine.corpus.catalog.documents()}
    assert sources == {"ferry.md", "bakery.md", "other.md"}
    assert all("rowing" not in h.text for h in engine.retrieve("rowing league crews", 10))


def test_a_path_that_does_not_exist_prunes_nothing(engine, tmp_path: Path) -> None:
    """`prune` under a folder that is not there (a typo, an unmounted disk) forgets nothing;
    the command refuses it before anything runs."""
    docs = tmp_path / "docs"
    write_docs(docs)
    ingest(engine, docs)
    moved = tmp_path / "moved"
    docs.rename(moved)
    assert prune(engine, [docs]) == []
    assert len(engine.corpus.catalog.documents()) == len(PARAGRAPHS)
    store = ["--store", str(tmp_path / "store")]
    with pytest.raises(ConfigError, match="no such file or folder, so nothing was pruned"):
        ingest_command(argparse.Namespace(paths=[docs], prune=True, **INGEST_DEFAULTS), None)
    assert main(["ingest", str(docs), "--prune", *store]) == 1
    assert len(engine.corpus.catalog.documents()) == len(PARAGRAPHS)


def test_a_full_disk_stops_the_ingest_instead_of_skipping_files(
    engine, tmp_path: Path, monkeypatch
) -> None:
    """Every file after a full disk would fail too: the store's error ends the run (the
    command exits 1 with it) where a file's own fault is a skip; documents stored before it
    stay."""
    docs = tmp_path / "docs"
    write_docs(docs)
    store = engine.cache_token_ids
    calls = []

    def full_after_one(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise StoreFullError("disk full while writing chunk x; free space")
        return store(*args, **kwargs)

    monkeypatch.setattr(engine, "cache_token_ids", full_after_one)
    plan = plan_ingest(engine, [docs], paragraphs)
    with pytest.raises(StoreFullError, match="disk full"):
        run_ingest(engine, plan)
    assert plan.skipped == []
    assert [Path(d.source).name for d in engine.corpus.catalog.documents()] == ["bakery.md"]


def test_a_chunk_shared_by_two_documents_outlives_either(engine) -> None:
    shared = "All ferries are cancelled during the Lantern Tide festival."
    a = engine.ingest_document("a.md", [shared, "Only in a."])
    b = engine.ingest_document("b.md", ["Only in b.", shared])
    assert (a.encoded, b.encoded) == (2, 1)
    assert a.cache_ids[0] == b.cache_ids[1]
    assert engine.remove_document("a.md") == 1  # "Only in a."; the shared chunk stays
    assert engine.store.contains(a.cache_ids[0])
    assert engine.retrieve("ferries cancelled festival", 1)[0].source == "b.md"


def test_an_expired_chunk_leaves_the_index_here_and_in_other_workers(engine) -> None:
    """expire_cache removed the chunk from the store but not from the index: the saved index
    listed it (`verify` reported damage, `gc` kept it), and a search spent top_k on it."""
    other = RagKVCache(engine.config, lm=engine.lm)  # another worker, its index loaded
    ingested = engine.ingest_document("tide.md", ["High tide is at noon.", "Low tide at six."])
    assert len(other.retrieve("tide", 50)) == len(engine.retrieve("tide", 50))
    assert engine.expire_cache(ingested.cache_ids[0])
    saved = set((engine.store.root / "index.ids").read_text(encoding="ascii").split())
    assert saved == engine.corpus.catalog.documented_ids()  # what verify checks
    for worker in (engine, other):
        hits = worker.retrieve("tide", 50)
        assert ingested.cache_ids[0] not in {h.cache_id for h in hits}
        assert len(hits) == len(saved)  # none of top_k spent on the expired chunk


def test_a_chunk_past_its_time_to_live_is_not_retrieved_and_top_k_is_filled(engine) -> None:
    """A documented chunk given a TTL (`TieredStore.put(ttl_s=...)`) stays in the index when it
    expires, and when gc removes it: retrieval handed out an ID the answer then refused as
    expired, or spent one of top_k on it."""
    texts = ["High tide is at noon.", "Low tide is at six.", "The harbour opens at dawn."]
    ids = engine.ingest_document("tide.md", texts).cache_ids
    best = engine.retrieve("When is high tide?", 1)[0].cache_id
    assert best == ids[0]
    engine.store.catalog.set_expiry(best, datetime.now(UTC) - timedelta(seconds=1))
    for _ in ("expired", "collected by gc"):
        hits = engine.retrieve("When is high tide?", 2)
        assert {h.cache_id for h in hits} == set(ids) - {best}  # top_k filled from further down
        engine.generate("When is high tide?", [h.cache_id for h in hits])  # no expired ID
        engine.store.gc()
    assert not engine.store.contains(best)


def test_gc_of_an_expired_chunk_takes_it_out_of_every_workers_index(engine) -> None:
    """gc removed an expired chunk from the catalog but no process's vector index dropped it:
    each search kept finding it and asking the index for more, and the saved index listed a
    chunk no document lists."""
    other = RagKVCache(engine.config, lm=engine.lm)  # another worker, its index loaded
    ids = engine.ingest_document("tide.md", ["High tide is at noon.", "Low tide at six."]).cache_ids
    other.retrieve("tide", 2)
    engine.store.catalog.set_expiry(ids[0], datetime.now(UTC) - timedelta(seconds=1))
    assert engine.store.gc().expired == 1
    for worker in (engine, other):
        assert [h.cache_id for h in worker.retrieve("When is high tide?", 2)] == [ids[1]]
        assert ids[0] not in worker.corpus.index.cache_ids()
    saved = set((engine.store.root / "index.ids").read_text(encoding="ascii").split())
    assert saved == engine.corpus.catalog.documented_ids() == {ids[1]}


def test_threads_ingesting_one_document_at_once_leave_the_last_version(engine) -> None:
    """Threads re-ingesting one document at once (a web app's re-uploads) failed with a
    KeyError: one thread's replacement removed the chunk another was indexing."""
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def upload(i: int) -> None:
        start.wait()
        try:
            for round_ in range(3):
                engine.ingest_document("shared.md", [f"Shared notice, version {i}.{round_}."])
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=upload, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    (listed,) = engine.corpus.catalog.document_chunks("shared.md")
    assert engine.corpus.index.cache_ids() == {listed} == engine.corpus.catalog.documented_ids()
    assert [h.cache_id for h in engine.retrieve("shared notice", 4)] == [listed]


def test_threads_caching_the_same_texts_at_once_encode_them_once(engine, monkeypatch) -> None:
    """Threads of one engine caching the same chunks at once (a document uploaded twice) each
    encoded all of them; now a chunk being encoded is waited for. A thread whose encode fails
    leaves its chunks to the one waiting, which encodes them itself."""
    texts = [f"Notice {i}: the ferry leaves at {i} o'clock." for i in range(6)]
    encoded: list[int] = []
    real = engine_module.encode_chunks

    def slow_encode(lm, chunks, *args):
        encoded.append(len(chunks))
        time.sleep(0.3)  # (the window in which the others ask)
        return real(lm, chunks, *args)

    monkeypatch.setattr(engine_module, "encode_chunks", slow_encode)
    start, results = threading.Barrier(4), []

    def cache(part: list[str]) -> None:
        start.wait()
        results.append(engine._cache_texts(part, None))

    parts = [texts, texts, texts[:3], texts[3:]]
    workers = [threading.Thread(target=cache, args=(part,)) for part in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sum(encoded) == len(texts) and sum(n for _, n in results) == len(texts)
    whole = [ids for ids, _ in results if len(ids) == len(texts)]
    assert whole[0] == whole[1] and all(engine.store.contains(c) for c in whole[0])

    more = [f"Tide table {i}." for i in range(3)]
    encoded.clear()
    first_in = threading.Event()

    def broken_encode(lm, chunks, *args):
        encoded.append(len(chunks))
        if len(encoded) == 1:  # the first thread's: fails once the other waits on it
            first_in.set()
            time.sleep(0.3)
            raise RuntimeError("out of memory")
        return real(lm, chunks, *args)

    monkeypatch.setattr(engine_module, "encode_chunks", broken_encode)
    errors, second = [], []

    def first() -> None:
        try:
            engine._cache_texts(more, None)
        except RuntimeError as e:
            errors.append(e)

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(10)
    second.append(engine._cache_texts(more, None))  # waits, then encodes them itself
    a.join()
    assert len(errors) == 1 and second[0][1] == len(more) and encoded == [3, 3]
    assert all(engine.store.contains(c) for c in second[0][0])


def test_threads_asking_for_the_corpus_at_once_share_one(engine, monkeypatch) -> None:
    """The corpus was a cached_property, which Python 3.12 no longer locks: threads reaching it
    first at once each built one, with its own index, and the index saved last dropped the other
    corpus's chunks. (On 3.11 the property's own lock passed this too.)"""
    built: list[object] = []
    real = engine_module.Corpus

    def slow_corpus(*args: object) -> object:
        time.sleep(0.2)  # (the index load and embedder start take longer than this)
        corpus = real(*args)
        built.append(corpus)
        return corpus

    monkeypatch.setattr(engine_module, "Corpus", slow_corpus)
    start, seen = threading.Barrier(4), []

    def ask() -> None:
        start.wait()
        seen.append(engine.corpus)

    workers = [threading.Thread(target=ask) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(built) == 1 and seen == built * 4


def test_a_chunk_that_is_not_unicode_is_refused_before_anything_is_stored(engine) -> None:
    """A lone surrogate (what a JSON `\\ud800` escape decodes to) is named, not a codec error
    from hashing the document, and the document's other chunks are not stored either."""
    before = len(engine.store)
    with pytest.raises(ConfigError, match="not a Unicode character"):
        engine.ingest_document("odd.md", ["A fine chunk.", "abc\ud800"])
    assert len(engine.store) == before and engine.corpus.catalog.document("odd.md") is None


# ----------------------------------------------------------------------------- the index


def test_the_index_is_rebuilt_from_the_catalog_and_follows_other_writers(engine, tmp_path) -> None:
    docs = tmp_path / "docs"
    write_docs(docs)
    ingest(engine, docs)
    expected = engine.retrieve("When does the bakery open?", 3)
    store = engine.store
    root, catalog = store.root, store.catalog
    (root / "index.faiss").unlink()
    rebuilt = Corpus(store, catalog, root, Embedder())
    assert len(rebuilt.index) == 7
    again = rebuilt.search("When does the bakery open?", 3)
    assert [h.cache_id for h in again] == [h.cache_id for h in expected]
    assert [h.score for h in again] == pytest.approx([h.score for h in expected], abs=1e-5)

    # a second engine (another worker) on the same store adds a document: the first sees it
    other = RagKVCache(engine.config, lm=engine.lm)
    other.ingest_document("new.md", ["The harbour master's cat is called Brine."])
    assert engine.retrieve("What is the cat called?", 1)[0].source == "new.md"
    other.remove_document("new.md")
    assert all(h.source != "new.md" for h in engine.retrieve("What is the cat called?", 8))


def test_a_query_or_source_that_is_not_text_is_named(engine) -> None:
    """`retrieve(None)` and `complete(b"...")` failed with an AttributeError from inside the
    tokenizer, and a source with a lone surrogate with a codec error from the catalog after
    its chunks were encoded."""
    for bad in (None, b"harbour", 3):
        with pytest.raises(ConfigError, match="the query must be text"):
            engine.retrieve(bad)
        with pytest.raises(ConfigError, match="the prompt must be text"):
            engine.complete(bad)
    for blank in ("", "  \n"):  # (hits were returned, for a question `generate` refuses)
        with pytest.raises(ConfigError, match="the query is empty"):
            engine.retrieve(blank)
    with pytest.raises(InvalidNameError, match="not a document source: None"):
        engine.remove_document(None)  # (0: no such document)
    before = len(engine.store)
    with pytest.raises(InvalidNameError, match="not a document source: .* a lone surrogate"):
        engine.ingest_document("tide\ud800.md", ["High tide is at noon."])
    assert len(engine.store) == before


def test_retrieval_needs_a_durable_store(tiny32) -> None:
    engine = RagKVCache(EngineConfig(), lm=tiny32)
    with pytest.raises(Exception, match="durable store"):
        engine.retrieve("anything")


def test_the_splitter_counts_model_tokens(smol) -> None:
    text = (DATA / "01_harbor_town_of_velmora.md").read_text()
    chunks = split_text(smol.tokenizer, chunk_tokens=64)(text)
    sizes = [len(smol.tokenizer.encode(c, add_special_tokens=False)) for c in chunks]
    assert len(chunks) > 3 and max(sizes) <= 64


def test_a_long_run_without_spaces_is_cut_by_tokens(tiny_tokenizer) -> None:
    """SentenceSplitter cut a run with no whitespace character by character, tokenizing as it
    went (a 50 MB line ran for minutes in planning); such runs are cut by tokens, in pieces
    of the text itself, and text without one is split as before."""
    split = split_text(tiny_tokenizer, chunk_tokens=64)
    run = "x7" * 50_000 + "\u00e9\u00e9\u706f\u5854" * 200  # multi-byte characters too
    text = "The harbor is deep.\n\n" + run + "\n\nThe ferry leaves at dawn."
    chunks = split(text)
    assert chunks[0] == "The harbor is deep." and chunks[-1] == "The ferry leaves at dawn."
    assert "".join(chunks[1:-1]) == run  # every character kept, none cut in two
    sizes = [len(tiny_tokenizer.encode(c, add_special_tokens=False)) for c in chunks[1:-1]]
    assert max(sizes) <= 64 + 2 and len(chunks) > 100  # (a cut may merge differently)
    prose = (DATA / "01_harbor_town_of_velmora.md").read_text()
    plain = token_splitter(tiny_tokenizer, chunk_tokens=64).split_text
    assert split(prose) == plain(prose)


# ----------------------------------------------------------------------------- the commands


@pytest.mark.slow
def test_ingest_query_and_chat_commands(tmp_path: Path, capsys, caplog, monkeypatch) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DATA / "01_harbor_town_of_velmora.md", docs)
    shutil.copy(DATA / "04_tk7_tidal_spectrometer.md", docs)
    (docs / "bad.bin").write_bytes(os.urandom(64) + b"\x00")
    store = ["--store", str(tmp_path / "store")]
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at the terminal width

    assert main(["ingest", str(docs), "--chunk-tokens", "128", *store]) == 0
    out = capsys.readouterr().out
    assert "2 documents ingested" in out and "bad.bin" in out and "binary file" in out
    assert "chunks/s" in out

    assert main(["ingest", str(docs), *store]) == 0  # nothing changed: still a success
    assert "2 unchanged" in capsys.readouterr().out
    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    (only_bad / "empty.txt").write_bytes(b"")
    (only_bad / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is garbage not a pdf\n")
    assert main(["ingest", str(only_bad), *store]) == 1  # nothing could be ingested
    assert "unreadable PDF" in capsys.readouterr().out  # listed, with its reason, and
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]  # nothing printed
    # by pypdf above the table (its warning reached the terminal through logging)

    question = "When was Hallam Point Light built?"
    args = ["--max-new-tokens", "16", "--compare", "--strategy", "full", *store]
    readers = set(kv_readers())
    assert main(["query", question, *args]) == 0
    assert set(kv_readers()) <= readers  # the command's store is closed with it: its reader
    # threads are not left for the interpreter's exit, where a Ctrl-C met them with a traceback
    out = capsys.readouterr().out
    assert "full prefill" in out and "answers agree" in out  # full == prefill, token for token
    assert "01_harbor_town_of_velmora.md" in out and "TTFT" in out
    prefill = ["--max-new-tokens", "4", "--compare", "--strategy", "prefill", *store]
    assert main(["query", question, *prefill]) == 0  # compared with itself: said, not timed
    out = " ".join(capsys.readouterr().out.split())
    assert "prefill is the baseline itself" in out and "full prefill" not in out

    # a chat: follow-ups answered afresh (SmolLM2 used to give its first answer every turn)
    turns = [
        ("Who designed the TK-7 tidal spectrometer?", "TK-7"),
        ("When was it introduced?", "1987"),
        ("How much does it weigh?", "23.5"),
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{q}\n" for q, _ in turns) + "/quit\n"))
    assert main(["chat", "--max-new-tokens", "16", *store]) == 0
    shown = re.split(r"^TTFT.*$", capsys.readouterr().out, flags=re.MULTILINE)[:-1]
    answers = [turn.split("> ", 1)[1].split("\nsources")[0].strip() for turn in shown]
    assert len(answers) == len(turns) and len(set(answers)) == len(answers), answers
    assert all(right in answer for (_, right), answer in zip(turns, answers)), answers

    # one question the engine refuses (past the window) is said, and the session goes on
    lines = "town " * 20_000 + "\n" + turns[0][0] + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--max-new-tokens", "16", *store]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "error: the question is" in out and "ask a shorter question" in out
    assert out.count("TTFT") == 1 and "TK-7" in out.split("ask a shorter question")[1]

    # commands (the first word, in any case): an unknown one is said, not asked; /clear starts
    # a new conversation
    asked: list[int] = []
    chat_question = RagKVCache.chat_question

    def spy(self, messages, *args, **kwargs):
        asked.append(len(messages))
        return chat_question(self, messages, *args, **kwargs)

    monkeypatch.setattr(RagKVCache, "chat_question", spy)
    first, second, third = (turn[0] for turn in turns[:3])
    lines = f"/quti now\n/Help me\n{first}\n/CLEAR all\n{second}\n/Exit now\n{third}\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--max-new-tokens", "4", *store]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "unknown command /quti" in out and out.count("Commands: /clear") == 3
    assert "forgotten" in out and out.count("TTFT") == 2 and asked == [1, 1]

    # Ctrl-C while an answer is computed stops that answer; the session and its history go on
    asked.clear()
    generate = RagKVCache.generate

    def stopped_once(self, *args, **kwargs):
        if len(asked) == 1:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(RagKVCache, "generate", stopped_once)
    lines = "".join(f"{question}\n" for question, _ in turns)
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--max-new-tokens", "4", *store]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("answer stopped") == 1 and out.count("TTFT") == 2
    assert asked == [1, 1, 3]  # the stopped answer left no turn behind

    # a SIGTERM while an answer is computed ends the session (taken as a Ctrl-C elsewhere)
    asked.clear()

    def terminated_once(self, *args, **kwargs):
        if len(asked) == 1:
            signal.raise_signal(signal.SIGTERM)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(RagKVCache, "generate", terminated_once)
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--max-new-tokens", "4", *store]) == 130
    out = " ".join(capsys.readouterr().out.split())
    assert "interrupted" in out and "answer stopped" not in out and asked == [1]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # as it was before the command

    empty_store = ["--store", str(tmp_path / "empty-store")]
    assert main(["query", question, *empty_store]) == 1
    assert "ingest" in capsys.readouterr().out


@pytest.mark.slow
def test_ingest_killed_midway_resumes_where_it_stopped(tmp_path: Path) -> None:
    """SIGKILL `rag-kvcache ingest` once a document is recorded; the rerun finishes the job,
    encodes only what was not stored yet, and the store verifies clean."""
    import signal
    import subprocess
    import sys
    import time

    from rag_kvcache.storage.catalog import Catalog

    docs = tmp_path / "docs"
    docs.mkdir()
    for path in sorted(DATA.glob("0*.md")):
        shutil.copy(path, docs)
    store = tmp_path / "store"
    cli = str(Path(sys.executable).parent / "rag-kvcache")  # not `python -m` from the repo root
    command = [cli, "ingest", str(docs), "--store", str(store), "--chunk-tokens", "48"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, cwd=tmp_path)
    catalog = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None:
            if (store / "catalog.sqlite").exists():
                catalog = catalog or Catalog(path=store / "catalog.sqlite")
                if catalog.documents():
                    break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert catalog is not None
        recorded = len(catalog.documents())
        assert 0 < recorded < 8, "the kill must land mid-run"
        stored = catalog.stats().chunks_per_state.get("stored", 0)
    finally:
        if child.poll() is None:
            child.kill()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    out = " ".join(rerun.stdout.split())
    assert f"{counted(8 - recorded, 'document')} ingested" in out and f"{recorded} unchanged" in out
    assert catalog is not None
    total = catalog.stats().chunks_per_state["stored"]
    encoded = int(out.split(" encoded,")[0].rsplit(" ", 1)[1])
    assert encoded == total - stored  # nothing stored before the kill was encoded again
    catalog.close()
    check = subprocess.run(
        [cli, "verify", "--store", str(store)], capture_output=True, text=True, cwd=tmp_path
    )
    assert check.returncode == 0 and "0 corrupt, 0 missing" in check.stdout


@pytest.mark.slow
def test_commands_report_bad_input_without_a_traceback(tmp_path: Path, capsys) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The ferry leaves at dawn.")
    store = ["--store", str(tmp_path / "store")]
    assert main(["ingest", str(docs), *store]) == 0
    capsys.readouterr()
    # chunks were encoded without sink tokens, so legolink0 cannot use them
    assert main(["query", "When?", "--strategy", "legolink0", *store]) == 1
    out = capsys.readouterr().out
    assert "error:" in out and "sink tokens" in out and "Traceback" not in out
    assert main(["query", "When?", "--strategy", "bogus:1", *store]) == 1
    assert "unknown link strategy" in capsys.readouterr().out


def test_a_long_text_is_embedded_from_its_head_with_the_same_tokens() -> None:
    """The embedding model reads 256 tokens, but its tokenizer read a whole text first: a 7 MB
    question took seconds. `Embedder.head` cuts the text where its first 256 tokens are all
    in: the tokens the model reads are the same."""
    embedder = Embedder.shared()

    def read(text: str) -> list[int]:
        ids = embedder.tokenizer(text, truncation=True, max_length=embedder.max_tokens)
        return list(ids["input_ids"])

    prose = "The Hallam Point lighthouse, designed by Mara Quell, was first lit in 1788. " * 400
    texts = {
        "prose": prose,
        "control characters between words": "\x1c".join(prose.split(" ")),
        "CJK and punctuation": "灯塔。" * 3000 + " ... !? " * 2000 + prose,
        "short": "How deep is the harbor?",
        "one long word": "x" * 100_000,
        # words the tokenizer drops whole: the real text comes after hundreds of them
        "words of no token": "\u200b \u0301 \x00 " * 400 + prose,
    }
    for name, text in texts.items():
        head = embedder.head(text)
        assert read(head) == read(text), name
        if name in ("prose", "control characters between words"):
            assert len(head) < len(text) / 10, name
    assert embedder.head("How deep is the harbor?") == "How deep is the harbor?"


def test_reading_a_long_text_logs_no_tokenizer_warning(caplog) -> None:
    """A long question printed transformers' "Token indices sequence length is longer than
    the specified maximum ... will result in indexing errors" (the embedder counting its
    head's tokens; the model's tokenizer on a text past its window): alarming, and false, as
    the text is cut (or refused) before any model reads it. Fresh tokenizers: each warns once."""
    from rag_kvcache.chat_text import pieces_ids, text_ids

    fresh = build_tokenizer(TINY_VOCAB)
    fresh.model_max_length = 64
    long = "supercalifragilistic lighthouse " * 2000
    with caplog.at_level(logging.WARNING):
        Embedder().head(long)
        assert len(text_ids(fresh, long)) > 64 and len(pieces_ids(fresh, [(long, False)])) > 64
    assert not [r for r in caplog.records if "sequence length" in r.getMessage()], caplog.text
