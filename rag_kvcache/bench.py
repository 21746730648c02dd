"""`rag-kvcache bench ttft`: time to first token, full prefill vs each link strategy, one run.

Contexts are built from 256-token chunks of the sample corpus after the system prefix, with a
32-token question. Everything is measured side by side in one process, so the speedups are
ratios on the same machine at the same moment. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from rag_kvcache.config import DEFAULT_SYSTEM_PROMPT, ModelConfig
from rag_kvcache.decoding import prefill
from rag_kvcache.encoder import encode_chunks
from rag_kvcache.engine import PREFILL
from rag_kvcache.kv import ChunkKV, EncodeSettings
from rag_kvcache.linker import link
from rag_kvcache.model import LoadedModel, load_model
from rag_kvcache.prompt import PromptTemplate

DEFAULT_STRATEGIES = ("naive", "legolink:2", "legolink:16", "legolink0", "cacheblend:0.15")
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "demos" / "data"


@dataclass(frozen=True)
class TTFTRow:
    dtype: str
    context_tokens: int
    strategy: str
    ttft_s: float  # median over repeats
    ttft_runs: list[float]
    recomputed_tokens: int
    speedup: float  # prefill ttft / this ttft, same dtype and context


def machine_facts() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def corpus_tokens(lm: LoadedModel, needed: int) -> list[int]:
    """Token ids of the sample corpus, repeated until `needed` long."""
    text = "\n\n".join(p.read_text() for p in sorted(SAMPLE_DATA.glob("*.md")))
    ids = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return (ids * (needed // len(ids) + 1))[:needed]


def first_token_seconds(run: object) -> float:
    """Wall time of `run()` (which ends with the first token chosen)."""
    assert callable(run)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bench_dtype(
    lm: LoadedModel,
    contexts: list[int],
    strategies: list[str],
    chunk_tokens: int,
    question_tokens: int,
    repeats: int,
    progress: Progress,
) -> list[TTFTRow]:
    template = PromptTemplate.from_tokenizer(lm.tokenizer, DEFAULT_SYSTEM_PROMPT)
    prefix_ids = template.prefix_ids(lm.tokenizer)
    pool = corpus_tokens(lm, max(contexts) + question_tokens)
    n_chunks = max(contexts) // chunk_tokens
    chunk_ids = [pool[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(n_chunks)]
    suffix = template.tokenize(lm.tokenizer, template.suffix)
    question = pool[-question_tokens + len(suffix) :] + suffix  # exactly question_tokens
    prefix = encode_chunks(lm, [prefix_ids])[0]
    plain = encode_chunks(lm, chunk_ids)
    sinks = encode_chunks(lm, chunk_ids, EncodeSettings(tuple(prefix_ids[:4])))
    rows: list[TTFTRow] = []
    task = progress.add_task(f"{lm.dtype}", total=len(contexts) * repeats)
    dtype = str(lm.dtype).removeprefix("torch.")

    def prefill_first_token(ids: list[int]) -> int:
        return int(prefill(lm, ids)[1].argmax())

    def linked_first_token(chunks: list[ChunkKV], strategy: str) -> int:
        return int(link(lm, chunks, question, strategy).next_logits.argmax())

    for context in contexts:
        n = context // chunk_tokens
        ids = prefix_ids + [t for c in chunk_ids[:n] for t in c] + question
        runs: dict[str, Callable[[], int]] = {PREFILL: partial(prefill_first_token, ids)}
        recomputed = {PREFILL: len(ids)}
        for strategy in strategies:
            chunks: list[ChunkKV] = [prefix, *(sinks if strategy == "legolink0" else plain)[:n]]
            recomputed[strategy] = link(lm, chunks, question, strategy).recomputed  # warm-up
            runs[strategy] = partial(linked_first_token, chunks, strategy)
        # round-robin: each repeat times prefill and every strategy once, so a machine whose
        # speed drifts over minutes (shared 2-core VMs do) shifts all of them alike
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                seconds[name].append(first_token_seconds(run))
            progress.advance(task)
        base = statistics.median(seconds[PREFILL])
        for name, times in seconds.items():
            ttft = statistics.median(times)
            rows.append(TTFTRow(dtype, len(ids), name, ttft, times, recomputed[name], base / ttft))
    return rows


def run_ttft_bench(
    out_dir: Path,
    dtypes: list[str],
    contexts: list[int],
    strategies: list[str],
    chunk_tokens: int = 256,
    question_tokens: int = 32,
    repeats: int = 3,
    model_path: str | None = None,
    device: str = "cpu",
) -> dict[str, object]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[TTFTRow] = []
    models = {}
    with Progress() as progress:
        for dtype in dtypes:
            lm = load_model(ModelConfig(path=model_path, dtype=dtype, device=device))
            models[dtype] = {"name": lm.name, "fingerprint": lm.fingerprint}
            lm_rows = bench_dtype(
                lm, contexts, strategies, chunk_tokens, question_tokens, repeats, progress
            )
            rows.extend(lm_rows)
    return save_report(
        out_dir,
        "ttft",
        rows,
        lambda path: plot_ttft(rows, path),
        models=models,
        chunk_tokens=chunk_tokens,
        question_tokens=question_tokens,
        repeats=repeats,
    )


def save_report(
    out_dir: Path,
    name: str,
    rows: Sequence[Any],
    plot: Callable[[Path], None],
    **facts: object,
) -> dict[str, object]:
    """Write NAME.json (the facts, the machine, one record per row) and, through `plot`,
    NAME.png into out_dir; returns the report."""
    report: dict[str, object] = {
        "benchmark": name,
        **facts,
        "machine": machine_facts(),
        "rows": [asdict(r) for r in rows],
    }
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(out_dir / f"{name}.png")
    return report


def plot_ttft(rows: list[TTFTRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r.dtype for r in rows})
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 8), squeeze=False)
    for col, dtype in enumerate(dtypes):
        mine = [r for r in rows if r.dtype == dtype]
        ax = axes[0][col]
        for strategy in dict.fromkeys(r.strategy for r in mine):
            pts = [(r.context_tokens, r.ttft_s) for r in mine if r.strategy == strategy]
            ax.plot(*zip(*pts, strict=True), marker="o", label=strategy)
        ax.set(yscale="log", xlabel="context tokens", ylabel="TTFT (s)", title=f"TTFT, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        largest = max(r.context_tokens for r in mine)
        top = [r for r in mine if r.context_tokens == largest and r.strategy != PREFILL]
        ax = axes[1][col]
        bars = ax.bar([r.strategy for r in top], [r.speedup for r in top], color="tab:green")
        ax.bar_label(bars, fmt="%.1fx", fontsize=8)
        ax.set(ylabel="speedup vs full prefill", title=f"speedup at {largest} tokens, {dtype}")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
