"""The noise floor: each cache strategy's "kept" beside that of a prefill with the chunks
in another order, or of another run's prefill (`--kept-against`, e.g. in another dtype),
with its paired interval (`against_floor`), and "kept" counted against another run's prefill
(`kept_against`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rag_kvcache.errors import ConfigError
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.eval.dataset import read_json_text
from rag_kvcache.tools.eval.results import ItemResult, baseline
from rag_kvcache.tools.eval.reuse import check_same_items
from rag_kvcache.tools.metrics import (
    Estimate,
    kept,
    kept_difference,
)


@dataclass(frozen=True)
class FloorRow:
    """A cache strategy's "kept" beside the noise floor's, on the same items: of the answers
    its baseline (prefill with its placement) gets right, how many it keeps and how many
    `floor` (a prefill with the chunks in another order, or the baseline in another run)
    keeps, and the difference in points with its paired 95% interval
    (`metrics.kept_difference`)."""

    strategy: str
    baseline: str
    floor: str
    of: int  # items the baseline answers right
    kept: int
    floor_kept: int
    difference: float  # points: kept - floor_kept, of `of`
    difference_low: float
    difference_high: float


@dataclass(frozen=True)
class OtherRun:
    """Another run's answers (`eval --kept-against`: the same prefill in bfloat16, say), read
    once for its kept counts (`kept_against`) and its noise floors (`against_floor`)."""

    report: str
    dtype: str
    right: Mapping[tuple[str, str], bool]  # (strategy, item) -> the gold answer in the output


def other_run(
    report: Path,
    digests: Mapping[str, str] | None = None,
    document_order: object = None,
) -> OtherRun:
    """The answered rows of another run's eval report. With this run's item `digests`
    (`item_digests`: item id -> digest) and `document_order`, checked before the run (not
    after it, hours later at 4K): the report answered each item with `prefill`, with the
    documents in the same order, and on the same questions and documents
    (`check_same_items`)."""
    text = read_json_text(Path(report))
    try:
        data = json.loads(text)
        rows = data["items"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError("items must be a list of objects")
        answered = [r for r in rows if "contains" in r]
        if wrong := [r["contains"] for r in answered if not isinstance(r["contains"], bool)]:
            raise TypeError(f"contains must be true or false, not {wrong[0]!r}")  # "no" is truthy
        right = {(str(r["strategy"]), str(r["item"])): r["contains"] for r in answered}
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # (JSON's too)
        raise ConfigError(f"{report}: not an eval report with prefill answers ({e!r})") from None
    if digests is not None:
        if missing := [i for i in digests if ("prefill", i) not in right]:
            raise ConfigError(f"{report} has no prefill answer for items {missing[:5]}")
        theirs = data.get("document_order")
        if theirs is not None and document_order is not None and theirs != document_order:
            raise ConfigError(  # (said as it is: the digests differ too, saying less)
                f"{report} read each item's documents in another order ({theirs!r}, this run "
                f"{document_order!r}): its prefill answers are not this run's baseline"
            )
        check_same_items(report, data, set(digests), digests, "count what this run keeps")
    return OtherRun(str(report), str(data.get("dtype")), right)


def against_floor(
    results: list[ItemResult], strategies: list[Strategy], other: OtherRun | None = None
) -> list[FloorRow]:
    """Every cache strategy against every noise floor the run measured: each prefill with an
    order other than its baseline's, and with `other`, the other run's prefill of the same
    placement (named "BASELINE (DTYPE, other run)"). Reordering a prefill's chunks, or
    computing it in another dtype, changes some of its answers on a small model; a cache that
    loses no more than that is as good as prefill for a user, and this says whether the items
    can tell the two apart."""
    right_by = {(r.strategy, r.item): r.contains for r in results}
    floors = [s for s in strategies if s.kind == "prefill"]
    rows = []
    for strategy in (s for s in strategies if s.uses_cache):
        base = baseline(strategy)
        items = [r.item for r in results if r.strategy == str(strategy)]
        # (the floor's name, its strategy, whose answers)
        candidates: list[tuple[str, str, Mapping[tuple[str, str], bool]]] = [
            (str(f), str(f), right_by) for f in floors if f != base
        ]
        if other is not None:
            candidates.append((f"{base} ({other.dtype}, other run)", str(base), other.right))
        for name, floor, known in candidates:
            if any((floor, i) not in known for i in items):
                continue  # measured on other items: not paired
            was = [right_by[str(base), i] for i in items]
            mine = [right_by[str(strategy), i] for i in items]
            theirs = [known[floor, i] for i in items]
            gap = kept_difference(was, mine, theirs)
            rows.append(
                FloorRow(
                    str(strategy),
                    str(base),
                    name,
                    gap.n,
                    sum(a and b for a, b in zip(was, mine, strict=True)),
                    sum(a and b for a, b in zip(was, theirs, strict=True)),
                    gap.value,
                    gap.low,
                    gap.high,
                )
            )
    return rows


def floor_table(rows: list[FloorRow]) -> str:
    """`against_floor`'s rows as a markdown table ("" when the run measured no floor)."""
    if not rows:
        return ""
    lines = [
        "| strategy | baseline's right | kept | floor | floor keeps | difference [95% CI] |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        gap = (  # nan: no right answer to keep, so no difference to give
            "–"
            if math.isnan(r.difference)
            else f"{r.difference:+.1f} pts [{r.difference_low:+.1f}, {r.difference_high:+.1f}]"
        )
        lines.append(
            f"| {r.strategy} | {r.of} ({r.baseline}) | {r.kept} | {r.floor} | {r.floor_kept} "
            f"| {gap} |"
        )
    return "\n".join(lines) + "\n"


def kept_against(
    results: list[ItemResult], other: OtherRun, same_placement: bool = False
) -> dict[str, Estimate]:
    """Per strategy of this run, "kept" against the `prefill` answers of another run
    (`other_run`) on the same items: prefill in bfloat16 against prefill in float32 is the
    noise floor of the dtype (a change of arithmetic no user would call a loss).
    `same_placement`: against the other run's prefill with each strategy's own placement
    (`baseline`), e.g. a model with a LoRA link calibration against the base model's prefill;
    a strategy whose placement the other run never prefilled is left out."""
    theirs = other.right
    out = {}
    for strategy in dict.fromkeys(r.strategy for r in results):
        # same placement: a prefill's too (prefill+reversed against prefill+reversed)
        against = str(Strategy.parse(strategy).baseline) if same_placement else "prefill"
        if same_placement and not any(s == against for s, _ in theirs):
            continue
        rows_ = [r for r in results if r.strategy == strategy]
        missing = sorted({r.item for r in rows_ if (against, r.item) not in theirs})
        if missing:
            raise ConfigError(f"{other.report} has no {against} answer for items {missing[:5]}")
        out[strategy] = kept([theirs[against, r.item] for r in rows_], [r.contains for r in rows_])
    return out
