"""`stats`, `verify` and `gc`: look after a store."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Column, Table

from rag_kvcache.tools.cli.common import engine_options, open_store, store_options

if TYPE_CHECKING:
    from rag_kvcache.storage.store import TieredStore


def add_parsers(commands: argparse._SubParsersAction) -> None:
    for name, text in [
        ("stats", "chunks, bytes per tier, hit and re-encode counters"),
        (
            "verify",
            "check every blob and the vector index (--repair re-encodes bad blobs, drops "
            "unreadable rows and rebuilds the index)",
        ),
        ("gc", "remove expired chunks, dead writers' rows, orphan blobs and temporaries"),
    ]:
        sub = commands.add_parser(name, help=text)
        if name == "verify":  # repairing re-encodes with the model (and writes as told)
            engine_options(sub)
            sub.add_argument(
                "--repair",
                action="store_true",
                help="loads the model given with --model/--dtype/--lora (the one that encoded "
                "the chunks)",
            )
        else:
            store_options(sub)
        sub.set_defaults(run=store_command)
        if name == "gc":
            sub.add_argument(
                "--pending-after",
                type=seconds,
                default=600.0,
                metavar="SECONDS",
                help="an unfinished write older than this is abandoned",
            )
            sub.add_argument(
                "--force", action="store_true", help="delete orphan blobs even if most are"
            )


def store_command(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    store = open_store(args, with_model=getattr(args, "repair", False))
    if args.command == "stats":
        stats = store.catalog.stats()
        table = Table("what", Column("value", overflow="fold"), title=f"store {args.store}")
        table.add_row("catalog", store.catalog.url)  # (folded, not cut: which store it is)
        table.add_row(
            "models / documents / chunks", f"{stats.models} / {stats.documents} / {stats.chunks}"
        )
        files = store.catalog.model_files()
        for kind, what in (("calibration", "link calibrations"), ("adapter", "LoRA adapters")):
            mine = [f for f in files if f.kind == kind]
            if mine:
                damaged = sum(not f.intact for f in mine)
                table.add_row(what, f"{len(mine)}" + (f" ({damaged} damaged)" if damaged else ""))
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
        kept = [c for c in report.orphans if store.durable.contains(c)]
        dropped_any = report.unreadable or len(kept) < len(report.orphans)
        console.print(
            f"checked {report.checked}: {len(report.corrupt)} corrupt, "
            f"{len(report.missing)} missing, {report.repaired} repaired, "
            f"{report.upgraded} checksums upgraded to xxh3-128, "
            f"{len(report.unreadable)} unreadable rows, {len(report.orphans)} orphan blobs"
            + (" (dropped)" if args.repair and dropped_any else "")
        )
        if report.other_model:
            console.print(
                f"{len(report.other_model)} bad blobs belong to another model than the one "
                "loaded: repair them with that model's --model / --dtype / --lora",
                highlight=False,
            )
        if report.full:
            console.print(
                f"repairing stopped when the store filled up ({report.full}); the blobs "
                "after it were checked, not repaired: run `verify --repair` again once "
                "there is room",
                highlight=False,
            )
        for file in report.damaged_files:
            train = "rag-kvcache calibrate" + (" --kind lora" if file.kind == "adapter" else "")
            console.print(
                f"{file} is damaged (its sha256 does not match)"
                + (
                    f": dropped; train it again with `{train}`"
                    if args.repair
                    else f": `verify --repair` drops it, then train it again (`{train}`)"
                ),
                highlight=False,
                markup=False,
            )
        bad = (len(report.corrupt) + len(report.missing)) - report.repaired
        bad += len(kept) + (0 if args.repair else len(report.unreadable))
        bad += 0 if args.repair else len(report.damaged_files)
        if args.repair and kept:
            console.print(
                f"{len(kept)} orphan blobs kept: most blobs are not in the catalog; is it the "
                "right one? (`gc --force` deletes them)"
            )
        problem = index_problem(store)
        added, dropped = (0, 0) if problem else index_lag(store)
        if problem and args.repair:
            entries = rebuild_index(store)
            console.print(f"vector index: {problem}; rebuilt from the catalog ({entries} chunks)")
        elif problem:
            console.print(f"vector index: {problem} (verify --repair rebuilds it)")
            bad += 1
        elif added or dropped:  # another process's ingest, which the folder's copy follows
            lag = f"{added} chunks to add and {dropped} to drop since this folder saved it"
            if args.repair:
                rebuild_index(store, keep=True)
                console.print(f"vector index: {lag}; brought up to date")
            else:
                console.print(
                    f"vector index: {lag} (the catalog changed since: another process's "
                    "ingest, or gc; the next retrieval here brings it up to date: not damage)"
                )
        else:
            console.print("vector index: matches the catalog")
        return 1 if bad else 0
    report_gc = store.gc(pending_after_s=args.pending_after, force=args.force)
    console.print(
        f"gc: {report_gc.expired} expired, {report_gc.pending} dead writers' rows, "
        f"{report_gc.orphan_blobs} orphan blobs, {report_gc.temporaries} temporaries "
        "removed"
    )
    return 0


def index_problem(store: TieredStore) -> str | None:
    """What is wrong with the store's vector index, or None: its files must be readable and as
    the library wrote them, list each chunk once, and hold each documented chunk's embedding of
    its text (so tampered or bit-rotted vectors are found, not only unreadable files). Listing
    other chunks than the catalog's documents is not damage: the folder's copy is behind
    another process's ingest (`index_lag`), and any retrieval here syncs it."""
    import faiss
    import numpy as np

    from rag_kvcache.errors import RagKVCacheError
    from rag_kvcache.retrieval.embedding import Embedder
    from rag_kvcache.retrieval.index import checksum_path, checksums_match, faiss_id

    wanted = store.catalog.documented_ids()
    index_path, ids_path = store.root / "index.faiss", store.root / "index.ids"
    if not index_path.exists() and not ids_path.exists():
        return None  # a folder that never saved one (a new replica's): it lags, `index_lag`
    try:
        index = faiss.read_index(str(index_path))
        ids = ids_path.read_text(encoding="ascii").split()
        keys = [faiss_id(c) for c in ids]
        vectors = np.stack([index.reconstruct(k) for k in keys]) if keys else None
    except (OSError, RuntimeError, UnicodeDecodeError, RagKVCacheError) as err:
        return f"unreadable ({str(err).strip().splitlines()[0]})"
    if len(ids) != len(set(ids)):
        return f"lists {len(ids) - len(set(ids))} chunks twice"
    if index.ntotal != len(ids):
        return f"its two files disagree ({index.ntotal} vectors, {len(ids)} cache IDs)"
    # an index saved before checksums were kept has none: not damage (its vectors are
    # checked against the catalog below; `verify` reported every such store as tampered)
    if checksum_path(index_path).exists() and not checksums_match(index_path, ids_path):
        return "its files do not match their checksums (changed since the library wrote them)"
    documented = [i for i, c in enumerate(ids) if c in wanted]
    if vectors is None or not documented:
        return None
    rows = store.catalog.chunks([ids[i] for i in documented])
    expected = Embedder.shared().embed([rows[ids[i]].text for i in documented])
    wrong = int((np.abs(vectors[documented] - expected).max(axis=1) > 1e-3).sum())
    return f"{wrong} vectors differ from their chunk's embedding" if wrong else None


def index_lag(store: TieredStore) -> tuple[int, int]:
    """How far a readable vector index is behind the catalog: (documented chunks it lacks,
    chunks it lists that no document does)."""
    wanted = store.catalog.documented_ids()
    ids_path = store.root / "index.ids"
    listed = set(ids_path.read_text(encoding="ascii").split()) if ids_path.exists() else set()
    return len(wanted - listed), len(listed - wanted)


def rebuild_index(store: TieredStore, keep: bool = False) -> int:
    """Rebuild the vector index from the catalog (its chunk texts); returns its size. `keep`:
    sync the one there instead (embed only what it lacks), as opening the corpus does."""
    from rag_kvcache.retrieval.corpus import Corpus
    from rag_kvcache.retrieval.embedding import Embedder

    for name in () if keep else ("index.faiss", "index.ids", "index.faiss.sha256"):
        (store.root / name).unlink(missing_ok=True)
    return len(Corpus(store, store.catalog, store.root, Embedder.shared()).index)


def seconds(text: str) -> float:
    """--pending-after: a finite number of seconds, >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"a time in seconds, >= 0 and finite, not {text}")
    return value
