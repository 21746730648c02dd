"""`timing`: the stages a profiled request reports, and the wait at each stage's end that makes
a GPU stage's time hold its own kernels."""

from __future__ import annotations

import time

import pytest

from rag_kvcache.timing import STAGE_FETCH, STAGE_FORWARD, STAGE_PLACE, stage, stage_seconds


def test_each_stage_entered_is_timed_and_the_others_are_zero() -> None:
    def run() -> str:
        with stage(STAGE_FETCH):
            time.sleep(0.05)
        with stage(STAGE_FORWARD):
            time.sleep(0.02)
        return "done"

    result, seconds = stage_seconds(run)
    assert result == "done"
    assert set(seconds) == {"fetch", "select", "place", "forward", "choose_token"}
    assert 0.05 <= seconds["fetch"] < 1 and 0.02 <= seconds["forward"] < 1
    assert seconds["select"] == seconds["place"] == seconds["choose_token"] == 0.0


def test_synchronize_runs_at_the_end_of_every_stage_and_counts_in_it() -> None:
    calls: list[float] = []

    def synchronize() -> None:  # stands in for torch.cuda.synchronize: the queued work
        time.sleep(0.03)
        calls.append(time.perf_counter())

    def run() -> None:
        with stage(STAGE_PLACE):
            pass
        with stage(STAGE_PLACE):
            pass
        with stage(STAGE_FORWARD):
            pass

    _, seconds = stage_seconds(run, synchronize)
    assert len(calls) == 3
    assert seconds["place"] >= 0.06 and seconds["forward"] >= 0.03  # the waits are inside
    with stage(STAGE_FORWARD):  # outside stage_seconds: no wait
        pass
    assert len(calls) == 3


def test_a_failing_request_leaves_no_wait_behind() -> None:
    calls: list[int] = []

    def run() -> None:
        with stage(STAGE_FETCH):
            raise ValueError("unknown cache ID")

    with pytest.raises(ValueError, match="unknown cache ID"):
        stage_seconds(run, lambda: calls.append(1))
    with stage(STAGE_FETCH):
        pass
    assert calls == []  # not at the failed stage's end, nor after stage_seconds


def test_the_stages_stay_marks_in_a_users_own_profiler_trace() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        _, seconds = stage_seconds(lambda: _sleep_in(STAGE_FETCH, 0.01))
    assert seconds["fetch"] >= 0.01
    assert STAGE_FETCH in {event.name for event in trace.events()}


def _sleep_in(name: str, duration: float) -> None:
    with stage(name):
        time.sleep(duration)
