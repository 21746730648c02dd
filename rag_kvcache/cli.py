"""The `rag-kvcache` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
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
