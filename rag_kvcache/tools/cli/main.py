"""The `rag-kvcache` command: parse, then run the chosen command. Each command group adds its
own parsers and sets the function that runs it; a RagKVCacheError becomes one clear line.
Parsing imports nothing heavy (no torch): `--help` and `--version` answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from rag_kvcache.tools.cli import calibration, documents, markup, measure, serve, store
from rag_kvcache.tools.cli.common import close_opened, output_folder, terminate_as_ctrl_c


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it has none (None, off) or the help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if default is None or default is False or default is argparse.SUPPRESS:
            return action.help
        if "default" in text or not action.option_strings:
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


# what the options that many commands share mean, said once
SHARED_HELP = {
    "--store": "the store's folder",
    "--dtype": "the model's compute dtype",
    "--dtypes": "compute dtypes measured, comma-separated",
    "--out": "folder for the results (JSON and plots)",
    "--max-new-tokens": "answer length cap, in tokens",
    "--new-tokens": "tokens generated per request",
    "--repeats": "timed runs of each case",
    "--contexts": "context lengths in tokens, comma-separated",
    "--seed": "random seed (default: a fixed one)",
}


class CommandParser(argparse.ArgumentParser):
    """A command's parser (and its subcommands'): defaults shown in its help, and the shared
    options' help written once (`SHARED_HELP`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        if "help" not in kwargs and names and names[0] in SHARED_HELP:
            kwargs["help"] = SHARED_HELP[names[0]]
        return super().add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rag-kvcache",
        description="Encode RAG chunks' KV once; answer from the linked cache.",
    )
    parser.add_argument("--version", action="version", version=f"rag-kvcache {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
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
    import logging
    import os

    from rich.markup import escape

    from rag_kvcache.errors import RagKVCacheError

    args = build_parser().parse_args(argv)
    # our progress display only: no Hugging Face bars ("Loading weights", downloads), read
    # when transformers is first imported, which is after this
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # a damaged PDF is skipped and its reason listed; pypdf's own warnings about it were
    # printed above the progress and the table, unasked
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    console = Console()
    try:
        with terminate_as_ctrl_c():  # closing too: held there as a Ctrl-C is (ctrl_c_held)
            try:
                if isinstance(out := getattr(args, "out", None), Path):
                    output_folder(out)
                return int(args.run(args, console))
            finally:  # (a Ctrl-C meanwhile is caught below too)
                close_opened(args)
    except RagKVCacheError as e:  # bad input: say what and why, no traceback
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)  # text, not markup
        return 1
    except OSError as e:  # the machine's answer: a full disk, a folder that cannot be written
        where = f" ({e.filename})" if e.filename else ""
        console.print(f"[red]error:[/red] {escape(str(e.strerror or e) + where)}", highlight=False)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what was stored is kept (each write is whole)
        console.print("[red]interrupted[/red]", highlight=False)
        return 130
