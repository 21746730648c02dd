"""What `eval` measures: one `ItemResult` per item and strategy, summed up per strategy
(`summarize`: accuracy and "kept" with their intervals, fidelity, TTFT) against the prefill
of the same placement (`baseline`), and the summary as a markdown table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass

from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.tools.metrics import (
    accuracy,
    kept,
)


@dataclass(frozen=True)
class ItemResult:
    item: str
    strategy: str
    answer: str
    token_ids: tuple[int, ...]  # the answer's tokens, as `RagKVCache.generate` gives them
    f1: float
    exact_match: float
    contains: bool
    kl: float  # mean next-token KL(full || strategy) over the teacher-forced steps (nan: none)
    top1: float  # share of those steps with the same most likely token as full (nan: none)
    ttft_s: float
    prefill_ttft_s: float  # a plain prefill of the same prompt, timed alongside
    context_tokens: int
    recomputed_tokens: int


@dataclass(frozen=True)
class StrategySummary:
    strategy: str
    items: int
    contains: float  # accuracy: % of items whose output holds a gold answer
    contains_low: float  # its 95% bootstrap interval
    contains_high: float
    kept: float  # % of the items prefill answers right that this strategy answers right too
    kept_low: float  # its 95% bootstrap interval
    kept_high: float
    kept_of: int  # items the baseline answers right
    baseline: str  # the prefill "kept" is counted against: the same placement
    f1: float  # mean, in points (0-100); only beside accuracy: F1 over sentences hides losses
    exact_match: float
    kl: float
    top1: float
    ttft_s: float  # median, over the timed items (all, but in a combined report)
    speedup: float  # median prefill TTFT / median TTFT, over the same items
    recomputed_fraction: float  # recomputed / context tokens, over all items
    timed_tokens: int  # the timed items' median context, in tokens


def baseline(strategy: Strategy) -> Strategy:
    """The prefill a strategy's "kept" is counted against: the same placement (prefill itself,
    in any order, against prefill as given: that is the noise floor)."""
    return strategy.baseline if strategy.uses_cache else PREFILL


def summarize(
    results: list[ItemResult], strategies: list[Strategy], timed: Collection[str] | None = None
) -> list[StrategySummary]:
    """Per strategy: accuracy and "kept" (against prefill with the same placement, on the same
    items) with 95% bootstrap intervals, F1 / EM beside them, fidelity (KL, top-1 vs full),
    TTFT and recompute share. TTFT and speedup are medians over the `timed` items (default:
    all): a median over items of 1K and 4K tokens together would describe neither."""
    right_by = {(r.strategy, r.item): r.contains for r in results}
    out = []
    for strategy in strategies:
        rows = [r for r in results if r.strategy == str(strategy)]
        clocked = [r for r in rows if timed is None or r.item in timed]
        ttft = statistics.median(r.ttft_s for r in clocked)
        right = [r.contains for r in rows]
        acc = accuracy(right)
        base = str(baseline(strategy))
        keep = kept([right_by[base, r.item] for r in rows], right)
        out.append(
            StrategySummary(
                strategy=str(strategy),
                items=len(rows),
                contains=acc.value,
                contains_low=acc.low,
                contains_high=acc.high,
                kept=keep.value,
                kept_low=keep.low,
                kept_high=keep.high,
                kept_of=keep.n,
                baseline=base,
                f1=100 * statistics.fmean(r.f1 for r in rows),
                exact_match=100 * statistics.fmean(r.exact_match for r in rows),
                kl=statistics.fmean(r.kl for r in rows),
                top1=statistics.fmean(r.top1 for r in rows),
                ttft_s=ttft,
                speedup=statistics.median(r.prefill_ttft_s for r in clocked) / ttft,
                recomputed_fraction=sum(r.recomputed_tokens for r in rows)
                / sum(r.context_tokens for r in rows),
                timed_tokens=round(statistics.median(r.context_tokens for r in clocked)),
            )
        )
    return out


def markdown_table(summary: list[StrategySummary]) -> str:
    lines = [
        "| strategy | accuracy [95% CI] | kept of the baseline's right [95% CI] | F1 | EM "
        "| KL vs full | top-1 vs full | TTFT s | speedup | recomputed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s.strategy} | {s.contains:.1f}% [{s.contains_low:.1f}, {s.contains_high:.1f}] "
            f"| {_share(s.kept, s.kept_low, s.kept_high)} of {s.kept_of} "
            f"({s.baseline}) | {s.f1:.1f} | {s.exact_match:.1f} "
            f"| {_or_dash(s.kl, '.4f')} | {_or_dash(s.top1, '.1%')} | {s.ttft_s:.3f} "
            f"| {s.speedup:.1f}x "
            f"| {s.recomputed_fraction:.1%} |"
        )
    return "\n".join(lines) + "\n"


def _or_dash(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _share(value: float, low: float, high: float) -> str:
    """A percentage with its interval; a dash where there was nothing to count (no right
    answer of the baseline's to keep)."""
    return "–" if math.isnan(value) else f"{value:.1f}% [{low:.1f}, {high:.1f}]"
