"""`stats`, `verify` and `gc`: look after a store."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from rag_kvcache.tools.cli.common import open_store, store_options


def add_parsers(commands: argparse._SubParsersAction) -> None:
    for name, text in [
        ("stats", "chunks, bytes per tier, hit and re-encode counters"),
        ("verify", "re-read every blob and check its checksum (--repair re-encodes bad ones)"),
        ("gc", "remove expired chunks, dead writers' rows, orphan blobs and temporaries"),
    ]:
        sub = commands.add_parser(name, help=text)
        store_options(sub)
        if name == "verify":
            sub.add_argument("--repair", action="store_true", help="loads the model")
        sub.set_defaults(run=store_command)
        if name == "gc":
            sub.add_argument("--pending-after", type=float, default=600.0, metavar="SECONDS")


def store_command(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    store = open_store(args, with_model=getattr(args, "repair", False))
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
