"""Earlier reports read into a run: rows an earlier run measured under the same settings
(`reused_rows`, `--reuse`), and several reports of one setup read as one run (`combined`,
`--combine`); both refused for another model, other settings or other items.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rag_kvcache.errors import ConfigError, StrategyError
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.eval.dataset import EvalItem, read_json_text
from rag_kvcache.tools.eval.journal import check_rows, item_result
from rag_kvcache.tools.eval.results import ItemResult, summarize

# a report's rows stand for this run's only under these
REUSE_SETTINGS = ("dtype", "max_new_tokens", "teacher_tokens", "document_order", "lora")


# ... and the rows of strategies that read the cache only under this one too: how the durable
# tier kept the KV (None: as computed, in memory or durable alike; older reports lack it)
CACHE_SETTINGS = ("store_compress",)


def same_model(theirs: Mapping[str, object], ours: Mapping[str, object]) -> bool:
    """Two reports' models are the same weights: by fingerprint where both record one; older
    reports name the model only, and a converted GGUF's name ends in a tag of where and when
    it was converted on that machine, not of its weights."""
    if theirs.get("model_fingerprint") and ours.get("model_fingerprint"):
        return theirs["model_fingerprint"] == ours["model_fingerprint"]
    untagged = [re.sub(r"-[0-9a-f]{10}$", "", str(r.get("model"))) for r in (theirs, ours)]
    return untagged[0] == untagged[1]


def same_setup(
    theirs: tuple[str, Mapping[str, object]],
    ours: tuple[str, Mapping[str, object]],
    settings: Sequence[str],
    otherwise: str,
) -> None:
    """Refuse (ConfigError, ending in `otherwise`) a report, named and read, measured on other
    weights (`same_model`) or with any of `settings` other than the named `ours`."""
    (them, their), (us, our) = theirs, ours
    if not same_model(their, our):
        raise ConfigError(
            f"{them} was measured on another model ({their.get('model')}), {us} on "
            f"{our.get('model')}: {otherwise}"
        )
    for name in settings:
        if their.get(name) != our.get(name):
            raise ConfigError(
                f"{them} was measured with {name}={their.get(name)!r}, {us} with "
                f"{our.get(name)!r}: {otherwise}"
            )


def item_digests(items: Sequence[EvalItem]) -> dict[str, str]:
    """Per item id, a hash of what it asks from what (question, documents in their order,
    answers): a report keeps them, so its rows are reused only for the same items."""
    return {
        i.id: hashlib.sha256(
            json.dumps([i.question, list(i.documents), list(i.answers)]).encode()
        ).hexdigest()[:16]
        for i in items
    }


def check_same_items(
    report: Path, data: Mapping[str, object], ids: set[str], digests: Mapping[str, str], use: str
) -> None:
    """Refuse a report (its JSON `data`) whose rows under these item `ids` answered other
    questions or documents than this run's, whose `digests` (`item_digests`) it keeps beside
    its own; an item it measured without one is refused too. Reports older than the digests
    are matched by id only."""
    earlier = data.get("item_digests")
    if earlier is None and "combined" not in data:
        return
    earlier = earlier if isinstance(earlier, dict) else {}
    changed = [i for i, d in digests.items() if i in ids and earlier.get(i) != d]
    if changed:
        shown = ", ".join(changed[:3]) + ("..." if len(changed) > 3 else "")
        raise ConfigError(
            f"{report} measured other questions or documents under {len(changed)} of these "
            f"ids, or keeps no hash of them ({shown}): its answers cannot {use}"
        )


def reused_rows(
    report: Path, settings: Mapping[str, object], items: Sequence[EvalItem]
) -> dict[str, dict[str, ItemResult]]:
    """An earlier eval report's rows (item -> strategy -> row) for the given items, checked to
    come from the same settings (`REUSE_SETTINGS`): greedy answers repeat under them, so its
    rows stand for this run's. Not with teacher forcing, whose KL needs this run's `full`.
    Measured with the KV kept otherwise (`CACHE_SETTINGS`: a bfloat16 durable tier against
    float32), only the rows of strategies that never read the cache (prefill) are taken; with
    another calibration, none of a `+calibrated` strategy's; nor a row of a strategy spelled
    as an older version did (no strategy of this run is named so: it is measured again)."""
    text = read_json_text(Path(report))
    try:
        data = json.loads(text)
        rows = [item_result(r) for r in data["items"]]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # (JSON errors too)
        raise ConfigError(f"{report}: not an eval report to reuse ({e!r})") from None
    if settings.get("teacher_tokens"):
        raise ConfigError("reusing an earlier run's rows needs --teacher-tokens 0")
    same_setup(
        (str(report), data),
        ("this run", settings),
        REUSE_SETTINGS,
        "its answers cannot stand for this run's",
    )
    ids = {r.item for r in rows}
    check_same_items(report, data, ids, item_digests(items), "stand for this run's")
    same_cache = all(data.get(name) == settings.get(name) for name in CACHE_SETTINGS)
    # a `+calibrated` row was answered with that run's calibration (another's answers differ)
    same_calibration = data.get("calibration") == settings.get("calibration")
    wanted = {item.id for item in items}
    out: dict[str, dict[str, ItemResult]] = {}
    for row in rows:
        try:
            strategy = Strategy.parse(row.strategy)
        except StrategyError:
            continue
        if (
            row.item in wanted
            and (same_cache or not strategy.uses_cache)
            and (same_calibration or not strategy.calibrated)
        ):
            out.setdefault(row.item, {})[row.strategy] = row
    return out


# settings two reports must share to be read as one (`combined`): those a reused row needs,
# and the extras that change what every strategy's answers mean
COMBINE_SETTINGS = (*REUSE_SETTINGS, *CACHE_SETTINGS, "benchmark", "calibration")


@dataclass(frozen=True)
class Combined:
    """Several eval reports read as one run (`combined`)."""

    results: list[ItemResult]
    strategies: list[Strategy]  # those every report measured, in the first report's order
    dropped: list[str]  # strategies some report lacks: left out
    facts: dict[str, object]  # the shared settings, and which reports were combined
    parts: list[tuple[str, frozenset[str]]]  # each report's path and items, in order

    def longest(self) -> tuple[str, frozenset[str]]:
        """The report whose items have the longest contexts: whose TTFT the combined table
        shows (a median over every length would describe none of them)."""
        size = {r.item: r.context_tokens for r in self.results}
        return max(self.parts, key=lambda part: statistics.median(size[i] for i in part[1]))

    def speed_by_report(self) -> str:
        """Markdown: each strategy's speedup (and TTFT) over each report's own items."""
        names = [Path(path).name for path, _ in self.parts]
        if len(set(names)) < len(names):  # reports named alike (eval.json): by their folders
            names = [f"{Path(path).parent.name}/{Path(path).name}" for path, _ in self.parts]
        columns = []
        for name, (_, items) in zip(names, self.parts, strict=True):
            summary = summarize(self.results, self.strategies, items)
            columns.append((f"{name}, {summary[0].timed_tokens} tokens", summary))
        longest = names[self.parts.index(self.longest())]
        lines = [
            "\nSpeed by report: medians over each report's own items; the table above shows "
            f"{longest}'s. A report that reused another's rows timed them in that run, with "
            "whatever else the machine was doing; `bench ttft` times strategies side by side.\n",
            "| strategy | " + " | ".join(name for name, _ in columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for i, strategy in enumerate(self.strategies):
            cells = [f"{s[i].speedup:.1f}x ({s[i].ttft_s:.3f} s)" for _, s in columns]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


def combined(reports: Sequence[Path]) -> Combined:
    """Reports of one setup on different items (one per context length, or a dataset split
    between machines) as one run, so that accuracy, "kept" and the noise floor are counted,
    with their intervals, over all of their items: three lengths of 72 items each tell a
    cache from the noise floor better than any one of them. Refused unless every report
    measured the same model and settings (`COMBINE_SETTINGS`) and no item twice."""
    loaded = []
    for path in reports:
        text = read_json_text(Path(path))
        try:
            data = json.loads(text)
            rows = [item_result(r) for r in data["items"]]
            names = [str(Strategy.parse(s)) for s in data["strategies"]]
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # (JSON errors too)
            raise ConfigError(f"{path}: not an eval report ({e!r})") from None
        loaded.append((Path(path), data, rows, names))
    if len(loaded) < 2:
        raise ConfigError("combining needs two reports or more")
    first_path, first, _, first_names = loaded[0]
    if first.get("benchmark") != "eval":
        raise ConfigError(f"{first_path}: not a QA eval report (needle sweeps are not combined)")
    for path, data, _, _ in loaded[1:]:
        same_setup(
            (str(path), data),
            (str(first_path), first),
            COMBINE_SETTINGS,
            "one report cannot hold both",
        )
    seen: dict[str, Path] = {}
    for path, _, rows, names in loaded:
        check_rows(path, rows, names)
        for item in dict.fromkeys(r.item for r in rows):
            if item in seen:
                raise ConfigError(f"item {item} is in both {seen[item]} and {path}")
            seen[item] = path
    common = [n for n in first_names if all(n in names for *_, names in loaded[1:])]
    every = dict.fromkeys(n for *_, names in loaded for n in names)
    strategies = [Strategy.parse(n) for n in common]
    results = [r for _, _, rows, _ in loaded for r in rows if r.strategy in common]
    digests = [data.get("item_digests") for _, data, *_ in loaded]
    facts: dict[str, object] = {
        "combined": [str(path) for path, *_ in loaded],
        # what a later --reuse checks; none where a part has none (an older report)
        "item_digests": (
            {i: d for part in digests for i, d in part.items()}
            if all(isinstance(part, dict) for part in digests)
            else None
        ),
        "dataset": ", ".join(str(data.get("dataset")) for _, data, *_ in loaded),
        "model": first.get("model"),
        "model_fingerprint": first.get("model_fingerprint"),
        # the shared settings; not "benchmark": report_dict writes it
        **{n: first.get(n) for n in COMBINE_SETTINGS if n in first and n != "benchmark"},
        "strategies": common,
    }
    parts = [(str(path), frozenset(r.item for r in rows)) for path, _, rows, _ in loaded]
    return Combined(results, strategies, [n for n in every if n not in common], facts, parts)
