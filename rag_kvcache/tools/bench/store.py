"""`rag-kvcache bench store`: store latency per tier and TTFT when chunks come from each tier.

256-token chunks of the sample corpus. Put latency (durable write + catalog), get latency
from the CPU tier and from the durable tiers (disk with the blob files dropped from the OS
page cache first, so reads really hit the disk; Redis when reachable), bytes per token, and
the TTFT of a link strategy's generation (`legolink:2` unless told) with the chunks fetched from
each tier, side by side with full prefill of the same prompt. The disk tier is measured with
blobs as computed ("disk"), as 8-bit codes ("disk-int8") and as bfloat16 ("disk-bf16": float32
KV halved; a 16-bit model's is stored as it is), each with the next-token KL of its answer
against the KV as computed. Each durable tier's TTFT is timed round-robin beside the CPU
tier's (one request of each per repeat, so drift shifts both), and the disk's also with the
blobs read whole before the forward ("... (read whole)") instead of layer by layer behind it
(`storage.streaming`). Writes store.json and store.png.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from rag_kvcache.answer import Answer
from rag_kvcache.config import EngineConfig, ModelConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.extras import MissingExtraError
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.storage.disk import DiskTier
from rag_kvcache.storage.redis_tier import RedisTier, StoreUnavailableError
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.tools.bench.report import (
    bench_engines,
    cache_chunks,
    corpus_tokens,
    question_text,
    save_report,
)

LINKED = Strategy("legolink", k=2)  # the strategy timed from every tier, unless told
LOCAL_REDIS = "redis://127.0.0.1:6379/0"  # timed where no Redis is named, if one answers here


@dataclass(frozen=True)
class TierRow:
    dtype: str
    tier: str  # memory (no store), cpu, disk, redis, or prefill
    context_tokens: int
    ttft_s: float
    speedup_vs_prefill: float
    bytes_per_token: float
    put_ms_per_chunk: float | None = None
    get_ms_per_chunk: float | None = None
    ttft_vs_cpu: float | None = None  # this tier's TTFT / the CPU tier's timed beside it
    cpu_ttft_beside_s: float | None = None  # that CPU tier TTFT (round-robin with this row)
    kl_vs_uncompressed: float | None = None  # next-token KL(full-precision || this tier's KV)
    top1_agrees: bool | None = None


def drop_page_cache(disk: DiskTier) -> None:
    """Ask the OS to forget cached pages of every blob, so the next read goes to the disk."""
    for cid in disk.ids():
        fd = os.open(disk.path(cid), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_dtype(
    lm: LoadedModel,
    context: int,
    chunk_tokens: int,
    repeats: int,
    redis_url: str | None,
    root: Path,
    strategy: Strategy = LINKED,
) -> list[TierRow]:
    memory, _ = bench_engines(lm)
    pool = corpus_tokens(lm, context + 32)
    n = context // chunk_tokens
    chunk_ids = [pool[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(n)]
    ids = cache_chunks(memory, chunk_ids)
    docs = memory.store.get(ids)
    question = question_text(memory, pool[-32:], 32)
    dtype = str(lm.dtype).removeprefix("torch.")
    per_token = docs[0].nbytes / docs[0].num_tokens

    def ttft(
        engine: RagKVCache,
        timed: Strategy = strategy,
        before: Callable[[], object] = list,
        runs: int = repeats,
    ) -> float:
        """Median TTFT of the public call; `before` (untimed) e.g. empties the hot tiers."""
        seconds = []
        for _ in range(runs):
            before()
            answer = engine.generate(question, ids, strategy=timed, max_new_tokens=1)
            assert isinstance(answer, Answer)
            seconds.append(answer.ttft_s)
        return statistics.median(seconds)

    def first_logits(engine: RagKVCache) -> torch.Tensor:
        return engine.forced_logits(question, ids, [0], strategy)[0]

    tokens = len(memory.prompt_ids(question, ids))  # context + question

    def row(tier: str, ttft_s: float, **more: Any) -> TierRow:
        facts: dict[str, Any] = {"bytes_per_token": per_token, **more}
        return TierRow(dtype, tier, tokens, ttft_s, base / ttft_s, **facts)

    base = ttft(memory, PREFILL)
    rows = [row("prefill", base)]
    in_memory = ttft(memory)
    rows.append(row("memory", in_memory))
    exact = first_logits(memory)

    # on a GPU the chunks are also kept in GPU memory (the "gpu" row); without it they come
    # from the CPU tier (pinned, fed layer by layer; the "cpu" row)
    gpu_bytes = 2 * n * docs[0].nbytes if lm.device.type == "cuda" else 0
    where = f"{dtype}-{context}"
    # Redis first: a Redis gone since `redis_to_time` fails here, before any store is open
    redis = RedisTier(redis_url, prefix=f"rag-kvcache-bench:{os.getpid()}:") if redis_url else None
    durables: list[tuple[str, TieredStore]] = [
        ("disk", TieredStore(root / f"disk-{where}", compress=None, gpu_bytes=gpu_bytes)),
        ("disk-int8", TieredStore(root / f"int8-{where}", compress="int8", gpu_bytes=gpu_bytes)),
        (
            "disk-bf16",
            TieredStore(root / f"bf16-{where}", compress="bfloat16", gpu_bytes=gpu_bytes),
        ),
    ]
    if redis is not None:
        store = TieredStore(root / f"redis-{where}", durable=redis, gpu_bytes=gpu_bytes)
        durables.append(("redis", store))
    cpu_ttft: float | None = None
    try:
        for name, store in durables:
            engine = RagKVCache(EngineConfig(), lm=lm, store=store)
            start = time.perf_counter()
            for kv in docs:
                store.put(kv, "bench")
            put_ms = (time.perf_counter() - start) * 1000 / n
            if cpu_ttft is None:  # the hot tiers are the same whichever durable tier is behind
                hot_rows = []
                for tier in store.hot:  # fastest first; each emptied after its turn
                    get_runs = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        store.get(ids)
                        get_runs.append((time.perf_counter() - start) * 1000 / n)
                    hot_rows.append((tier.name, statistics.median(get_runs), ttft(engine)))
                    if tier is not store.hot[-1]:
                        for cid in ids:
                            tier.remove(cid)
                cpu_ttft = hot_rows[-1][2]
                rows += [
                    row(
                        hot,
                        t,
                        get_ms_per_chunk=get_ms,
                        ttft_vs_cpu=t / cpu_ttft,
                    )
                    for hot, get_ms, t in hot_rows
                ]

            def forget_hot(s: TieredStore = store) -> None:
                for hot in s.hot:
                    for cid in ids:
                        hot.remove(cid)
                if isinstance(s.durable, DiskTier):
                    drop_page_cache(s.durable)

            get_runs = []
            for _ in range(repeats):
                forget_hot()
                start = time.perf_counter()
                store.get(ids)
                get_runs.append((time.perf_counter() - start) * 1000 / n)
            # round-robin, each repeat one request of each: chunks hot in the CPU tier, cold from
            # this tier, and (disk) cold read whole before the forward instead of layer by layer
            ways: dict[str, list[float]] = {"cpu": [], name: [], f"{name} (read whole)": []}
            for _ in range(repeats):
                store.get(ids)  # now hot
                ways["cpu"].append(ttft(engine, runs=1))
                for way, streamed in ((name, True), (f"{name} (read whole)", False)):
                    if not streamed and not (
                        isinstance(store.durable, DiskTier) and not store.compress
                    ):
                        continue  # timed for the disk as computed only (bfloat16 blobs stream too)
                    store.stream_reads = streamed
                    ways[way].append(ttft(engine, before=forget_hot, runs=1))
                store.stream_reads = True
            beside = statistics.median(ways["cpu"])
            forget_hot()
            served = first_logits(engine)
            p, log_p, log_q = exact.softmax(-1), exact.log_softmax(-1), served.log_softmax(-1)
            tier_ttft = statistics.median(ways[name])
            rows.append(
                row(
                    name,
                    tier_ttft,
                    put_ms_per_chunk=put_ms,
                    get_ms_per_chunk=statistics.median(get_runs),
                    ttft_vs_cpu=tier_ttft / beside,
                    cpu_ttft_beside_s=beside,
                    bytes_per_token=sum(len(store.durable.get(c) or b"") for c in ids)
                    / (n * chunk_tokens),
                    kl_vs_uncompressed=float((p * (log_p - log_q)).sum()),
                    top1_agrees=bool(exact.argmax() == served.argmax()),
                )
            )
            if whole_runs := ways[f"{name} (read whole)"]:
                whole = statistics.median(whole_runs)
                rows.append(
                    row(
                        f"{name} (read whole)",
                        whole,
                        ttft_vs_cpu=whole / beside,
                        cpu_ttft_beside_s=beside,
                    )
                )
    finally:  # stopped or done: no blob left in Redis (an interrupted run left its keys)
        for name, store in durables:
            if name == "redis":
                for cid in list(store.durable.ids()):
                    store.durable.remove(cid)
                store.durable.close()  # (handed to the store, which leaves it to us)
            store.close()
    return rows


def run_store_bench(
    out_dir: Path,
    dtypes: list[str],
    contexts: list[int] | None = None,
    chunk_tokens: int = 256,
    repeats: int = 3,
    redis_url: str | None = None,
    model_path: str | None = None,
    device: str = "cpu",
    strategy: Strategy = LINKED,
) -> dict[str, object]:
    """Time every tier (`bench_dtype`). `redis_url`: the Redis of the Redis tier, which must
    answer; None: a local Redis (LOCAL_REDIS) where one answers, else no Redis tier."""
    redis_url = redis_to_time(redis_url)
    out_dir.mkdir(parents=True, exist_ok=True)
    contexts = contexts or [4096]
    rows: list[TierRow] = []
    report: dict[str, object] = {}
    cells = len(dtypes) * len(contexts)  # left to measure
    with Progress() as progress, tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        task = progress.add_task("store bench", total=cells)
        for dtype in dtypes:
            lm = load_model(ModelConfig(path=model_path, dtype=dtype, device=device))
            for context in contexts:
                rows += bench_dtype(
                    lm, context, chunk_tokens, repeats, redis_url, Path(tmp), strategy
                )
                progress.advance(task)
                # after each case: a stopped run keeps what it measured ("complete": false)
                cells -= 1
                report = save_report(
                    out_dir,
                    "store",
                    rows,
                    partial(plot_store, rows),
                    contexts=contexts,
                    chunk_tokens=chunk_tokens,
                    strategy=str(strategy),
                    repeats=repeats,
                    complete=cells == 0,
                )
    return report


def redis_to_time(url: str | None) -> str | None:
    """The Redis the bench times: `url`, which must answer (StoreUnavailableError says why
    not, before any model loads), or where none is given LOCAL_REDIS if it answers; else
    None, said on stderr (a bench without a Redis measures the other tiers)."""
    try:
        RedisTier(url or LOCAL_REDIS, prefix="rag-kvcache-bench:").close()
    except (StoreUnavailableError, MissingExtraError) as err:
        if url:
            raise
        why = (
            "the redis package is not installed"
            if isinstance(err, MissingExtraError)
            else f"no Redis answers at {LOCAL_REDIS}"
        )
        print(f"{why}: the Redis tier is not timed", file=sys.stderr)
        return None
    return url or LOCAL_REDIS


def plot_store(rows: list[TierRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r.dtype for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        mine = [r for r in rows if r.dtype == dtype]
        if len({r.context_tokens for r in mine}) > 1:  # TTFT against context, a line per tier
            for tier in dict.fromkeys(r.tier for r in mine):
                pts = [(r.context_tokens, r.ttft_s) for r in mine if r.tier == tier]
                ax.plot(*zip(*pts, strict=True), marker="o", label=tier)
            ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (s)")
            ax.set_title(f"TTFT by where chunks come from, {dtype}")
            ax.legend(fontsize=8)
            continue
        bars = ax.bar(
            [r.tier for r in mine],
            [r.ttft_s for r in mine],
            color=["tab:blue" if r.tier == "prefill" else "tab:green" for r in mine],
        )
        ax.bar_label(bars, labels=[f"{r.ttft_s:.2f}s" for r in mine], fontsize=8)
        ax.set(
            yscale="log",
            ylabel="TTFT (s)",
            title=f"TTFT by where chunks come from, {dtype}, {mine[0].context_tokens} tokens",
        )
        ax.tick_params(axis="x", rotation=30)  # "disk (read whole)" and its neighbours overlapped
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
