"""Named stages of a request, marked in the hot path so that `bench ttft` can say where time
to first token goes (store fetch, selection, placement, forward, choosing the token).

A mark (`stage`) is a `torch.profiler.record_function` range: with no profiler running it
costs a microsecond or so; under one (`stage_seconds`) each stage's time is read off the trace.
Times are wall-clock on the host. On a GPU a stage only queues its kernels, which finish in
whichever later stage first waits for a result; `stage_seconds(synchronize=...)` waits at the
end of every stage instead, so that each one's time holds its own kernels (for a profiled
request only: the waits are not in the timed ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

__all__ = ["STAGES", "stage", "stage_seconds"]

_stage_end: Callable[[], None] | None = None  # set only while `stage_seconds` runs


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark one stage of a request (a profiler range named `name`)."""
    with record_function(name):
        yield
        if _stage_end is not None:
            _stage_end()


def stage_seconds(
    run: Callable[[], T], synchronize: Callable[[], None] | None = None
) -> tuple[T, dict[str, float]]:
    """Run `run()` under the profiler: its result and the seconds spent in each stage (the
    stage names without their prefix; stages not entered are 0). `synchronize` (on a GPU,
    `torch.cuda.synchronize`) is called at the end of every stage, inside it. Not for
    concurrent requests: every request's stages wait while it runs."""
    global _stage_end
    _stage_end = synchronize
    try:
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            result = run()
    finally:
        _stage_end = None
    seconds = dict.fromkeys(STAGES, 0.0)
    for event in trace.events():
        if event.name in seconds:
            seconds[event.name] += event.cpu_time_total / 1e6  # µs
    return result, {name.removeprefix("rag_kvcache."): s for name, s in seconds.items()}
