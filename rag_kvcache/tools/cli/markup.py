"""`schema add|list` and `prompt`: Prompt Cache schemas encoded into the store, prompts answered."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rag_kvcache.tools.cli.common import engine_options, open_engine


def add_parsers(commands: argparse._SubParsersAction) -> None:
    schema = commands.add_parser("schema", help="Prompt Cache schemas: add (encode) or list")
    schema_actions = schema.add_subparsers(dest="action", required=True)
    schema_add = schema_actions.add_parser("add", help="compile a schema file, encode its modules")
    schema_add.add_argument("file", type=Path)
    engine_options(schema_add)
    schema_list = schema_actions.add_parser("list", help="the schemas added to this store")
    engine_options(schema_list)
    prompt = commands.add_parser("prompt", help="answer a <prompt> over its schema's cached KV")
    prompt.add_argument("prompt", help="a file holding <prompt ...>...</prompt>, or the text")
    prompt.add_argument(
        "--strategy",
        "--mode",
        default="positions",
        help="positions (schema positions, the default) or a link strategy",
    )
    prompt.add_argument("--max-new-tokens", type=int, default=64)
    engine_options(prompt)
    for sub in (schema_add, schema_list, prompt):
        sub.set_defaults(run=schema_command)


def schema_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.errors import ConfigError, RagKVCacheError
    from rag_kvcache.markup.language import read_source
    from rag_kvcache.markup.prompt_cache import PromptCache
    from rag_kvcache.storage.layout import SCHEMAS_FOLDER, schema_path
    from rag_kvcache.strategy import PREFILL

    adding = args.command == "schema" and args.action == "add"
    if args.command == "prompt" and not (
        is_file(args.prompt) or args.prompt.lstrip().startswith("<")
    ):  # before the model loads; it was read as markup: "line 1, column 1: syntax error"
        raise ConfigError(
            f"{args.prompt!r} is neither a file nor a prompt: give "
            '<prompt schema="NAME">...</prompt>, or a file holding one'
        )
    # read before the store is made: a schema file that is missing left an empty store behind
    source = read_source(args.file) if adding else ""
    engine = open_engine(args, console, existing=not adding)  # listing and prompting only read
    folder = Path(args.store) / SCHEMAS_FOLDER
    cache = PromptCache(engine)
    try:
        if adding:
            schema = cache.checked_schema(source)
            path = schema_path(Path(args.store), schema.name)  # a hostile name: nothing encoded
            added = cache.add(schema)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(cache.schemas[added.name].source, encoding="utf-8")
            console.print(
                f"schema {added.name!r}: {added.modules} modules, {added.units} units "
                f"({added.encoded} encoded now, {added.units - added.encoded} already cached)"
            )
            return 0
        if folder.exists():
            # listing only reads: its schemas are compiled, not encoded under this model
            listing = args.command == "schema"
            for path, why in cache.load_folder(folder, encode=not listing).skipped:
                console.print(
                    Text.assemble(("skipped ", "yellow"), f"{path.name}: {why}"), highlight=False
                )
        if args.command == "schema":
            table = Table("schema", "modules", "parameters", "positions")
            for s in cache.schemas.values():
                table.add_row(Text(s.name), str(len(s.modules)), str(len(s.params)), str(s.length))
            console.print(table if cache.schemas else "no schemas yet: rag-kvcache schema add FILE")
            return 0
        text = read_source(Path(args.prompt)) if is_file(args.prompt) else args.prompt
        answer = cache.serve(text, args.strategy, max_new_tokens=args.max_new_tokens)
        baseline = cache.serve(text, PREFILL, max_new_tokens=args.max_new_tokens)
    except (RagKVCacheError, OSError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        return 1
    console.print(answer.text, markup=False, highlight=False)
    console.print(
        f"TTFT {answer.ttft_s:.3f} s ({answer.strategy}: {answer.context_tokens} tokens cached, "
        f"{answer.computed_tokens} computed) vs {baseline.ttft_s:.3f} s full prefill: "
        f"{baseline.ttft_s / answer.ttft_s:.1f}x; answers "
        f"{'agree' if baseline.token_ids == answer.token_ids else 'differ'}"
    )
    return 0


def is_file(text: str) -> bool:
    """Whether the prompt argument names a file (else it is the prompt itself: a long prompt
    is no file name, and the file system says so with an error)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False
