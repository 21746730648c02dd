"""`rag-kvcache bench memory`: peak memory of `rag-kvcache ingest` against the file's size.

Ingestion streams (a file is read and split a segment at a time, its chunks encoded and stored a
batch at a time), so its peak memory should not grow with the file. This benchmark checks it as
users run it: for each size it writes a text file of invented paragraphs, runs the `ingest`
command on it in a fresh process, and reads that process's peak resident memory from the kernel
(`wait4`'s ru_maxrss). Files of tens of MB are ~10M tokens: hours of encoding and hundreds of GB
of KV with SmolLM2 on a CPU, so the large sizes run with a random-weight model of the same
pipeline (`--model random:tiny`) and SmolLM2 at the sizes a CPU encodes in minutes. Results for
several models gather in one JSON (a row is replaced when the same model and size run again).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.progress import Progress

from rag_kvcache.errors import ConfigError, RagKVCacheError
from rag_kvcache.samples import sample_corpus_dir
from rag_kvcache.tools.bench import MIN_FILE_MB
from rag_kvcache.tools.bench.report import save_report

MB = 1 << 20
TARGET_MB = 2048  # the peak an ingest of any size may reach with the default model


@dataclass(frozen=True)
class MemoryRow:
    model: str  # as given to --model ("default": SmolLM2)
    dtype: str
    file_mb: float
    chunks: int
    seconds: float  # the whole command, model loading included
    peak_rss_mb: float  # the ingest process's peak resident memory
    store_mb: float  # what it wrote (KV blobs, catalog, index)

    def __post_init__(self) -> None:
        """Rows read back from an earlier report (`load_rows`) are of these kinds, or that
        report is refused: a size of "5" failed the plot after the new row was measured."""
        if not (isinstance(self.model, str) and isinstance(self.dtype, str)):
            raise TypeError(f"model and dtype must be text, not {self.model!r}, {self.dtype!r}")
        numbers = (self.file_mb, self.chunks, self.seconds, self.peak_rss_mb, self.store_mb)
        if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
            raise TypeError(f"sizes, counts and times must be numbers, not {numbers}")
        if not all(0 <= n < math.inf for n in numbers) or not isinstance(self.chunks, int):
            raise ValueError(f"sizes, counts and times must be finite and >= 0, not {numbers}")


def write_text(path: Path, nbytes: int, seed: int = 0) -> None:
    """About nbytes of paragraphs of words drawn from the sample corpus (so they tokenize like
    prose), written as they are made. Random, so no two chunks are the same and none is
    deduplicated away."""
    corpus = " ".join(p.read_text() for p in sorted(sample_corpus_dir().glob("*.md")))
    words = sorted(set(re.findall(r"[A-Za-z]+", corpus)))
    rng = random.Random(seed)
    written = 0
    with path.open("w", encoding="utf-8") as out:
        while written < nbytes:
            sentences = (
                " ".join(rng.choices(words, k=rng.randint(8, 20))).capitalize() + "."
                for _ in range(rng.randint(3, 8))
            )
            paragraph = " ".join(sentences) + "\n\n"
            out.write(paragraph)
            written += len(paragraph)


def measure(file: Path, store: Path, model: str, dtype: str) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of `rag-kvcache ingest FILE` in a fresh process."""
    command = [sys.executable, "-m", "rag_kvcache.tools.cli", "ingest", str(file)]
    command += ["--store", str(store), "--dtype", dtype, "--max-bytes", str(1 << 40)]
    if model != "default":
        command += ["--model", model]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert child.stdout is not None
    try:
        output = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
    except BaseException:  # interrupted: the ingest must not go on writing into the temporary
        child.kill()  # folder being removed (a Ctrl-C in a terminal reaches it too; a SIGTERM
        child.wait()  # to this process does not)
        raise
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        last = (output.decode(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        raise RagKVCacheError(  # the measured command's own error, as one line
            f"the measured `rag-kvcache ingest` of {file.name} exited with {child.returncode}: "
            f"{last}"
        )
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def stored_chunks(store: Path) -> int:
    from rag_kvcache.storage.catalog import Catalog
    from rag_kvcache.storage.layout import CATALOG_FILE

    catalog = Catalog(path=store / CATALOG_FILE, create=False)
    try:
        return sum(d.chunk_count for d in catalog.documents())
    finally:
        catalog.close()


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / MB


def check_room(folder: Path, size_mb: float, rows: list[MemoryRow], model: str, dtype: str) -> None:
    """A ConfigError, before the file is written, where this size's store would not fit on the
    disk: rows already measured with this model and dtype say how many MB of store a MB of text
    makes (~8,400 for SmolLM2 in float32). Without one, nothing is known: the ingest's own
    full-disk error says it, after its run."""
    same = [r for r in rows if (r.model, r.dtype) == (model, dtype) and r.file_mb > 0]
    ratios = [r.store_mb / r.file_mb for r in same if r.store_mb > 0]
    if not ratios:
        return
    needed_mb = max(ratios) * size_mb + size_mb  # its store, and the text file beside it
    free_mb = shutil.disk_usage(folder).free / MB
    if needed_mb > free_mb:
        raise ConfigError(
            f"a {size_mb} MB file makes about {needed_mb / 1024:.1f} GB of KV with {model} in "
            f"{dtype} (as measured at smaller sizes), and {folder} has {free_mb / 1024:.1f} GB "
            "free: give smaller --sizes-mb, or an --out on a bigger disk"
        )


def run_memory_bench(
    out_dir: Path, sizes_mb: list[float], model: str = "default", dtype: str = "float32"
) -> dict[str, object]:
    if bad := [s for s in sizes_mb if not MIN_FILE_MB <= s < math.inf]:  # (NaN too)
        raise ConfigError(f"file sizes must be finite, from {MIN_FILE_MB} MB, not {bad}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = load_rows(out_dir / "memory.json")
    report: dict[str, object] = {}
    with Progress() as progress, tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        task = progress.add_task(f"ingest memory ({model})", total=len(sizes_mb))
        for done, size in enumerate(sizes_mb, 1):
            file, store = Path(tmp) / f"{size}mb.md", Path(tmp) / "store"
            check_room(out_dir, size, rows, model, dtype)  # (rows: this run's too)
            write_text(file, int(size * MB))
            seconds, peak = measure(file, store, model, dtype)
            row = MemoryRow(
                model, dtype, size, stored_chunks(store), seconds, peak, folder_mb(store)
            )
            file.unlink()
            shutil.rmtree(store)  # a 50 MB file's KV is several GB even with a small model
            # the same model, dtype and size measured again replaces its row; the others stay
            rows = [r for r in rows if (r.model, r.dtype, r.file_mb) != (model, dtype, size)]
            rows = sorted([*rows, row], key=lambda r: (r.model, r.dtype, r.file_mb))
            # written after each size: an interrupted run keeps the sizes it measured
            report = save_report(
                out_dir,
                "memory",
                rows,
                partial(plot_memory, rows),
                target_mb=TARGET_MB,
                complete=done == len(sizes_mb),
            )
            progress.advance(task)
    return report


def load_rows(path: Path) -> list[MemoryRow]:
    """The rows of an earlier run in the same folder (other models' and sizes' are kept)."""
    if not path.exists():
        return []
    try:
        return [MemoryRow(**row) for row in json.loads(path.read_text(encoding="utf-8"))["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as e:  # (JSON and Unicode errors too)
        raise ConfigError(
            f"{path} is not a memory report to add rows to ({type(e).__name__}): move it away, "
            "or give another --out"
        ) from None


def plot_memory(rows: list[MemoryRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model, dtype in sorted({(r.model, r.dtype) for r in rows}):
        mine = [r for r in rows if (r.model, r.dtype) == (model, dtype)]
        name = "SmolLM2-135M" if model == "default" else model
        ax.plot(
            [r.file_mb for r in mine], [r.peak_rss_mb for r in mine], "o-", label=f"{name} {dtype}"
        )
    ax.axhline(TARGET_MB, color="gray", linestyle="--", label="2 GiB")
    ax.set_xscale("log")
    ax.set_ylim(0, max(TARGET_MB, *(r.peak_rss_mb for r in rows)) * 1.15)
    ax.set_xlabel("file size (MB of text)")
    ax.set_ylabel("peak RSS of `rag-kvcache ingest` (MiB)")
    ax.set_title("peak memory of an ingest against the file's size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
