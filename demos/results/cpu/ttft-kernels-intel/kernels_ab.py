"""A/B in one process: float32 CPU kernels, torch's own (MKL's sgemm for the linears, the fused
`scaled_dot_product_attention`) against oneDNN's (`model.cpu_linear`, `model.cpu_attention`),
alternated request by request at 4K tokens: prefill, four strategies, and decoding (32 tokens
after `legolink:2`). Usage: python kernels_ab.py [rounds]"""

import statistics
import sys

from rag_kvcache.config import ModelConfig
from rag_kvcache.model import cpu_kernels, cpu_linear
from rag_kvcache.model.loading import load_model
from rag_kvcache.strategy import DEFAULT
from rag_kvcache.tools.bench.report import (
    bench_engines,
    cache_chunks,
    corpus_tokens,
    machine_facts,
    question_text,
)

CHUNK, CHUNKS, QUESTION, DECODED = 256, 16, 32, 32
cpu_kernels.CHOSEN = True  # loaded with oneDNN's linears; each request chooses
lm = load_model(ModelConfig(dtype="float32"))
engine, _ = bench_engines(lm)
pool = corpus_tokens(lm, CHUNK * CHUNKS + QUESTION)
ids = cache_chunks(engine, [pool[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)])
question = question_text(engine, pool[-QUESTION:], QUESTION)
strategies = ["prefill", "naive", "legolink:2", "legolink:16", str(DEFAULT)]
ARMS = ("torch", "onednn")


def answer(strategy: str, kernels: str, tokens: int = 1):  # type: ignore[no-untyped-def]
    cpu_kernels.CHOSEN = kernels == "onednn" and cpu_linear.AVAILABLE
    return engine.generate(question, ids, strategy=strategy, max_new_tokens=tokens)


cases = [(s, k) for s in strategies for k in ARMS]
for case in cases:  # warm-up: kernels built, buffers allocated
    answer(*case)
times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
decode: dict[str, list[float]] = {k: [] for k in ARMS}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for case in cases:
        times[case].append(answer(*case).ttft_s)
    for kernels in ARMS:
        decode[kernels].append(answer("legolink:2", kernels, DECODED).decode_tokens_per_s)
median = {case: statistics.median(runs) for case, runs in times.items()}
facts = machine_facts()
print(f"{facts['cpu']}, {facts['cores']} threads, torch {facts['torch']}, {facts['date']}")
print(f"{'strategy':48s} {'kernels':7s} {'TTFT ms':>8s} {'speedup':>7s}  runs (ms)")
for (strategy, kernels), runs in times.items():
    speedup = median[("prefill", kernels)] / median[(strategy, kernels)]
    print(
        f"{strategy:48s} {kernels:7s} {median[(strategy, kernels)] * 1e3:8.1f} {speedup:6.1f}x"
        f"  {[round(t * 1e3) for t in runs]}"
    )
for kernels, rates in decode.items():
    print(
        f"decoding after legolink:2, {kernels}: median {statistics.median(rates):.1f} tokens/s"
        f"  {[round(r, 1) for r in rates]}"
    )
