"""The `rag-kvcache` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from rag_kvcache.storage.store import TieredStore


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


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
    ttft.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    store = kinds.add_parser("store", help="store latency per tier, TTFT from each tier")
    store.add_argument("--out", type=Path, default=Path("bench-results"))
    store.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"])
    store.add_argument("--context", type=int, default=4096)
    store.add_argument("--repeats", type=int, default=3)
    store.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")

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


def _open_store(args: argparse.Namespace, with_model: bool = False) -> TieredStore:
    from rag_kvcache.config import EngineConfig, StoreConfig
    from rag_kvcache.storage.store import TieredStore

    config = StoreConfig(args.store, catalog_url=args.catalog_url, redis_url=args.redis_url)
    if with_model:
        from rag_kvcache.engine import RagKVCache

        store = RagKVCache(EngineConfig(store=config)).store
        assert isinstance(store, TieredStore)
        return store
    return TieredStore(
        config.root or Path(), catalog_url=config.catalog_url, redis_url=config.redis_url
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
        for tier, nbytes in sorted(stats.bytes_per_tier.items()):
            table.add_row(f"bytes on {tier}", f"{nbytes / 2**20:.1f} MiB")
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
            f"{len(report.missing)} missing, {report.repaired} repaired"
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
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command in ("stats", "verify", "gc"):
        return store_command(args, console)
    if args.command == "bench" and args.kind == "store":
        from rag_kvcache.bench_store import run_store_bench

        report = run_store_bench(
            args.out, args.dtypes, args.context, repeats=args.repeats, redis_url=args.redis_url
        )
        table = Table(
            "dtype",
            "from",
            "put ms/chunk",
            "get ms/chunk",
            "TTFT s",
            "vs cpu",
            "speedup",
            "bytes/token",
        )
        for row in report["rows"]:  # type: ignore[attr-defined]
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            table.add_row(
                row["dtype"],
                row["tier"],
                fmt(row["put_ms_per_chunk"], ".1f"),
                fmt(row["get_ms_per_chunk"], ".1f"),
                f"{row['ttft_s']:.3f}",
                fmt(row["ttft_vs_cpu"], ".2f"),
                f"{row['speedup_vs_prefill']:.1f}x",
                f"{row['bytes_per_token']:.0f}",
            )
        console.print(table)
        console.print(f"wrote {args.out / 'store.json'} and {args.out / 'store.png'}")
        return 0
    if args.command == "bench" and args.kind == "ttft":
        from rag_kvcache.bench import run_ttft_bench

        report = run_ttft_bench(
            args.out,
            args.dtypes,
            [int(c) for c in args.contexts],
            args.strategies,
            repeats=args.repeats,
            model_path=args.model,
        )
        table = Table("dtype", "context", "strategy", "TTFT s", "speedup", "recomputed")
        for row in report["rows"]:  # type: ignore[attr-defined]
            table.add_row(
                row["dtype"],
                str(row["context_tokens"]),
                row["strategy"],
                f"{row['ttft_s']:.3f}",
                f"{row['speedup']:.1f}x",
                str(row["recomputed_tokens"]),
            )
        console.print(table)
        console.print(f"wrote {args.out / 'ttft.json'} and {args.out / 'ttft.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
