"""`rag-kvcache bench ingest`: ingestion throughput per dtype, on the sample corpus.

Each repeat ingests the corpus into a fresh store (read, split into LM-token chunks, KV-encode,
write blobs + catalog rows, embed and index), so nothing is reused between repeats. Reports
chunks/s and tokens/s for the whole pipeline and for the KV encoding alone, and the bytes of
KV stored per token. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.progress import Progress

from rag_kvcache.config import EngineConfig, ModelConfig, StoreConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.ingest import plan_ingest, run_ingest
from rag_kvcache.integrations.llama_index.splitter import split_text
from rag_kvcache.model.loading import load_model
from rag_kvcache.samples import sample_corpus_dir
from rag_kvcache.tools.bench.report import save_report


@dataclass(frozen=True)
class IngestRow:
    dtype: str
    documents: int
    chunks: int
    tokens: int
    seconds: float  # median whole-pipeline time over repeats
    encode_seconds: float  # median time inside the KV encoder alone
    chunks_per_s: float
    tokens_per_s: float
    encode_chunks_per_s: float
    kv_bytes_per_token: float


def bench_dtype(
    dtype: str, paths: list[Path], chunk_tokens: int, repeats: int, tmp: Path
) -> IngestRow:
    lm = load_model(ModelConfig(dtype=dtype))
    split = split_text(lm.tokenizer, chunk_tokens)
    runs, encode_runs = [], []
    for repeat in range(repeats):
        root = tmp / f"{dtype}-{repeat}"
        engine = RagKVCache(EngineConfig(store=StoreConfig(root=root)), lm=lm)
        engine.corpus  # noqa: B018 (loads the embedding model outside the timing)
        start = time.perf_counter()
        plan = plan_ingest(engine, paths, split)
        done = run_ingest(engine, plan)
        runs.append(time.perf_counter() - start)
        encode_runs.append(sum(d.encode_s for d in done))
        # chunks and tokens as the documents list them (a repeated chunk is cached once but
        # counted as often as it comes: tokens had counted it once, so could be fewer than
        # chunks); the KV bytes per token stored are of the chunks stored, each once, as
        # their blobs hold them (the store's bytes less the system prefix's in memory went
        # negative for a corpus of few distinct chunks)
        listed = [c for d in done for c in d.cache_ids]
        rows = engine.corpus.catalog.chunks(listed)
        chunks, tokens = len(listed), sum(rows[c].token_count for c in listed)
        stored_tokens = sum(r.token_count for r in rows.values())
        nbytes = sum(r.nbytes for r in rows.values())
    if not chunks:  # nothing to divide by
        raise ConfigError(
            f"no text to ingest in {', '.join(map(str, paths))}: empty, binary or unreadable files"
        )
    seconds, encode_seconds = statistics.median(runs), statistics.median(encode_runs)
    return IngestRow(
        dtype=dtype,
        documents=len(done),
        chunks=chunks,
        tokens=tokens,
        seconds=seconds,
        encode_seconds=encode_seconds,
        chunks_per_s=chunks / seconds,
        tokens_per_s=tokens / seconds,
        encode_chunks_per_s=chunks / encode_seconds,
        kv_bytes_per_token=nbytes / stored_tokens,
    )


def run_ingest_bench(
    out_dir: Path,
    dtypes: list[str],
    paths: list[Path] | None = None,
    chunk_tokens: int = 256,
    repeats: int = 3,
) -> dict[str, object]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = paths or [sample_corpus_dir()]
    if missing := [str(p) for p in paths if not p.exists()]:  # before any model loads
        raise ConfigError(f"nothing at {', '.join(missing)}: give files or folders to ingest")
    rows: list[IngestRow] = []
    report: dict[str, object] = {}
    with Progress() as progress, tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        task = progress.add_task("ingest bench", total=len(dtypes))
        for dtype in dtypes:
            rows.append(bench_dtype(dtype, paths, chunk_tokens, repeats, Path(tmp)))
            report = save_report(  # after each dtype: a stopped run keeps what it measured
                out_dir,
                "ingest",
                rows,
                lambda path: plot_ingest(rows, path),
                complete=len(rows) == len(dtypes),
                corpus=[str(p) for p in paths],
                chunk_tokens=chunk_tokens,
                repeats=repeats,
            )
            progress.advance(task)
    return report


def plot_ingest(rows: list[IngestRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.dtype for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.chunks_per_s for r in rows], 0.4, label="whole pipeline")
    ax.bar(
        [i + 0.2 for i in x], [r.encode_chunks_per_s for r in rows], 0.4, label="KV encode + store"
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("chunks / s")
    ax.set_title(f"ingestion throughput ({rows[0].chunks} chunks, {rows[0].tokens} tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
