"""A/B in one process: `legolink:2` (and `naive`, the control) at 4K tokens, the link
forward's attention planned by `attention.cut_rows` as the library does (two blocks for
`legolink:2`) or forced into one block (a per-call overhead of 10,000 rows), alternated
request by request. Usage: python blocks.py [rounds]"""

import statistics
import sys

from rag_kvcache.config import ModelConfig
from rag_kvcache.model import attention
from rag_kvcache.model.loading import load_model
from rag_kvcache.tools.bench.report import (
    bench_engines,
    cache_chunks,
    corpus_tokens,
    question_text,
)

CHUNK, CHUNKS, QUESTION = 256, 16, 32
lm = load_model(ModelConfig(dtype="float32"))
engine, _ = bench_engines(lm)
pool = corpus_tokens(lm, CHUNK * CHUNKS + QUESTION)
ids = cache_chunks(engine, [pool[i * CHUNK : (i + 1) * CHUNK] for i in range(CHUNKS)])
question = question_text(engine, pool[-QUESTION:], QUESTION)
planned = dict(attention.CALL_ROWS)


def ttft(strategy: str, one_block: bool) -> float:
    attention.CALL_ROWS.update({k: 10_000 if one_block else v for k, v in planned.items()})
    return engine.generate(question, ids, strategy=strategy, max_new_tokens=1).ttft_s


cases = [(s, one) for s in ("naive", "legolink:2") for one in (False, True)]
for case in cases:  # warm-up: kernels built, buffers allocated
    ttft(*case)
times: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
    for case in cases:
        times[case].append(ttft(*case))
for (strategy, one), runs in times.items():
    plan = "one block" if one else "cut_rows "
    median = statistics.median(runs) * 1e3
    print(f"{strategy:12s} {plan}: median {median:.1f} ms  {[round(t * 1e3) for t in runs]}")
