"""The `rag-kvcache` command: parse, then run the chosen command. Each command group adds its
own parsers and sets the function that runs it; a RagKVCacheError becomes one clear line."""

from __future__ import annotations

import argparse

from rich.console import Console

from rag_kvcache.tools.cli import calibration, documents, markup, measure, serve, store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-kvcache",
        description="Encode RAG chunks' KV once; answer from the linked cache.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for group in (measure, calibration, documents, markup, store, serve):
        group.add_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rag_kvcache.errors import RagKVCacheError

    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return int(args.run(args, console))
    except RagKVCacheError as e:  # bad input: say what and why, no traceback
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 1
