"""`rag-kvcache bench ttft`: time to first token, full prefill vs each link strategy, one run.

Contexts are built from 256-token chunks of the sample corpus after the system prefix, with a
32-token question. On a GPU each link strategy is measured with its short forwards replayed as
CUDA graphs (`rag_kvcache.model.graphs`), eagerly, or both (`cuda_graphs`); prefill, the
baseline, is always eager. With `decode_tokens`, each request also decodes that many tokens
and the rows give the decoding speed. Everything is measured side by side in one process, so
the speedups are ratios on the same machine at the same moment. Writes JSON and a PNG plot, and
a breakdown of each request's TTFT into its stages (`rag_kvcache.timing`: store fetch,
selection, placement with RoPE re-rotation, the forward, choosing the token; "other" is the
rest: Python between them), from one extra request per cell with its stages timed. Each row
also gives the arithmetic of its first token (`rag_kvcache.model.arithmetic`, counted in one
more, untimed request) and the ceiling it puts on the speedup: prefill's arithmetic over the
strategy's, the speedup at equal FLOP rates.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from rich.progress import Progress

from rag_kvcache.answer import Answer
from rag_kvcache.config import ModelConfig
from rag_kvcache.errors import ConfigError
from rag_kvcache.model.arithmetic import counted
from rag_kvcache.model.graphs import paused
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.strategy import DEFAULT, PREFILL, Strategy
from rag_kvcache.timing import stage_seconds
from rag_kvcache.tools.bench import BASELINE_ALWAYS, CHUNK_TOKENS, check_whole_chunks
from rag_kvcache.tools.bench.profile import file_name, write_profile
from rag_kvcache.tools.bench.report import (
    bench_engines,
    cache_chunks,
    corpus_tokens,
    question_text,
    save_report,
)

GRAPH_MODES = {"on": (True,), "off": (False,), "both": (False, True)}


@dataclass(frozen=True)
class StageRow:
    """Where one request's time to first token went (seconds; an extra request, its stages
    timed: on a GPU each stage then waits for its kernels, so a little slower)."""

    dtype: str
    context_tokens: int
    strategy: str
    ttft_s: float
    stages: dict[str, float]  # fetch, select, place, forward, choose_token, other


@dataclass(frozen=True)
class TTFTRow:
    dtype: str
    context_tokens: int
    strategy: str
    ttft_s: float  # median over repeats
    ttft_runs: list[float]
    recomputed_tokens: int
    speedup: float  # prefill ttft / this ttft, same dtype and context
    # the first token's arithmetic (`model.arithmetic`: its matrix products), GFLOP; None
    # where the count missed the linear layers or attention (a model computing them otherwise)
    gflop: float | None
    ceiling: float | None  # prefill's arithmetic / this one's: the speedup at equal FLOP rates
    cuda_graphs: bool = False  # short forwards replayed as CUDA graphs (else eager)
    decode_tokens_per_s: float | None = None  # median, where requests decoded past one token


def bench_dtype(
    lm: LoadedModel,
    contexts: list[int],
    strategies: list[Strategy],
    chunk_tokens: int,
    question_tokens: int,
    repeats: int,
    progress: Progress,
    stage_rows: list[StageRow] | None = None,
    graph_modes: tuple[bool, ...] = (True,),
    decode_tokens: int = 1,
    profile_dir: Path | None = None,
) -> Iterator[list[TTFTRow]]:
    """TTFT of `RagKVCache.generate` (the public call users make) per context and strategy
    (each with CUDA graphs on and/or off, `graph_modes`), chunks from the in-memory store,
    prefill (eager) beside them: each context's rows, as soon as they are measured. With
    `profile_dir`, one more first token of each under torch's profiler (`write_profile`)."""
    engine, sink_engine = bench_engines(lm)
    n_chunks = max(contexts) // chunk_tokens
    # before any chunk is encoded: the longest prompt must fit the model's window
    prompt = len(engine.template.prefix_ids(lm.tokenizer)) + n_chunks * chunk_tokens
    if prompt + question_tokens + decode_tokens > lm.max_context:
        raise ConfigError(
            f"a context of {max(contexts)} tokens, with the system prompt, a {question_tokens}-"
            f"token question and {decode_tokens} decoded, is past {lm.name}'s window of "
            f"{lm.max_context} tokens: give shorter --contexts"
        )
    pool = corpus_tokens(lm, max(contexts) + question_tokens)
    chunk_ids = [pool[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(n_chunks)]
    plain = cache_chunks(engine, chunk_ids)
    sinks = cache_chunks(sink_engine, chunk_ids)
    question = question_text(engine, pool[-question_tokens:], question_tokens)
    task = progress.add_task(f"{lm.dtype}", total=len(contexts) * repeats)
    dtype = str(lm.dtype).removeprefix("torch.")
    Run = tuple[Strategy, bool]  # a strategy, with its short forwards replayed or not
    # on a GPU each profiled stage waits for its kernels, so that its time holds them
    sync = partial(torch.cuda.synchronize, lm.device) if lm.device.type == "cuda" else None

    def first_token(run: Run, n: int, new_tokens: int = decode_tokens) -> Answer:
        strategy, graphs = run
        on, ids = (sink_engine, sinks) if strategy.needs_sinks else (engine, plain)
        with contextlib.nullcontext() if graphs else paused(lm.model, lm.device):
            answer = on.generate(question, ids[:n], strategy=strategy, max_new_tokens=new_tokens)
        assert isinstance(answer, Answer)
        return answer

    for context in contexts:
        n = context // chunk_tokens
        runs: list[Run] = [(PREFILL, False), *((s, g) for s in strategies for g in graph_modes)]
        warm = {r: first_token(r, n) for r in runs}  # first calls are slower (and capture)
        # round-robin: each repeat times prefill and every strategy once, so a machine whose
        # speed drifts over minutes (shared 2-core VMs do) shifts all of them alike
        answers: dict[Run, list[Answer]] = {r: [] for r in runs}
        for _ in range(repeats):
            for run in runs:
                answers[run].append(first_token(run, n))
            progress.advance(task)
        for run in runs:
            name = str(run[0]) + ("" if run[1] or len(graph_modes) == 1 else " (eager)")
            if profile_dir is not None:
                write_profile(
                    lambda: first_token(run, n, 1),  # noqa: B023
                    profile_dir / f"{dtype}-{context}-{file_name(name)}.txt",
                    lm.device,
                )
            if stage_rows is None:
                continue
            # one token: the stages of the first token only (on a GPU a queued decode step
            # would be waited for, and counted, in the next token's choice)
            answer, stages = stage_seconds(lambda: first_token(run, n, 1), sync)  # noqa: B023
            stages["other"] = max(0.0, answer.ttft_s - sum(stages.values()))
            stage_rows.append(StageRow(dtype, answer.prompt_tokens, name, answer.ttft_s, stages))
        work: dict[Strategy, int | None] = {}  # one more request each, eager, untimed: FLOPs
        for strategy in dict.fromkeys(run[0] for run in runs):
            with counted(lm.model) as arithmetic:
                first_token((strategy, False), n, 1)
            whole = arithmetic.linear > 0 and arithmetic.attention > 0
            work[strategy] = arithmetic.total if whole else None
        base_work = work[PREFILL]
        base = statistics.median(a.ttft_s for a in answers[(PREFILL, False)])
        rows: list[TTFTRow] = []
        for run, done in answers.items():
            times = [a.ttft_s for a in done]
            ttft = statistics.median(times)
            speed = statistics.median(a.decode_tokens_per_s for a in done)
            rows.append(
                TTFTRow(
                    dtype,
                    warm[run].prompt_tokens,
                    str(run[0]),
                    ttft,
                    times,
                    warm[run].recomputed_tokens,
                    base / ttft,
                    None if (mine := work[run[0]]) is None else mine / 1e9,
                    None if mine is None or base_work is None else base_work / mine,
                    cuda_graphs=run[1] and lm.device.type == "cuda",
                    decode_tokens_per_s=speed if decode_tokens > 1 else None,
                )
            )
        yield rows


def run_ttft_bench(
    out_dir: Path,
    dtypes: list[str],
    contexts: list[int],
    strategies: list[str] | list[Strategy],
    chunk_tokens: int = CHUNK_TOKENS,
    question_tokens: int = 32,
    repeats: int = 3,
    model_path: str | None = None,
    device: str = "cpu",
    cuda_graphs: str = "on",
    decode_tokens: int = 1,
    profile: bool = False,
) -> dict[str, object]:
    """`bench ttft`: every dtype, context and strategy (`bench_dtype`), the report written
    after each context; with `profile`, an operator table of one request per cell under
    `out_dir/profiles/`."""
    modes = GRAPH_MODES[cuda_graphs] if device.startswith("cuda") else (False,)
    parsed = [Strategy.parse(s) for s in strategies]  # a bad name fails before any load
    if PREFILL in parsed:  # (measured twice; the baseline is always measured)
        raise ConfigError(BASELINE_ALWAYS)
    check_whole_chunks("contexts", contexts, chunk_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[TTFTRow] = []
    stage_rows: list[StageRow] = []
    models: dict[str, dict[str, str]] = {}

    def save(complete: bool) -> dict[str, object]:
        report = save_report(  # the JSON first: a plot that fails loses no measurement
            out_dir,
            "ttft",
            rows,
            lambda path: plot_ttft(rows, path),
            complete=complete,
            stages=[asdict(r) for r in stage_rows],
            models=models,
            chunk_tokens=chunk_tokens,
            question_tokens=question_tokens,
            repeats=repeats,
        )
        plot_stages(stage_rows, out_dir / "ttft_stages.png")
        return report

    cells = len(dtypes) * len(contexts)  # left to measure
    report: dict[str, object] = {}
    with Progress() as progress:
        for dtype in dtypes:
            lm = load_model(ModelConfig(path=model_path, dtype=dtype, device=device))
            models[dtype] = {"name": lm.name, "fingerprint": lm.fingerprint}
            for measured in bench_dtype(
                lm,
                contexts,
                parsed,
                chunk_tokens,
                question_tokens,
                repeats,
                progress,
                stage_rows,
                modes,
                decode_tokens,
                out_dir / "profiles" if profile else None,
            ):
                rows.extend(measured)
                # written after every context: a run stopped early (a time limit, a crash at a
                # length the device cannot hold) keeps what it measured
                cells -= 1
                report = save(complete=cells == 0)
    return report


def plot_ttft(rows: list[TTFTRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r.dtype for r in rows})
    fig, axes = plt.subplots(2, len(dtypes), figsize=(7 * len(dtypes), 9), squeeze=False)
    for col, dtype in enumerate(dtypes):
        mine = [r for r in rows if r.dtype == dtype]
        ax = axes[0][col]
        # one colour per strategy; where both CUDA-graph modes were measured, eager is dashed
        colours = {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(r.strategy for r in mine))}
        graphs = any(r.cuda_graphs for r in mine)
        for name, row in {label(r, mine): r for r in mine}.items():
            pts = [(r.context_tokens, r.ttft_s) for r in mine if label(r, mine) == name]
            dashed = graphs and not row.cuda_graphs and row.strategy != str(PREFILL)
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=name,
                color=colours[row.strategy],
                linestyle="--" if dashed else "-",
            )
        ax.set(yscale="log", xlabel="context tokens", ylabel="TTFT (s)", title=f"TTFT, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        largest = max(r.context_tokens for r in mine)
        top = [r for r in mine if r.context_tokens == largest and r.strategy != str(PREFILL)]
        ax = axes[1][col]
        names = [label(r, mine) for r in top]
        # the arithmetic ceiling behind each measured bar: the speedup at prefill's FLOP rate
        bars = ax.bar(names, [r.speedup for r in top], color=[colours[r.strategy] for r in top])
        ax.bar_label(bars, fmt="%.1fx", fontsize=8, label_type="center")
        ceiling = [r.ceiling or 0.0 for r in top]  # (0: not counted)
        outlines = ax.bar(names, ceiling, color="none", edgecolor="grey", zorder=3)
        ax.bar_label(outlines, labels=[f"{c:.1f}x" if c else "" for c in ceiling], fontsize=7)
        ax.set(
            ylabel="speedup vs full prefill",
            title=f"speedup at {largest} tokens, {dtype}\n(outlined: its arithmetic ceiling)",
        )
        ax.tick_params(axis="x", rotation=35)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def label(row: TTFTRow, rows: list[TTFTRow]) -> str:
    """The row's strategy ("default" for the default's long name), marked "(graphs)" where
    both CUDA-graph modes were measured."""
    both = any(r.cuda_graphs for r in rows) and any(
        not r.cuda_graphs and r.strategy != str(PREFILL) for r in rows
    )
    name = "default" if row.strategy == str(DEFAULT) else row.strategy
    return name + (" (graphs)" if both and row.cuda_graphs else "")


def plot_stages(rows: list[StageRow], path: Path) -> None:
    """Stacked bars per link strategy, one panel per dtype and context: where TTFT goes
    (prefill, one forward, is named in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    linked = [r for r in rows if r.strategy != str(PREFILL)]
    cells = list(dict.fromkeys((r.dtype, r.context_tokens) for r in linked))
    if not cells:  # no link strategy measured: no bars to stack
        return
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4.5), squeeze=False)
    for ax, (dtype, context) in zip(axes[0], cells, strict=True):
        cell = [r for r in rows if (r.dtype, r.context_tokens) == (dtype, context)]
        prefill_s = next((r.ttft_s for r in cell if r.strategy == str(PREFILL)), float("nan"))
        mine = [r for r in cell if r.strategy != str(PREFILL)]  # one or more (`cells`)
        names = [r.strategy for r in mine]
        bottom = [0.0] * len(mine)
        for stage in mine[0].stages:
            heights = [1000 * r.stages[stage] for r in mine]
            ax.bar(names, heights, bottom=bottom, label=stage)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set(
            ylabel="ms",
            # one extra request per bar, the prefill's too (the table's are medians)
            title=f"TTFT by stage, {context} tokens, {dtype}, one request each\n"
            f"(prefill: {1000 * prefill_s:.0f} ms)",
        )
        ax.tick_params(axis="x", rotation=40)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
