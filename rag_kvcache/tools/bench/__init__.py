"""Benchmarks (`rag-kvcache bench ...`): each writes JSON and a PNG plot, measuring ratios side
by side in one run.
"""

from __future__ import annotations

from rag_kvcache.errors import ConfigError
from rag_kvcache.strategy import DEFAULT

CHUNK_TOKENS = 256  # tokens in a chunk of every bench's contexts (as `ingest` cuts them)
# why `bench ttft` refuses prefill as a strategy (it was measured twice, and the run lost)
BASELINE_ALWAYS = "prefill is the baseline, always measured: name link strategies only"
# `bench ttft`'s strategies where none are named: the plain ones, then the default (what
# answers use unless told otherwise)
TTFT_STRATEGIES = (
    "naive",
    "legolink:2",
    "legolink:16",
    "legolink0",
    "cacheblend:0.15",
    str(DEFAULT),
)
MIN_FILE_MB = 0.001  # `bench memory`'s smallest file, ~1 KB: most of a chunk (1e-9 wrote none)


def check_whole_chunks(what: str, tokens: list[int], chunk: int = CHUNK_TOKENS) -> None:
    """Each count of tokens is one or more whole chunks: a context of 300 was cut to one chunk
    (two rows named 320), a prefix of 100 to none (the system prompt alone)."""
    if bad := [t for t in tokens if t < chunk or t % chunk]:
        raise ConfigError(f"{what} must be multiples of {chunk} tokens, not {bad}")
