"""Ingest files: find them, read them (text, Markdown, PDF), split, KV-encode, index.

Two steps, so a progress bar can know the total before the slow part: `plan_ingest` finds the
new or changed files and counts their chunks (bad files are reported, never fatal), `run_ingest`
encodes and records them one document at a time. A document is recorded (content hash + chunk
list, one transaction) only after all its chunks are stored, so an interrupted run resumes where
it stopped: chunks already stored are not encoded again, unchanged documents are skipped.

Memory does not grow with a file's size: a file is read and split a segment at a time (about
`SEGMENT_CHARS` of text, cut at a paragraph break) and its chunks are encoded and stored
`BATCH_CHUNKS` (or `BATCH_TOKENS`) at a time, then embedded for retrieval a few hundred at a
time; the plan keeps counts, not texts. `rag-kvcache bench memory` measures it.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from rag_kvcache.config import printable_path
from rag_kvcache.engine import DocumentIngest, RagKVCache, recorded_again
from rag_kvcache.errors import StoreError
from rag_kvcache.progress import PlannedShare
from rag_kvcache.storage.layout import MAX_SOURCE_CHARS

MAX_BYTES = 16 << 20  # larger files are reported and skipped (raise with --max-bytes)
SEGMENT_CHARS = 1 << 20  # text split at a time (a file's chunks never span two segments)
BATCH_CHUNKS = 32  # chunks encoded and stored at a time, at most
BATCH_TOKENS = 4096  # ... and tokens (16 of the CLI's 256-token chunks: ~190 MB of SmolLM2 KV)
READ_BYTES = 1 << 20
Splitter = Callable[[str], list[str]]


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class PlannedDocument:
    source: str  # the file's resolved path: the document's key in the catalog
    content_hash: str  # sha256 of the file's bytes when planned
    chunk_count: int  # its chunks (read again, a segment at a time, when ingested)


@dataclass
class IngestPlan:
    todo: list[PlannedDocument] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # run_ingest adds files gone bad since
    split: Splitter | None = None
    max_bytes: int = MAX_BYTES

    @property
    def total_chunks(self) -> int:
        return sum(d.chunk_count for d in self.todo)


class SkipFile(Exception):
    """A file that cannot be ingested; the message says why."""


def find_files(paths: Iterable[Path]) -> tuple[list[Path], list[Skipped]]:
    """Files named, and files under folders named (hidden entries skipped; symlinks followed,
    but a folder reached twice — a symlink loop — is walked once and reported)."""
    files: dict[Path, None] = {}
    skipped: list[Skipped] = []

    def unreadable(err: OSError) -> None:  # e.g. a path longer than the file system allows
        skipped.append(Skipped(printable_path(err.filename), f"cannot read: {err.strerror or err}"))

    for given in paths:
        path = Path(given).absolute()  # every path reported alike (files found are resolved)
        try:
            if path.is_file():
                _add_file(path, files, skipped)
            elif path.is_dir():
                seen: set[Path] = set()
                for folder, dirs, names in os.walk(path, followlinks=True, onerror=unreadable):
                    real = Path(folder).resolve()
                    if real in seen:
                        skipped.append(Skipped(folder, f"symlink loop (already walked {real})"))
                        dirs[:] = []
                        continue
                    seen.add(real)
                    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                    for name in sorted(names):
                        if not name.startswith("."):
                            _add_file(Path(folder, name), files, skipped)
            else:
                skipped.append(Skipped(printable_path(path), "no such file or folder"))
        except OSError as err:
            err.filename = err.filename or str(path)
            unreadable(err)
    return list(files), skipped


def _add_file(file: Path, files: dict[Path, None], skipped: list[Skipped]) -> None:
    try:
        if file.is_symlink() and not file.exists():
            target = printable_path(os.readlink(file))
            skipped.append(Skipped(printable_path(file), f"a broken symbolic link (to {target})"))
        elif not file.is_file():
            skipped.append(Skipped(printable_path(file), "not a regular file"))
        elif printable_path(file) != str(file):  # the catalog keeps a source as text
            skipped.append(Skipped(printable_path(file), "its name is not valid UTF-8: rename it"))
        elif len(source := str(file.resolve())) > MAX_SOURCE_CHARS:  # found now, not after
            long = f"its path is {len(source)} characters: at most {MAX_SOURCE_CHARS}"  # encoding
            skipped.append(Skipped(source, long))
        else:
            files[Path(source)] = None
    except OSError as err:
        skipped.append(Skipped(printable_path(file), f"cannot read: {err.strerror or err}"))


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> tuple[str, str]:
    """(text, sha256 of the bytes) of a text, Markdown or PDF file; SkipFile says why not."""
    digest = hashlib.sha256()
    text = "".join(_read_pieces(path, max_bytes, digest))
    if not text.strip():
        raise SkipFile("no text in it")
    return text, digest.hexdigest()


def _opened(path: Path, max_bytes: int) -> tuple[BinaryIO, int]:
    """The file open for reading and its size now: what is read of it, however it grows
    meanwhile (a live log appended faster than it is split was read for ever). SkipFile for
    anything but a regular file of 1 to `max_bytes` bytes; opened without blocking, so a file
    replaced by a FIFO since it was listed is said, not waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    f = os.fdopen(fd, "rb")
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise SkipFile("not a regular file")
        if status.st_size == 0:
            raise SkipFile("empty file")
        if status.st_size > max_bytes:
            raise SkipFile(f"{_size(status.st_size)} is over the {_size(max_bytes)} limit")
    except BaseException:
        f.close()
        raise
    return f, status.st_size


def _size(nbytes: int) -> str:
    """A file size as a person reads it (a 1000-byte limit was "0.0 MiB")."""
    if nbytes < 2**10:
        return f"{nbytes} bytes"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def _blocks(f: BinaryIO, size: int) -> Iterator[bytes]:
    """The file's first `size` bytes, READ_BYTES at a time."""
    while size > 0 and (block := f.read(min(READ_BYTES, size))):
        size -= len(block)
        yield block


def _read_pieces(path: Path, max_bytes: int, digest: Any) -> Iterator[str]:
    """The text of a file, a piece at a time as it is read, hashing its bytes into `digest`;
    SkipFile says why it cannot be ingested. NUL, no text's character (some PDFs' text holds
    it, and a text file past its first 8 KiB may), is dropped, as `ingest_document` drops it:
    a PostgreSQL catalog cannot keep it."""
    for piece in _decoded(path, max_bytes, digest):
        yield piece.replace("\x00", "")


def _decoded(path: Path, max_bytes: int, digest: Any) -> Iterator[str]:
    f, size = _opened(path, max_bytes)
    with f:
        blocks = _blocks(f, size)
        block = next(blocks, b"")
        if block.startswith(b"%PDF"):  # parsed from the bytes read (hashed), not the path again
            data = io.BytesIO()
            while block:
                digest.update(block)
                data.write(block)
                block = next(blocks, b"")
            yield from _pdf_pages(data)
            return
        if path.suffix.lower() == ".pdf":  # (a download's error page saved as one, say)
            raise SkipFile("named .pdf but not a PDF (it does not start with %PDF)")
        if block.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):  # (before UTF-16's:
            raise SkipFile("UTF-32 text, not UTF-8: save it as UTF-8")  # UTF-32-LE's starts so)
        if block.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # (its NULs said
            raise SkipFile("UTF-16 text, not UTF-8: save it as UTF-8")  # "binary file")
        if b"\x00" in block[:8192]:
            raise SkipFile("binary file")
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        if block.startswith(codecs.BOM_UTF8):
            digest.update(block[:3])
            block, offset = block[3:], 3
        while True:
            digest.update(block)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = offset + e.start - len(decoder.getstate()[0])
                raise SkipFile(f"not UTF-8 text (invalid byte at offset {at})") from None
            if text:
                yield text
            if not block:
                return
            offset += len(block)
            block = next(blocks, b"")


def _segments(pieces: Iterable[str]) -> Iterator[str]:
    """The text regrouped into segments of about SEGMENT_CHARS, each cut after a paragraph
    break (else a line break), so a splitter never holds a whole big file."""
    buffer = ""
    for piece in pieces:
        buffer += piece
        while len(buffer) >= SEGMENT_CHARS:
            cut = buffer.rfind("\n\n", 0, SEGMENT_CHARS) + 2
            if cut < 2:
                cut = buffer.rfind("\n", 0, SEGMENT_CHARS) + 1
            cut = cut or SEGMENT_CHARS
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def iter_chunks(path: Path, split: Splitter, max_bytes: int, digest: Any) -> Iterator[str]:
    """The file's non-blank chunks, read and split a segment at a time (SkipFile, OSError)."""
    for segment in _segments(_read_pieces(path, max_bytes, digest)):
        yield from (c for c in split(segment) if c.strip())


def _pdf_pages(data: BinaryIO) -> Iterator[str]:
    """The text of each page, pages apart by a paragraph break."""
    try:
        from pypdf import PdfReader
        from pypdf.errors import PyPdfError
    except ImportError:
        raise SkipFile("PDF, and no PDF reader is installed (pip install pypdf)") from None
    try:
        for number, page in enumerate(PdfReader(data).pages):
            yield ("\n\n" if number else "") + (page.extract_text() or "")
    except (PyPdfError, ValueError, KeyError) as e:
        raise SkipFile(f"unreadable PDF ({e})") from None


def plan_ingest(
    engine: RagKVCache,
    paths: Iterable[Path],
    split: Splitter,
    max_bytes: int = MAX_BYTES,
    on_file: Callable[[], None] | None = None,
) -> IngestPlan:
    """Find the files that are new or changed since they were last ingested, and count their
    chunks (read and split a segment at a time; the texts are not kept)."""
    files, skipped = find_files(paths)
    plan = IngestPlan(skipped=skipped, split=split, max_bytes=max_bytes)
    catalog = engine.corpus.catalog
    for path in files:
        if on_file:
            on_file()
        source = str(path)
        try:
            digest = _file_digest(path, max_bytes)
            known = catalog.document(source)
            if (
                known is not None
                and known.content_hash == digest
                and len(catalog.document_chunks(source)) == known.chunk_count
                and catalog.document_models(source) <= {engine.lm.fingerprint}  # not another's
            ):
                plan.unchanged.append(source)
                continue
            count = sum(1 for _ in iter_chunks(path, split, max_bytes, hashlib.sha256()))
        except SkipFile as e:
            plan.skipped.append(Skipped(source, str(e)))
            continue
        except StoreError:  # the store's fault (a full disk), not the file's: stop here
            raise
        except OSError as e:
            plan.skipped.append(Skipped(source, f"cannot read: {e.strerror or e}"))
            continue
        if not count:
            plan.skipped.append(Skipped(source, "no text in it"))
            continue
        plan.todo.append(PlannedDocument(source, digest, count))
    return plan


def _file_digest(path: Path, max_bytes: int) -> str:
    """sha256 of a file's bytes (read in blocks), after the size checks."""
    digest = hashlib.sha256()
    f, size = _opened(path, max_bytes)
    with f:
        for block in _blocks(f, size):
            digest.update(block)
    return digest.hexdigest()


def run_ingest(
    engine: RagKVCache,
    plan: IngestPlan,
    on_encoded: Callable[[int], None] | None = None,
    on_dropped: Callable[[int], None] | None = None,
) -> list[DocumentIngest]:
    """Encode, store and index each planned document (recorded in one catalog transaction
    each); a file that went bad since it was planned is added to `plan.skipped`.
    `on_encoded` is told each document's planned chunks, however many it has by now
    (`PlannedShare`), so that its calls add up to `plan.total_chunks`; with `on_dropped`, the
    planned chunks that never came (a file skipped, or shorter than planned) are told to it
    instead, so that `on_encoded` counts only chunks done (a progress bar's rate)."""
    done = []
    for document in plan.todo:
        share = PlannedShare(document.chunk_count, on_encoded, on_dropped)
        try:
            # (tried again: the file read again, its chunks still stored not encoded again)
            done.append(recorded_again(partial(_ingest_document, engine, plan, document, share)))
        except SkipFile as e:
            plan.skipped.append(Skipped(document.source, str(e)))
        except StoreError:  # a full disk fails every file after it too: stop, and say so
            raise
        except OSError as e:
            plan.skipped.append(Skipped(document.source, f"cannot read: {e.strerror or e}"))
        share.finish()
    return done


def _ingest_document(
    engine: RagKVCache,
    plan: IngestPlan,
    document: PlannedDocument,
    on_encoded: Callable[[int], None] | None,
) -> DocumentIngest:
    """`engine.ingest_document` a batch at a time: the file is read again, split a segment at
    a time, and its chunks encoded and stored BATCH_CHUNKS at a time."""
    assert plan.split is not None, "plan_ingest makes plans"
    start, digest = time.perf_counter(), hashlib.sha256()
    chunks = iter_chunks(Path(document.source), plan.split, plan.max_bytes, digest)
    tokenized = ((engine.template.chunk_ids(engine.lm.tokenizer, t), t) for t in chunks)
    ids: list[str] = []
    encoded = 0
    for batch in _batches(tokenized):
        tokens, texts = [b[0] for b in batch], [b[1] for b in batch]
        batch_ids, n = engine.cache_token_ids(tokens, engine.doc_settings, texts, on_encoded)
        ids += batch_ids
        encoded += n
    if not ids:
        raise SkipFile("no text in it")
    encode_s = time.perf_counter() - start
    removed = engine.corpus.set_document(document.source, digest.hexdigest(), ids)
    return DocumentIngest(document.source, tuple(ids), encoded, len(removed), encode_s)


def _batches(chunks: Iterator[tuple[list[int], str]]) -> Iterator[list[tuple[list[int], str]]]:
    """Chunks grouped until a group holds BATCH_CHUNKS chunks or BATCH_TOKENS tokens: what
    is encoded and held in memory at a time, bounded whatever the chunk size."""
    batch: list[tuple[list[int], str]] = []
    tokens = 0
    for chunk in chunks:
        batch.append(chunk)
        tokens += len(chunk[0])
        if len(batch) >= BATCH_CHUNKS or tokens >= BATCH_TOKENS:
            yield batch
            batch, tokens = [], 0
    if batch:
        yield batch


def prune(engine: RagKVCache, paths: Iterable[Path]) -> list[str]:
    """Remove documents whose file under one of `paths` no longer exists; returns their sources.
    A path that does not exist itself prunes nothing (a typo, an unmounted folder)."""
    roots = [p.resolve() for p in paths if p.exists()]
    gone = []
    for doc in engine.corpus.catalog.documents():
        source = Path(doc.source)
        under = any(source.is_relative_to(r) for r in roots)  # a file path counts too
        if under and not source.exists():
            engine.remove_document(doc.source)
            gone.append(doc.source)
    return gone
