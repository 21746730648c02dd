"""`ingest`, `query` and `chat`: documents into the store, questions answered from it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from difflib import get_close_matches
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rag_kvcache.chat import earlier_answers, unless_repeated
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.strategy import DEFAULT, Strategy
from rag_kvcache.tools.cli.common import Terminated, engine_options, open_engine, whole


def add_parsers(commands: argparse._SubParsersAction) -> None:
    ingest = commands.add_parser("ingest", help="read, split, KV-encode and index documents")
    ingest.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    ingest.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in LM tokens")
    ingest.add_argument("--overlap", type=int, default=0, help="chunk overlap in LM tokens")
    ingest.add_argument(
        "--prune", action="store_true", help="remove documents under PATH whose file is gone"
    )
    ingest.add_argument("--max-bytes", type=whole(1), default=16 << 20, help="skip larger files")
    engine_options(ingest)
    ingest.set_defaults(run=ingest_command)
    query = commands.add_parser("query", help="answer one question from the ingested documents")
    query.add_argument("question")
    chat = commands.add_parser("chat", help="interactive questions (empty line or /quit ends)")
    for sub in (query, chat):
        sub.add_argument("--top-k", type=whole(1), default=4, help="chunks retrieved per question")
        sub.add_argument("--strategy", default=None, help=f"link strategy (default {DEFAULT})")
        sub.add_argument(
            "--compare", action="store_true", help="also run full prefill; print both TTFTs"
        )
        sub.add_argument("--max-new-tokens", type=int, default=128)
        engine_options(sub)
        sub.set_defaults(run=answer_command)


def ingest_command(args: argparse.Namespace, console: Console) -> int:
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from rag_kvcache.errors import ConfigError
    from rag_kvcache.ingest import plan_ingest, prune, run_ingest
    from rag_kvcache.integrations.llama_index.splitter import split_text

    if args.chunk_tokens < 1:
        raise ConfigError(f"--chunk-tokens must be at least 1, got {args.chunk_tokens}")
    if not 0 <= args.overlap < args.chunk_tokens:
        raise ConfigError(
            f"--overlap must be from 0 to below --chunk-tokens ({args.chunk_tokens}), "
            f"got {args.overlap}"
        )
    missing = [str(path) for path in args.paths if not path.exists()]
    if args.prune and missing:  # a typo or an unmounted folder must not forget its documents
        raise ConfigError(
            f"{', '.join(missing)}: no such file or folder, so nothing was pruned (--prune "
            "forgets the documents under a PATH whose files are gone; for a folder you removed, "
            "prune from a folder above it)"
        )
    engine = open_engine(args, console, keep_hot=False)
    if args.chunk_tokens > engine.lm.max_context:
        raise ConfigError(
            f"--chunk-tokens {args.chunk_tokens} is more than the model's window of "
            f"{engine.lm.max_context} tokens"
        )
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

        def dropped(n: int) -> None:  # planned chunks that never came (a file skipped):
            total = progress.tasks[encoding].total or 0  # out of the total, not counted
            progress.update(encoding, total=total - n)  # as done (the rate stays true)

        done = run_ingest(engine, plan, advance, dropped)
    pruned = prune(engine, args.paths) if args.prune else []
    if plan.skipped:
        table = Table("skipped", "why", title="not ingested", title_justify="left")
        for skip in plan.skipped:
            table.add_row(Text(skip.path), Text(skip.reason))  # names as text, not markup
        console.print(table)
    encoded = sum(d.encoded for d in done)
    encode_s = sum(d.encode_s for d in done)
    chunks = sum(len(d.cache_ids) for d in done)
    seconds = time.perf_counter() - start
    console.print(
        f"{counted(len(done), 'document')} ingested ({counted(chunks, 'chunk')}: {encoded} "
        "encoded, "
        f"{chunks - encoded} already cached; {sum(d.removed for d in done)} stale removed), "
        f"{len(plan.unchanged)} unchanged, {len(plan.skipped)} skipped, {len(pruned)} pruned "
        f"in {seconds:.1f} s ({encoded / max(encode_s, 1e-9):.1f} chunks/s encoded)"
    )
    return 0 if done or plan.unchanged or pruned else 1


def counted(n: int, noun: str) -> str:
    """'1 document', '2 documents'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


COMMANDS = "Commands: /clear forgets the conversation, /quit (or /exit) ends it, /help."
COMMAND_WORDS = ("/clear", "/quit", "/exit", "/help")


def unknown_command(line: str, command: str) -> bool:
    """Is this chat line meant as a command we do not have (said so, not asked)? `/help`, a
    lone `/word`, or a `/word` a typo away from a command (`/quti now`); a question that merely
    starts with a slash (`/usr is mounted where?`, `/etc/hosts lists what?`) is asked."""
    if not re.fullmatch(r"/[a-z]+", command):
        return False
    return line.lower() == command or bool(get_close_matches(command, COMMAND_WORDS, cutoff=0.7))


def answer_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.answer import Answer, AnswerStream
    from rag_kvcache.errors import ConfigError

    if args.command == "query" and not args.question.strip():
        raise ConfigError("the question is empty; ask something")
    engine = open_engine(args, console, existing=True)
    if not engine.corpus.catalog.documents():
        empty = f"no documents in {args.store}: run `rag-kvcache ingest PATH` first"
        console.print(empty, style="red", markup=False)
        return 1

    # a prefill compared with itself showed its warm-up as a speedup ("1.6x")
    compare = args.compare and engine.config.strategy.uses_cache
    if args.compare and not compare:
        note = f"--compare: {engine.config.strategy} is the baseline itself; nothing to compare"
        console.print(note, style="yellow", markup=False)

    def ask(question: str, history: list[dict[str, str]]) -> str:
        """Answer `question` (after the chat's `history`) streamed to the console; an answer
        that is an earlier one again is held back and the question answered alone."""
        hits = engine.retrieve(question, args.top_k)
        ids = [h.cache_id for h in hits]
        strategy = engine.config.strategy  # compared with a prefill of the same prompt
        runs: list[tuple[str, AnswerStream]] = []

        def run(asked: str, how: Strategy) -> Iterator[str]:
            stream = engine.generate(asked, ids, strategy=how, stream=True)
            assert isinstance(stream, AnswerStream)
            runs.append((asked, stream))
            return iter(stream)

        def show(pieces: Iterator[str]) -> Answer:
            for piece in pieces:
                console.print(piece, end="", highlight=False, markup=False)
            console.print()
            answer = runs[-1][1].answer
            assert answer is not None
            return answer

        if compare:
            console.print(f"[bold]{strategy}:[/bold]")
        asked = engine.chat_question([*history, {"role": "user", "content": question}])
        again = partial(run, question, strategy)  # the question alone
        first = show(unless_repeated(run(asked, strategy), earlier_answers(history), again))
        base = None
        if compare:
            console.print(f"[bold]{strategy.baseline}:[/bold]")
            base = show(run(runs[-1][0], strategy.baseline))  # the prompt the answer shown had
        table = Table("score", "source", "chunk", title="sources", title_justify="left")
        for hit in hits:
            source, text = Text(Path(hit.source or "?").name), Text(hit.text[:70])
            table.add_row(f"{hit.score:.2f}", source, text)  # documents' text is not markup
        console.print(table)
        line = (
            f"TTFT {first.ttft_s:.3f} s ({first.strategy}, {first.context_tokens} context "
            f"tokens, {first.recomputed_tokens} recomputed)"
        )
        if base is not None:
            line += (
                f" vs {base.ttft_s:.3f} s full prefill: {base.ttft_s / first.ttft_s:.1f}x; "
                f"answers {'agree' if base.text == first.text else 'differ'}"
            )
        console.print(line)
        return first.text

    if args.command == "query":
        ask(args.question, [])
        return 0
    history: list[dict[str, str]] = []
    console.print(f"Ask about the ingested documents (empty line or /quit to end). {COMMANDS}")
    while True:
        try:
            question = console.input("[bold]> [/bold]").strip()
        except EOFError:  # Ctrl-D: the shell's prompt on a line of its own
            console.print()
            break
        # a command is its first word, in any case: "/Quit now" is /quit, not a question
        command = question.split(maxsplit=1)[0].lower() if question else ""
        if not question or command in ("/quit", "/exit"):
            break
        if command == "/clear":  # a new conversation over the same documents
            history = []
            console.print("The conversation so far is forgotten.")
            continue
        if unknown_command(question, command):
            said = "" if command == "/help" else f"unknown command {command}. "
            console.print(said + COMMANDS, markup=False, highlight=False)
            continue
        try:
            answer = ask(question, history)
        except RagKVCacheError as error:  # this question's (too long, not text, a chunk gone):
            # said, and the session goes on with its history; one bad line ended it
            console.print(Text.assemble(("error: ", "red"), str(error)), highlight=False)
            continue
        except Terminated:  # a SIGTERM ends the session
            raise
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the session (nor its history)
            console.print("\n[red]answer stopped[/red] (Ctrl-C at the prompt, or /quit, ends)")
            continue
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return 0
