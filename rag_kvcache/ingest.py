"""Ingest files: find them, read them (text, Markdown, PDF), split, KV-encode, index.

Two steps, so a progress bar can know the total before the slow part: `plan_ingest` reads and
splits every new or changed file (bad files are reported, never fatal), `run_ingest` encodes
and records them one document at a time. A document is recorded (content hash + chunk list, one
transaction) only after all its chunks are stored, so an interrupted run resumes where it
stopped: chunks already stored are not encoded again, unchanged documents are skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rag_kvcache.engine import DocumentIngest, RagKVCache

MAX_BYTES = 16 << 20  # larger files are reported and skipped (raise with --max-bytes)
Splitter = Callable[[str], list[str]]


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class PlannedDocument:
    source: str  # the file's resolved path: the document's key in the catalog
    content_hash: str  # sha256 of the file's bytes
    chunks: list[str]


@dataclass
class IngestPlan:
    todo: list[PlannedDocument] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def total_chunks(self) -> int:
        return sum(len(d.chunks) for d in self.todo)


class SkipFile(Exception):
    """A file that cannot be ingested; the message says why."""


def find_files(paths: Iterable[Path]) -> tuple[list[Path], list[Skipped]]:
    """Files named, and files under folders named (hidden entries skipped; symlinks followed,
    but a folder reached twice — a symlink loop — is walked once and reported)."""
    files: dict[Path, None] = {}
    skipped: list[Skipped] = []
    for path in paths:
        if path.is_file():
            files[path.resolve()] = None
        elif path.is_dir():
            seen: set[Path] = set()
            for folder, dirs, names in os.walk(path, followlinks=True):
                real = Path(folder).resolve()
                if real in seen:
                    skipped.append(Skipped(folder, f"symlink loop (already walked {real})"))
                    dirs[:] = []
                    continue
                seen.add(real)
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if not name.startswith("."):
                        file = Path(folder, name)
                        if file.is_file():
                            files[file.resolve()] = None
                        else:
                            skipped.append(Skipped(str(file), "not a regular file"))
        else:
            skipped.append(Skipped(str(path), "no such file or folder"))
    return list(files), skipped


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> tuple[str, str]:
    """(text, sha256 of the bytes) of a text, Markdown or PDF file; SkipFile says why not."""
    size = path.stat().st_size
    if size == 0:
        raise SkipFile("empty file")
    if size > max_bytes:
        raise SkipFile(f"{size / 2**20:.1f} MiB is over the {max_bytes / 2**20:.1f} MiB limit")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if data.startswith(b"%PDF"):
        text = _pdf_text(path)
    elif b"\x00" in data[:8192]:
        raise SkipFile("binary file")
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SkipFile(f"not UTF-8 text (invalid byte at offset {e.start})") from None
    if not text.strip():
        raise SkipFile("no text in it")
    return text, digest


def _pdf_text(path: Path) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PyPdfError
    except ImportError:
        raise SkipFile("PDF, and no PDF reader is installed (pip install pypdf)") from None
    try:
        return "\n\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    except (PyPdfError, ValueError, KeyError) as e:
        raise SkipFile(f"unreadable PDF ({e})") from None


def plan_ingest(
    engine: RagKVCache,
    paths: Iterable[Path],
    split: Splitter,
    max_bytes: int = MAX_BYTES,
    on_file: Callable[[], None] | None = None,
) -> IngestPlan:
    """Read and split the files that are new or changed since they were last ingested."""
    files, skipped = find_files(paths)
    plan = IngestPlan(skipped=skipped)
    catalog = engine.corpus.catalog
    for path in files:
        if on_file:
            on_file()
        source = str(path)
        try:
            text, digest = read_text(path, max_bytes)
        except SkipFile as e:
            plan.skipped.append(Skipped(source, str(e)))
            continue
        except OSError as e:
            plan.skipped.append(Skipped(source, f"cannot read: {e.strerror or e}"))
            continue
        known = catalog.document(source)
        if (
            known is not None
            and known.content_hash == digest
            and len(catalog.document_chunks(source)) == known.chunk_count
        ):
            plan.unchanged.append(source)
            continue
        chunks = [c for c in split(text) if c.strip()]
        if not chunks:
            plan.skipped.append(Skipped(source, "no text in it"))
            continue
        plan.todo.append(PlannedDocument(source, digest, chunks))
    return plan


def run_ingest(
    engine: RagKVCache, plan: IngestPlan, on_encoded: Callable[[int], None] | None = None
) -> list[DocumentIngest]:
    """Encode, store and index each planned document (one catalog transaction each)."""
    return [
        engine.ingest_document(d.source, d.chunks, d.content_hash, on_encoded) for d in plan.todo
    ]


def prune(engine: RagKVCache, paths: Iterable[Path]) -> list[str]:
    """Remove documents whose file under one of `paths` no longer exists; returns their sources."""
    roots = [p.resolve() for p in paths]
    gone = []
    for doc in engine.corpus.catalog.documents():
        source = Path(doc.source)
        under = any(source.is_relative_to(r) for r in roots)  # a file path counts too
        if under and not source.exists():
            engine.remove_document(doc.source)
            gone.append(doc.source)
    return gone
