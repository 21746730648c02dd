"""The `rag-kvcache` command: parse, then run the chosen command. Each command group adds its
own parsers and sets the function that runs it; a RagKVCacheError becomes one clear line.
Parsing imports nothing heavy (no torch): `--help` and `--version` answer at once."""

from __future__ import annotations

import argparse

from rich.console import Console

from rag_kvcache.tools.cli import calibration, documents, markup, measure, serve, store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-kvcache",
        description="Encode RAG chunks' KV once; answer from the linked cache.",
    )
    parser.add_argument("--version", action="version", version=f"rag-kvcache {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in (measure, calibration, documents, markup, store, serve):
        group.add_parsers(commands)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rag-kvcache")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    from rag_kvcache.errors import RagKVCacheError

    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return int(args.run(args, console))
    except RagKVCacheError as e:  # bad input: say what and why, no traceback
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 1
