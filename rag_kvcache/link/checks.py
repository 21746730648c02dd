"""What linking refuses, and why: clear errors before any buffer is allocated.

`check_chunks`: a strategy that does not link, nothing to link, cacheblend after a linked
prefix, an empty question, KV from another model (fingerprint, dtype the model cannot widen
it from, shape), a context or question longer than the model's window, legolink0 without sink
tokens. `check_calibration`: a `+calibrated` strategy without its calibration or the reverse,
a calibrated link after a linked prefix, one too long with its link tokens. `widens`: which
stored KV dtypes link exactly into which model dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rag_kvcache.errors import (
    CalibrationError,
    ContextTooLongError,
    DtypeMismatchError,
    FingerprintMismatchError,
    StrategyError,
)
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import Strategy

if TYPE_CHECKING:  # linker imports this module: the prefix's type only, for annotations
    from rag_kvcache.link.linker import LinkedPrefix


def widens(stored: torch.dtype, model: torch.dtype) -> bool:
    """Whether KV stored in `stored` is linked into a `model`-dtype context exactly: its own
    dtype, or bfloat16 into float32 (a bfloat16 blob of float32 KV, read as stored and widened
    as it is placed)."""
    return stored == model or (stored == torch.bfloat16 and model == torch.float32)


def check_calibration(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    calibration: Calibration | None,
    prefix: LinkedPrefix | None,
    query_tokens: int,
) -> None:
    """A calibration goes with `+calibrated` strategies, on the model and chunks it fits."""
    if strategy.calibrated and calibration is None:
        raise CalibrationError(
            f"{strategy} needs the model's link calibration: run `rag-kvcache calibrate`"
        )
    if calibration is not None:
        if not strategy.calibrated:
            raise StrategyError(f"a calibration was given to {strategy}, which is not +calibrated")
        if prefix is not None:
            raise StrategyError(
                "a calibrated link cannot extend a linked prefix yet: the prefix tree does not "
                "keep link tokens"
            )
        calibration.check_compatible(lm, chunks)
        total = sum(c.num_tokens for c in chunks) + query_tokens
        total += calibration.link_tokens * (len(chunks) - 1)
        if total > lm.max_context:
            raise ContextTooLongError(
                f"{total} tokens (context, link tokens and query) exceed the model's window of "
                f"{lm.max_context}; retrieve fewer or smaller chunks"
            )


def check_chunks(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    strategy: Strategy,
    query_tokens: int,
    prefix: LinkedPrefix | None = None,
) -> None:
    """Clear errors for KV that cannot be linked into this model's context."""
    if not strategy.uses_cache or strategy.kind == "positions":
        raise StrategyError(f"{strategy} is not a link strategy")
    if not chunks and prefix is None:
        raise StrategyError("nothing to link: pass at least the system prefix chunk")
    if prefix is not None and strategy.kind == "cacheblend":
        raise StrategyError(
            "cacheblend picks tokens over the whole context, so it cannot extend a linked prefix"
        )
    if query_tokens < 1:
        raise StrategyError("the query must have at least one token")
    for c in chunks:
        if c.fingerprint != lm.fingerprint:
            raise FingerprintMismatchError(
                f"chunk {c.cache_id} was encoded by model {c.fingerprint}, not by the loaded "
                f"model {lm.fingerprint} ({lm.name}, {lm.dtype}); ingest its text again with "
                "this model"
            )
        if not (widens(c.keys.dtype, lm.dtype) and widens(c.values.dtype, lm.dtype)):
            raise DtypeMismatchError(
                f"chunk {c.cache_id} holds {c.keys.dtype} KV; the model computes in {lm.dtype}"
            )
        expected = (lm.num_layers, lm.num_kv_heads, c.num_tokens, lm.head_dim)
        if tuple(c.keys.shape) != expected or tuple(c.values.shape) != expected:
            raise FingerprintMismatchError(
                f"chunk {c.cache_id} KV shape {tuple(c.keys.shape)} != expected {expected}"
            )
    total = sum(c.num_tokens for c in chunks) + query_tokens + (prefix.num_tokens if prefix else 0)
    system = (prefix.system_tokens or 0) if prefix is not None else chunks[0].num_tokens
    if system + query_tokens > lm.max_context:  # no retrieval makes room for it
        raise ContextTooLongError(
            f"the question is {query_tokens} tokens, more than the model's window of "
            f"{lm.max_context} holds after the system prompt: ask a shorter question"
        )
    if total > lm.max_context:
        raise ContextTooLongError(
            f"{total} tokens (context + query) exceed the model's window of {lm.max_context}; "
            "retrieve fewer or smaller chunks"
        )
    documents = chunks if prefix is not None else chunks[1:]
    if strategy.kind == "legolink0" and any(c.start == 0 for c in documents):
        raise StrategyError(
            "legolink0 needs document chunks encoded with sink tokens "
            "(EncodeConfig(sink_tokens=N) with N > 0); these were encoded without"
        )
