"""Prometheus metrics of one server process (`GET /metrics`), in its own registry.

Per answer: time to first token (histogram), tokens generated and prompt tokens (counters:
`rate()` gives tokens/s), context tokens and those reused from the prefix tree (their ratio is
the tree's hit rate). Read at scrape time: the requests decoding now (the batch size) and
waiting for room, the KV held against its budget, and the store's hits per tier, which the
catalog counts for every worker sharing the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rag_kvcache.answer import Answer
from rag_kvcache.serving.batch import BatchLoad

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LiveState(Collector):
    """Gauges read when Prometheus scrapes: `batch()` the decoder's load and the KV budget,
    `hits()` the store's hits per tier."""

    def __init__(
        self, batch: Callable[[], tuple[BatchLoad, int]], hits: Callable[[], dict[str, int]]
    ):
        self.batch, self.hits = batch, hits

    def collect(self) -> Iterator[Metric]:
        load, budget = self.batch()
        for name, text, value in (
            ("rag_kvcache_batch_size", "requests decoding in the batch now", load.decoding),
            ("rag_kvcache_waiting_requests", "requests waiting for room", load.waiting),
            ("rag_kvcache_kv_bytes", "KV held: shared prefixes, the batch's rows", load.kv_bytes),
            ("rag_kvcache_kv_budget_bytes", "what that KV may reach", budget),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge
        hits = self.hits()
        total = sum(hits.values())
        counter = CounterMetricFamily(
            "rag_kvcache_store_hits", "chunks fetched from each tier of the store", labels=["tier"]
        )
        ratio = GaugeMetricFamily(
            "rag_kvcache_store_hit_ratio",
            "share of chunk fetches each tier served",
            labels=["tier"],
        )
        for tier, n in sorted(hits.items()):
            counter.add_metric([tier], n)
            ratio.add_metric([tier], n / total if total else 0.0)
        yield counter
        yield ratio


class ServerMetrics:
    def __init__(
        self, batch: Callable[[], tuple[BatchLoad, int]], hits: Callable[[], dict[str, int]]
    ):
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "rag_kvcache_ttft_seconds",
            "time to first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.generated = Counter(
            "rag_kvcache_generated_tokens", "tokens generated", registry=self.registry
        )
        self.prompt = Counter("rag_kvcache_prompt_tokens", "prompt tokens", registry=self.registry)
        self.context = Counter(
            "rag_kvcache_context_tokens",
            "cached context tokens answered over",
            registry=self.registry,
        )
        self.reused = Counter(
            "rag_kvcache_prefix_tree_reused_tokens",
            "context tokens taken already linked from the prefix tree",
            registry=self.registry,
        )
        self.requests = Counter(
            "rag_kvcache_requests", "requests by outcome", ["outcome"], registry=self.registry
        )
        self.registry.register(LiveState(batch, hits))

    def answered(self, answer: Answer) -> None:
        self.requests.labels("ok").inc()
        self.ttft.observe(answer.ttft_s)
        self.generated.inc(len(answer.token_ids))
        self.prompt.inc(answer.prompt_tokens)
        self.context.inc(answer.context_tokens)
        self.reused.inc(answer.reused_tokens)

    def failed(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def aborted(self) -> None:
        """A request whose answer never reached its end: the client left, or the server,
        stopping, cut its stream."""
        self.requests.labels("aborted").inc()
