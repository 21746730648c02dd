"""Named stages of a request, marked in the hot path so that `bench ttft` can say where time
to first token goes (store fetch, selection, placement, forward, choosing the token).

A mark is a `torch.profiler.record_function` range: with no profiler running it costs a
microsecond or so; under one (`stage_seconds`) each stage's time is read off the trace. Times
are wall-clock on the host: on CUDA, kernels queued in one stage may finish in a later one
(the first stage that waits for a result, choosing the token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

STAGE_FETCH = "rag_kvcache.fetch"  # chunk KV from the store (any tier)
STAGE_SELECT = "rag_kvcache.select"  # which context tokens to recompute
STAGE_PLACE = "rag_kvcache.place"  # chunks into one buffer, keys re-rotated
STAGE_FORWARD = "rag_kvcache.forward"  # the model: recomputed tokens + question (or prefill)
STAGE_CHOOSE = "rag_kvcache.choose_token"  # logits -> token
STAGES = (STAGE_FETCH, STAGE_SELECT, STAGE_PLACE, STAGE_FORWARD, STAGE_CHOOSE)
T = TypeVar("T")

__all__ = ["STAGES", "record_function", "stage_seconds"]


def stage_seconds(run: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run `run()` under the profiler: its result and the seconds spent in each stage (the
    stage names without their prefix; stages not entered are 0)."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        result = run()
    seconds = dict.fromkeys(STAGES, 0.0)
    for event in trace.events():
        if event.name in seconds:
            seconds[event.name] += event.cpu_time_total / 1e6  # µs
    return result, {name.removeprefix("rag_kvcache."): s for name, s in seconds.items()}
