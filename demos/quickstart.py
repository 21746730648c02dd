"""Quickstart: ingest the sample documents (KV-encoded once, kept in a durable store), then
answer questions from retrieved, cached chunks.

For each question it prints the time to first token with the retrieved chunks linked from the
cache next to a full prefill of the very same prompt (the same chunks in the same placement),
both answers, and the sources. A second
run finds every document unchanged and encodes nothing. Run with `make demo`.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rag_kvcache import Answer, EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig, default_cache_dir
from rag_kvcache.ingest import plan_ingest, run_ingest
from rag_kvcache.integrations.llama_index.splitter import split_text
from rag_kvcache.retrieval.index import Retrieved

DATA = Path(__file__).resolve().parent / "data"
STORE = default_cache_dir() / "demo-store"
TOP_K = 8
QUESTIONS = [
    "Who is the current Harbor Reeve of Velmora?",
    "Which engineer led the team that designed the TK-7 tidal spectrometer?",
    "How long is the full Saltreach shipping route in nautical miles?",
]


def main() -> None:
    console = Console()
    start = time.perf_counter()
    config = EngineConfig(
        store=StoreConfig(root=STORE), generation=GenerationConfig(max_new_tokens=40)
    )
    engine = RagKVCache(config)
    console.print(
        f"model {engine.lm.name} ({engine.lm.dtype}) loaded in {time.perf_counter() - start:.1f} s"
        f"; store {STORE}"
    )

    plan = plan_ingest(engine, [DATA], split_text(engine.lm.tokenizer, chunk_tokens=256))
    columns = (
        TextColumn("encoding chunks"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    # (nothing to encode on a second run: no "0/0" bar)
    with Progress(*columns, console=console, disable=not plan.total_chunks) as progress:
        task = progress.add_task("encode", total=plan.total_chunks)
        done = run_ingest(engine, plan, on_encoded=lambda n: progress.advance(task, n))
    encoded = sum(d.encoded for d in done)
    encode_s = sum(d.encode_s for d in done)
    rate = f": {encoded / encode_s:.1f} chunks/s" if encoded else ""
    console.print(
        f"{len(done)} document{'s' * (len(done) != 1)} ingested ({encoded} chunks encoded{rate}), "
        f"{len(plan.unchanged)} unchanged; store holds {engine.store.nbytes() / 2**20:.0f} MiB"
    )

    strategy = engine.config.strategy
    # one short answer each way first: a process's first forwards set up their kernels, which
    # the first timings below would otherwise pay
    warm = [h.cache_id for h in engine.retrieve(QUESTIONS[0], TOP_K)]
    for way in (strategy, strategy.baseline):
        engine.generate(QUESTIONS[0], warm, strategy=way, max_new_tokens=1)
    for question in QUESTIONS:
        hits, cached, full = ask(engine, question)
        table = Table(title=f"{question}  ({cached.prompt_tokens} prompt tokens)")
        table.add_column("prompt from", overflow="fold")  # (the default's long name whole)
        table.add_column("TTFT", justify="right")
        table.add_column("answer")
        table.add_row(f"cached chunks, {strategy}", f"{cached.ttft_s:.2f} s", cached.text)
        table.add_row(f"full prefill, {strategy.baseline}", f"{full.ttft_s:.2f} s", full.text)
        console.print(table)
        sources = sorted({Path(h.source or "?").name for h in hits})
        same = cached.text == full.text
        answers = "the same answer word for word" if same else "answers worded apart: see above"
        console.print(
            f"time to first token: {sooner(full.ttft_s, cached.ttft_s)} "
            f"({cached.recomputed_tokens} of {cached.context_tokens} context tokens "
            f"recomputed); {answers}; {TOP_K} chunks from {', '.join(sources)}\n"
        )
    console.print(
        f"{strategy.baseline}: a plain prefill of the very same prompt (the same chunks in the "
        "same placement). One timing each: on a busy machine they vary."
    )


def sooner(prefill_s: float, cached_s: float) -> str:
    """The cache's speedup over the prefill, in words that stay true when it is slower."""
    ratio = prefill_s / max(cached_s, 1e-9)
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower (a busy machine?)"


def ask(engine: RagKVCache, question: str) -> tuple[list[Retrieved], Answer, Answer]:
    """The retrieved chunks, the answer from them linked from the cache (the engine's default
    strategy) and the answer after a full prefill of the very same prompt."""
    hits = engine.retrieve(question, TOP_K)
    cache_ids = [h.cache_id for h in hits]
    strategy = engine.config.strategy
    cached = engine.generate(question, cache_ids, strategy=strategy)
    full = engine.generate(question, cache_ids, strategy=strategy.baseline)
    return hits, cached, full


if __name__ == "__main__":
    main()
