"""Named stages of a request, marked in the hot path so that `bench ttft` can say where time
to first token goes (store fetch, selection, placement, forward, choosing the token).

A mark (`stage`) is a `torch.profiler.record_function` range, so a user's own profiler trace
shows the stages; with none running it costs a microsecond or so. `stage_seconds` sums each
stage's wall-clock time on the host itself (no profiler: starting one makes torch's profiler
library print two lines per request, and its trace holds every op, which only the stage totals
are read from). On a GPU a stage only queues its kernels, which finish in
whichever later stage first waits for a result; `stage_seconds(synchronize=...)` waits at the
end of every stage instead, so that each one's time holds its own kernels (for a profiled
request only: the waits are not in the timed ones).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from torch.autograd.profiler import record_function

STAGE_FETCH = "rag_kvcache.fetch"  # chunk KV from the store (any tier)
STAGE_SELECT = "rag_kvcache.select"  # which context tokens to recompute
STAGE_PLACE = "rag_kvcache.place"  # chunks into one buffer, keys re-rotated
STAGE_FORWARD = "rag_kvcache.forward"  # the model: recomputed tokens + question (or prefill)
STAGE_CHOOSE = "rag_kvcache.choose_token"  # logits -> token
STAGES = (STAGE_FETCH, STAGE_SELECT, STAGE_PLACE, STAGE_FORWARD, STAGE_CHOOSE)
T = TypeVar("T")

__all__ = ["STAGES", "stage", "stage_seconds"]

_stage_end: Callable[[], None] | None = None  # set only while `stage_seconds` runs
_seconds: dict[str, float] | None = None  # each stage's total, only while `stage_seconds` runs


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark one stage of a request (a profiler range named `name`); under `stage_seconds`,
    time it, with the wait for its queued work (`synchronize`) inside."""
    with record_function(name):
        seconds = _seconds
        start = time.perf_counter()
        yield
        if _stage_end is not None:
            _stage_end()
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def stage_seconds(
    run: Callable[[], T], synchronize: Callable[[], None] | None = None
) -> tuple[T, dict[str, float]]:
    """Run `run()` with its stages timed: its result and the seconds spent in each stage (the
    stage names without their prefix; stages not entered are 0). `synchronize` (on a GPU,
    `torch.cuda.synchronize`) is called at the end of every stage, inside it. Not for
    concurrent requests: a stage another thread enters meanwhile counts too."""
    global _stage_end, _seconds
    _stage_end, _seconds = synchronize, dict.fromkeys(STAGES, 0.0)
    try:
        result = run()
        seconds = _seconds
    finally:
        _stage_end, _seconds = None, None
    return result, {name.removeprefix("rag_kvcache."): s for name, s in seconds.items()}
