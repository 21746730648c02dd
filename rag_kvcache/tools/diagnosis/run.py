"""A diagnosis run: scan items with prefill and the strategy, diagnose those prefill answers
right and the strategy wrong (and some both answer right, as controls), write the records,
the summary and the plots (`write`); read a written run back (`load`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from rag_kvcache.answer import Answer
from rag_kvcache.config import (
    LEGOLINK0_SINKS,
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
)
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.diagnosis.measure import diagnose_item, placed_index
from rag_kvcache.tools.diagnosis.plots import plot_by_chunk, plot_by_layer, plot_heatmaps, plot_kv
from rag_kvcache.tools.diagnosis.records import (
    FAILED,
    KEPT,
    POSITION_BINS,
    SINK_TOKENS,
    AttentionStats,
    Diagnosis,
    Gold,
    ItemDiagnosis,
    KVDeviation,
    Outcome,
)
from rag_kvcache.tools.diagnosis.summary import json_ready, readable_json, summary
from rag_kvcache.tools.eval.dataset import EvalItem, json_lines
from rag_kvcache.tools.metrics import contains_answer


def diagnose(
    lm: LoadedModel,
    items: list[EvalItem],
    strategy: Strategy | str,
    out_dir: Path,
    max_items: int = 15,
    gold: dict[str, Gold] | None = None,
    controls: int = 0,
    sink_tokens: int = SINK_TOKENS,
    max_new_tokens: int = 24,
    on_item: Callable[[str, bool, bool], None] | None = None,
) -> Diagnosis:
    """Answer items in order with prefill and `strategy` (greedy, `max_new_tokens`) and
    diagnose those prefill answers right and the strategy wrong, up to `max_items` (and up
    to `controls` both answer right); stops scanning once both are found. `gold` gives each
    item's answer document (default: document 0). Writes JSON and plots into out_dir.
    `on_item(id, prefill right, strategy right)` reports progress."""
    strategy = Strategy.parse(strategy)
    if not strategy.uses_cache:
        raise ConfigError(f"{strategy} is not a link strategy; diagnose compares one to prefill")
    if strategy.calibrated:  # (its store is a scratch one: no calibration is ever found there)
        raise ConfigError(
            f"diagnose answers from a scratch store, with no link calibration: diagnose "
            f"{str(strategy).replace('+calibrated', '')}, or measure {strategy} with "
            "`rag-kvcache eval --calibration`"
        )
    baseline = strategy.baseline
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=max_new_tokens))
    engine = RagKVCache(config, lm=lm, store=MemoryStore())
    if strategy.needs_sinks:  # legolink0: chunks encoded after sink tokens, as eval does
        engine = engine.with_encoding(EncodeConfig(sink_tokens=LEGOLINK0_SINKS))
    outcomes: list[Outcome] = []
    diagnosed: list[ItemDiagnosis] = []
    wanted = {FAILED: max_items, KEPT: controls}
    for item in items:
        if all(sum(d.group == g for d in diagnosed) >= n for g, n in wanted.items()):
            break
        ids = engine.generate_context_cache(list(item.documents))
        base = engine.generate(item.question, ids, strategy=baseline)
        link = engine.generate(item.question, ids, strategy=strategy)
        assert isinstance(base, Answer) and isinstance(link, Answer)
        right = contains_answer(base.text, item.answers), contains_answer(link.text, item.answers)
        item_gold = (gold or {}).get(item.id, Gold(0))
        answer_chunk = placed_index(strategy, len(ids), item_gold.answer)
        outcomes.append(Outcome(item.id, answer_chunk, *right))
        group = {(True, False): FAILED, (True, True): KEPT}.get(right)
        if group and sum(d.group == group for d in diagnosed) < wanted[group]:
            answers = (base, link)
            diagnosed.append(
                diagnose_item(engine, item, ids, item_gold, strategy, answers, group, sink_tokens)
            )
        for cid in ids:  # the store keeps the system prefix only: memory stays flat
            engine.expire_cache(cid)
        if on_item:
            on_item(item.id, *right)
    result = Diagnosis(
        model=lm.name,
        strategy=str(strategy),
        baseline=str(baseline),
        sink_tokens=sink_tokens,
        max_new_tokens=max_new_tokens,
        scanned=len(outcomes),
        prefill_right=sum(o.prefill_right for o in outcomes),
        linked_right=sum(o.linked_right for o in outcomes),
        failed=sum(o.prefill_right and not o.linked_right for o in outcomes),
        items=diagnosed,
        outcomes=outcomes,
    )
    write(result, Path(out_dir))
    return result


def load(path: Path) -> Diagnosis:
    """A diagnosis.json back as records (numbers as written: rounded, nan where None), to
    summarise or plot again, or to compare runs."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    raw.pop("position_bins", None)
    items = [
        ItemDiagnosis(
            **(d | {k: AttentionStats(**d[k]) for k in ("prefill", "linked")})
            | {"kv": KVDeviation(**d["kv"])}
        )
        for d in raw.pop("items")
    ]
    outcomes = [Outcome(**o) for o in raw.pop("outcomes")]
    return Diagnosis(**raw, items=items, outcomes=outcomes)


def load_gold(path: Path) -> dict[str, Gold]:
    """Each item's answer (and two-hop bridge) document from the `meta` field of a QA set's
    JSONL lines (`rag-kvcache dataset` writes it; `load_dataset` does not keep it, and checks
    the rest of each line). A `meta` that names no document of its item is a ConfigError
    naming the line: a 7 among 4 documents failed after the model had answered."""
    gold = {}
    for number, line in json_lines(path):  # (each line checked by `load_dataset` first)
        raw = json.loads(line)
        meta = raw.get("meta") or {}
        if not isinstance(meta, dict):
            raise ConfigError(f"{path}:{number}: meta must be an object, not {meta!r}")
        if "answer_document" not in meta:
            continue
        count = len(raw["documents"])
        answer, bridge = meta["answer_document"], meta.get("bridge_document")
        for name, index in (("answer_document", answer), ("bridge_document", bridge)):
            if index is None and name == "bridge_document":  # a single-hop item has none
                continue
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                raise ConfigError(
                    f"{path}:{number}: meta.{name} must be the index of one of the item's "
                    f"{count} documents (0 to {count - 1}), not {index!r}"
                )
        gold[str(raw["id"])] = Gold(answer, bridge)
    return gold


PLOTS = (
    "attention_heatmaps.png",
    "attention_by_layer.png",
    "kv_deviation.png",
    "attention_by_chunk.png",
)


def write(diagnosis: Diagnosis, out_dir: Path) -> None:
    """diagnosis.json (every record, compact), summary.json and the plots (the heatmaps and
    the KV deviation over the failed items, or the kept ones where none failed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = json_ready(asdict(diagnosis)) | {"position_bins": [list(b) for b in POSITION_BINS]}
    (out_dir / "diagnosis.json").write_text(json.dumps(records, separators=(",", ":")))
    (out_dir / "summary.json").write_text(readable_json(summary(diagnosis)) + "\n")
    for stale in PLOTS:  # an earlier run's, which this one may not draw (no item)
        (out_dir / stale).unlink(missing_ok=True)
    items = [d for d in diagnosis.items if d.group == FAILED] or diagnosis.items
    if items:
        title = f"{diagnosis.strategy} - {diagnosis.baseline}, {len(items)} {items[0].group} items"
        heatmaps, by_layer, kv, by_chunk = (out_dir / name for name in PLOTS)
        plot_heatmaps(items, heatmaps, title)
        plot_by_layer(diagnosis.items, by_layer, diagnosis.strategy, diagnosis.sink_tokens)
        plot_kv(items, kv, diagnosis.strategy)
        plot_by_chunk(diagnosis.items, by_chunk, diagnosis.strategy)
