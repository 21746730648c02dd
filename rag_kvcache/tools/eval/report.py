"""A run's report as written: the sections past the main table (`comparisons`: the
noise floor, the needles), its JSON form (`report_dict`: the settings, the machine, the
summary and every row) and the files of `save_eval` (JSON, the markdown table, plots).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from rag_kvcache.strategy import Strategy
from rag_kvcache.tools import report_json
from rag_kvcache.tools.eval.floor import OtherRun, against_floor, floor_table
from rag_kvcache.tools.eval.needle import needle_cells, needle_cells_table
from rag_kvcache.tools.eval.plots import plot_kl, plot_pareto
from rag_kvcache.tools.eval.results import ItemResult, StrategySummary, markdown_table


def comparisons(
    results: list[ItemResult],
    strategies: list[Strategy],
    needle: bool = False,
    other: OtherRun | None = None,
) -> tuple[str, dict[str, object]]:
    """The report's sections past the main table, as markdown and as JSON facts: each cache
    strategy against the noise floor (`against_floor`, with `other`'s prefills too) and, for
    needles, where prefill finds every needle (`needle_cells`)."""
    floor = against_floor(results, strategies, other)
    facts: dict[str, object] = {"floor": [asdict(r) for r in floor]}
    text = ""
    if floor:
        text += (
            "\nKept beside the noise floor: of the answers the baseline (the prefill of the "
            "same prompt) gets right, how many the strategy keeps and how many a prefill with "
            "the chunks in another order keeps (or, named so, the baseline of another run, "
            "e.g. in another dtype); the difference with its paired 95% interval.\n\n"
            + floor_table(floor)
        )
    if needle:
        cells = needle_cells(results, strategies)
        facts["needle_cells"] = [asdict(c) for c in cells]
        text += (
            "\nWhere a prefill finds every needle of a length and depth: the needles the "
            "strategy finds in those cells.\n\n" + needle_cells_table(cells)
        )
    return text, facts


def save_eval(
    out_dir: Path,
    name: str,
    report: dict[str, object],
    summary: list[StrategySummary],
    sections: str = "",
):
    """NAME.json, NAME.md (the table, then `sections`: more markdown) and two plots: speed vs
    accuracy and kept, and KL vs k where a KL was measured (teacher forcing; an earlier
    run's KL plot in out_dir is removed otherwise, not left to stand for this run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(report_json.dumps(report, indent=2))
    (out_dir / f"{name}.md").write_text(markdown_table(summary) + sections)
    plot_pareto(summary, out_dir / f"{name}_pareto.png")
    if any(math.isfinite(s.kl) for s in summary):
        plot_kl(summary, out_dir / f"{name}_kl_k.png")
    else:
        (out_dir / f"{name}_kl_k.png").unlink(missing_ok=True)


def report_dict(kind: str, results: list[ItemResult], summary: list[StrategySummary], **facts):
    from rag_kvcache.tools.bench.report import machine_facts

    return {
        "benchmark": kind,
        **facts,
        "machine": machine_facts(),
        "summary": [asdict(s) for s in summary],
        "items": [asdict(r) for r in results],
    }
