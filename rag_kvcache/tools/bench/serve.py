"""`rag-kvcache bench serve`: the HTTP server under load, concurrent clients against one at a
time.

The benchmark starts `rag-kvcache serve`'s app in this process (uvicorn on a free loopback
port) over chunks cut from the sample corpus, then for each case sends a fixed number of
streamed chat requests (`rag.cache_ids`) from N concurrent clients and stops by itself:

- **shared**: every request answers over the same chunks (a popular context of
  `--context-tokens`), each with its own question: the prefix tree links the context once and
  the batch attends to it once per step;
- **distinct**: every request has chunks of its own (a quarter of that context each), so
  nothing but the system prompt is shared.

Each case runs with 1 client (requests served one after another) and with `--clients` at once.
Reported per case: requests/s, generated tokens/s, p50 / p95 time to first token as the client
sees it (first streamed text), p95 of each request's longest pause between two streamed pieces
(what newly arrived requests' linking costs the streams already running), and the decoder's
peak KV bytes (prefix tree + the batch's rows).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import Progress

from rag_kvcache.config import EngineConfig, GenerationConfig, ModelConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.model.loading import load_model
from rag_kvcache.tools.bench import CHUNK_TOKENS, check_whole_chunks
from rag_kvcache.tools.bench.report import cache_chunks, corpus_tokens, save_report

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class ServeRow:
    context: str  # "shared" or "distinct"
    clients: int  # requests in flight at once
    requests: int
    context_tokens: int  # of each request's chunks
    seconds: float
    requests_per_s: float
    tokens_per_s: float  # generated tokens over the whole run
    ttft_p50_s: float
    ttft_p95_s: float
    stall_p95_s: float  # each request's longest wait between two streamed pieces, p95
    peak_kv_bytes: int
    failed: int


@dataclass(frozen=True)
class Outcome:
    ttft_s: float
    tokens: int
    ok: bool
    stall_s: float = 0.0  # the longest wait between two pieces of text after the first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """The server's app on a free loopback port, in a thread of this process."""

    def __init__(self, engine: RagKVCache):
        import uvicorn

        from rag_kvcache.tools.server import create_app

        self.port = free_port()
        config = uvicorn.Config(
            create_app(lambda: engine), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        import httpx

        self.thread.start()
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the benchmark's server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def one_request(
    client: httpx.AsyncClient, url: str, question: str, ids: list[str], tokens: int
) -> Outcome:
    """One streamed chat request; TTFT is the first text the client receives."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "rag": {"cache_ids": ids},
    }
    start = time.perf_counter()
    ttft, generated, last, stall = None, 0, 0.0, 0.0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(0.0, 0, False)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return Outcome(0.0, 0, False)
            if any(c["delta"].get("content") for c in event["choices"]):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    stall = max(stall, now - last)
                last = now
            if event.get("usage"):
                generated = event["usage"]["completion_tokens"]
    return Outcome(
        ttft if ttft is not None else time.perf_counter() - start, generated, True, stall
    )


async def load(
    url: str, work: list[tuple[str, list[str]]], clients: int, tokens: int
) -> list[Outcome]:
    """Send every (question, cache IDs) with at most `clients` requests in flight."""
    import httpx

    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def send(question: str, ids: list[str]) -> Outcome:
            async with gate:
                return await one_request(client, url, question, ids, tokens)

        return list(await asyncio.gather(*(send(q, ids) for q, ids in work)))


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank; 0 for no values)."""
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run_case(
    engine: RagKVCache,
    url: str,
    context: str,
    work: list[tuple[str, list[str]]],
    clients: int,
    tokens: int,
) -> ServeRow:
    engine.clear_prefix_tree()  # every case links its context afresh
    decoder = engine.serving_loop().decoder
    decoder.peak_bytes = 0
    start = time.perf_counter()
    outcomes = asyncio.run(load(url, work, clients, tokens))
    seconds = time.perf_counter() - start
    ok = [o for o in outcomes if o.ok]
    return ServeRow(
        context=context,
        clients=clients,
        requests=len(work),
        context_tokens=len(work[0][1]) * CHUNK_TOKENS,
        seconds=seconds,
        requests_per_s=len(ok) / seconds,
        tokens_per_s=sum(o.tokens for o in ok) / seconds,
        ttft_p50_s=statistics.median([o.ttft_s for o in ok] or [0.0]),
        ttft_p95_s=p95([o.ttft_s for o in ok]),
        stall_p95_s=p95([o.stall_s for o in ok]),
        peak_kv_bytes=decoder.peak_bytes,
        failed=len(outcomes) - len(ok),
    )


def run_serve_bench(
    out_dir: Path,
    clients: int = 32,
    requests: int = 32,
    context_tokens: int = 2048,
    new_tokens: int = 32,
    model_path: str | None = None,
    dtype: str = "float32",
) -> dict[str, object]:
    check_whole_chunks("context_tokens", [context_tokens])
    out_dir.mkdir(parents=True, exist_ok=True)
    lm = load_model(ModelConfig(path=model_path, dtype=dtype))
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=new_tokens)), lm=lm)
    per_request = max(1, context_tokens // CHUNK_TOKENS)
    own = max(1, per_request // 4)
    # the popular context, then `own` chunks for each request: windows of the sample corpus
    # (repeated) at a prime stride, so no two are the same tokens
    count, stride = per_request + requests * own, CHUNK_TOKENS + 7
    tokens = corpus_tokens(lm, count * stride + CHUNK_TOKENS)
    chunks = [tokens[i * stride : i * stride + CHUNK_TOKENS] for i in range(count)]
    with Progress(transient=True) as progress:
        progress.add_task("encoding the benchmark's chunks", total=None)
        ids = cache_chunks(engine, chunks)
    assert len(set(ids)) == len(ids), "the benchmark's chunks must all differ"
    popular, rest = ids[:per_request], ids[per_request:]
    questions = [f"What does passage number {1000 + i} say?" for i in range(requests)]
    cases = {
        "shared": [(q, popular) for q in questions],
        "distinct": [(q, rest[i * own : (i + 1) * own]) for i, q in enumerate(questions)],
    }
    rows: list[ServeRow] = []

    def save() -> dict[str, object]:  # after each case: a stopped run keeps what it measured
        return save_report(
            out_dir,
            "serve",
            rows,
            lambda path: plot_serve(rows, path),
            complete=len(rows) == 2 * len(cases),
            model=lm.name,
            dtype=dtype,
            strategy=str(engine.config.strategy),
            new_tokens=new_tokens,
        )

    report: dict[str, object] = {}
    try:
        with LocalServer(engine) as url, Progress() as progress:
            task = progress.add_task("bench serve", total=2 * len(cases))
            for context, work in cases.items():
                for n in (1, clients):
                    rows.append(run_case(engine, url, context, work, n, new_tokens))
                    report = save()
                    progress.advance(task)
    finally:
        engine.close()
    return report


def plot_serve(rows: list[ServeRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r.context}\n{r.clients} at once" for r in rows]
    x = range(len(rows))
    speed.bar(x, [r.tokens_per_s for r in rows], color=[f"C{i % 2}" for i in x])
    speed.set_xticks(list(x), labels)
    speed.set_ylabel("generated tokens / s")
    speed.set_title("throughput")
    ttft.bar([i - 0.2 for i in x], [r.ttft_p50_s for r in rows], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [r.ttft_p95_s for r in rows], 0.4, label="p95")
    ttft.set_xticks(list(x), labels)
    ttft.set_ylabel("time to first token (s), as the client sees it")
    ttft.set_title("TTFT")
    ttft.legend()
    fig.suptitle(f"rag-kvcache serve, {rows[0].requests} streamed requests per case")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
