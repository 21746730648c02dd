"""Rows written as they are measured and read back: the `Journal` a killed run resumes
from, and the checks a row (`item_result`) and a report's rows (`check_rows`) pass when read
from JSON.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rag_kvcache.errors import ConfigError
from rag_kvcache.tools import report_json
from rag_kvcache.tools.eval.results import ItemResult


class Journal:
    """An evaluation's results so far, one JSON line per item after a header line holding the
    run's settings. Resuming checks the settings first: results measured under other settings
    (another model, dataset, strategy list, ...) are never mixed into a report. Each item's
    line keeps its digest (`reuse.item_digests`: its question, documents and answers), so an
    item edited in the dataset file since (the settings name the file, not its contents) is
    refused too."""

    def __init__(self, path: Path, settings: dict[str, object], digests: Mapping[str, str]):
        self.path = Path(path)
        self.digests = digests
        settings = json.loads(json.dumps(settings))  # as it reads back from JSON
        self._done: dict[str, list[ItemResult]] = {}
        kept_lines = [json.dumps({"settings": settings})]
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
            try:
                header = json.loads(lines[0]) if lines else None
            except (json.JSONDecodeError, RecursionError):
                header = None
            if header != {"settings": settings} and any(line.strip() for line in lines[1:]):
                raise ConfigError(
                    f"{self.path} holds an unfinished run with other settings (or is not an "
                    f"eval journal); delete it or write to another --out"
                )
            for line in lines[1:]:
                if line.startswith("["):  # an earlier version's line: rows, no digest
                    raise ConfigError(
                        f"{self.path} was written by an earlier rag-kvcache, which kept no "
                        "digest of its items; delete it or write to another --out"
                    )
                digest, rows = _line(line)
                if rows is None:  # cut short by a kill: that item is run again
                    break
                item = rows[0].item
                if digest != digests.get(item, digest):
                    raise ConfigError(
                        f"{self.path} measured item {item} as the dataset had it then, not as "
                        "it is now (its question, documents or answers changed); delete it "
                        "or write to another --out"
                    )
                self._done[item] = rows
                kept_lines.append(line)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text("".join(f"{line}\n" for line in kept_lines), encoding="utf-8")
        partial.replace(self.path)

    def results(self) -> dict[str, list[ItemResult]]:
        """Item id -> its results, for the items a previous run finished."""
        return dict(self._done)

    def append(self, rows: list[ItemResult]) -> None:
        line = {"digest": self.digests.get(rows[0].item), "rows": [asdict(r) for r in rows]}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(report_json.dumps(line) + "\n")
            f.flush()

    def close(self) -> None:
        """The run finished and its report is written: the next run starts afresh."""
        self.path.unlink(missing_ok=True)


def item_result(row: dict[str, Any]) -> ItemResult:
    """An ItemResult from its JSON form (a report's or a journal's row); a value of another
    kind is a TypeError (`"contains": "no"` would count as right), one that no measurement
    gives (an F1 of 7, a negative or NaN TTFT) a ValueError."""
    if not isinstance(row, dict):  # (a report's "items": "x" gave an AttributeError)
        raise TypeError(f"a row must be an object, not {type(row).__name__}")
    # a measurement without a value is null in the JSON (`report_json`), NaN here
    unmeasured = {name: math.nan for name in ("kl", "top1") if row.get(name, 0) is None}
    result = ItemResult(**{**row, **unmeasured, "token_ids": tuple(row["token_ids"])})
    kinds = {"item": str, "strategy": str, "answer": str, "contains": bool}
    kinds |= {"context_tokens": int, "recomputed_tokens": int}
    for name, kind in kinds.items():
        if not isinstance(getattr(result, name), kind):
            raise TypeError(f"{name} must be {kind.__name__}, not {getattr(result, name)!r}")
    for name in ("f1", "exact_match", "kl", "top1", "ttft_s", "prefill_ttft_s"):
        value = getattr(result, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a number, not {value!r}")
    # a value no measurement gives: an F1 of 7 or a negative TTFT would skew every summary
    f1, em, top1 = result.f1, result.exact_match, result.top1
    if not (0 <= f1 <= 1 and 0 <= em <= 1 and (math.isnan(top1) or 0 <= top1 <= 1)):
        raise ValueError(f"f1, exact_match and top1 are shares in [0, 1], not {[f1, em, top1]}")
    if not (math.isnan(result.kl) or 0 <= result.kl < math.inf):
        raise ValueError(f"kl must be finite and at least 0, not {result.kl!r}")
    if not all(0 < t < math.inf for t in (result.ttft_s, result.prefill_ttft_s)):
        raise ValueError(
            f"TTFTs must be finite and positive, not {result.ttft_s!r}, {result.prefill_ttft_s!r}"
        )
    if not 0 <= result.recomputed_tokens <= result.context_tokens:
        raise ValueError(
            f"recomputed_tokens {result.recomputed_tokens} is not within the context's "
            f"{result.context_tokens}"
        )
    return result


def check_rows(path: Path, rows: list[ItemResult], strategies: list[str]) -> None:
    """A report's rows are one per item and strategy it lists: a row twice or missing would
    count an item twice, or compare strategies over different items."""
    if not rows:
        raise ConfigError(f"{path}: no rows")
    counts = Counter((r.item, r.strategy) for r in rows)
    if twice := [key for key, n in counts.items() if n > 1]:
        raise ConfigError(f"{path}: item {twice[0][0]} has {counts[twice[0]]} {twice[0][1]} rows")
    items = dict.fromkeys(r.item for r in rows)
    if missing := [(i, s) for i in items for s in strategies if (i, s) not in counts]:
        raise ConfigError(
            f"{path}: item {missing[0][0]} has no {missing[0][1]} row ({len(missing)} missing)"
        )


def _line(line: str) -> tuple[str | None, list[ItemResult] | None]:
    """An item's journal line: its digest and its rows (None: a line cut short)."""
    try:
        data = json.loads(line)
        rows = [item_result(row) for row in data["rows"]]
        digest = data.get("digest")
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError):  # (JSON's too)
        return None, None
    return digest, rows or None
