"""Where a linked context's attention departs from prefill's, per layer and head.

Linked answers (e.g. `legolink:2`) go wrong on items a plain prefill answers right, and the
fixes on offer act on different things: recomputing chunk-start tokens acts on each chunk's
own sink, an attention temperature (APE) on how much mass the context gets, recomputing whole
chunks on the distractors' stale KV. To choose, we look at where the departure is. For items
prefill answers right and the link wrong (and, as controls, some both answer right) this tool
computes both contexts and compares, per layer and head, the question tokens' attention
(recomputed exactly from their captured queries and each cache's keys): its mass on the
chunks' first tokens, on the answer's chunk and on the distractors, its entropy, the total
variation between the two; and per layer and position in a chunk, the cached K/V themselves.

    python -m rag_kvcache.tools.diagnose QA.jsonl --strategy legolink:2 --out DIR --limit N

writes `diagnosis.json` (every record), `summary.json` (group means, the layers and heads
that depart most) and PNG plots into DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rag_kvcache.answer import Answer, Prepared, prepare
from rag_kvcache.config import (
    LEGOLINK0_SINKS,
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
    ModelConfig,
)
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.adapter import capture_queries, unpack_cache
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.eval import EvalItem, load_dataset
from rag_kvcache.tools.metrics import contains_answer

SINK_TOKENS = 4  # a chunk's first tokens counted as its own "attention sink"
# [start, end) positions in a chunk the KV deviation is averaged over: the first 16 one by
# one (where chunk-local sinks and recomputed tokens sit), then ever wider
_EDGES = [*range(17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 1 << 20]
POSITION_BINS = tuple(zip(_EDGES[:-1], _EDGES[1:], strict=True))
FAILED, KEPT = "failed", "kept"  # prefill right and the link wrong; both right (controls)
ALL = "all"  # summaries over every diagnosed item


@dataclass(frozen=True)
class Gold:
    """Which of an item's documents (in the dataset's order) the answer needs."""

    answer: int  # the document holding the answer
    bridge: int | None = None  # two-hop items: the document naming the twin town


@dataclass(frozen=True)
class AttentionStats:
    """The question tokens' attention over one context, per layer and head ([layers][heads]),
    each a mean over the question tokens. Masses are shares of the whole row (sum to 1 with
    the rest of the chunks' tokens)."""

    sink: list[list[float]]  # on the first SINK_TOKENS tokens of every document chunk, summed
    end: list[list[float]]  # on the last token of every document chunk (its "\n\n"), summed
    prefix: list[list[float]]  # on the system prefix (chunk 0, which holds the model's sink)
    answer: list[list[float]]  # on the chunk holding the answer
    bridge: list[list[float]]  # on the two-hop bridge chunk (0 where there is none)
    distractors: list[list[float]]  # on the other document chunks, summed
    question: list[list[float]]  # on the question tokens themselves
    entropy: list[list[float]]  # in nats
    # share of question tokens whose most attended document token is in the answer's chunk:
    # where it is, sharpening attention over the context (a temperature) moves mass toward
    # the answer; where a distractor's token is, sharpening moves it the wrong way
    answer_top: list[list[float]]
    chunks: list[list[float]]  # [chunks][layers]: on each placed chunk (mean over heads)


@dataclass(frozen=True)
class KVDeviation:
    """||linked - prefill|| / ||prefill|| of the cached keys and values (norms over kv heads x
    head_dim) per layer: document tokens by position in their chunk ([layers][bins], mean
    over the chunks' tokens in each of `POSITION_BINS`; nan where no chunk reaches a bin),
    each chunk's last token ([layers], mean over the chunks) and the question tokens
    ([layers], computed afresh but over the linked context)."""

    keys: list[list[float]]
    values: list[list[float]]
    last_keys: list[float]
    last_values: list[float]
    question_keys: list[float]
    question_values: list[float]


@dataclass(frozen=True)
class ItemDiagnosis:
    item: str
    group: str  # FAILED or KEPT
    question: str
    answers: list[str]
    prefill_answer: str
    linked_answer: str
    answer_chunk: int  # placed index among the chunks (0 = the system prefix)
    bridge_chunk: int | None
    chunk_tokens: list[int]  # tokens per placed chunk, the system prefix first
    question_tokens: int
    prefill: AttentionStats
    linked: AttentionStats
    departure: list[list[float]]  # [layers][heads]: total variation linked vs prefill, mean
    kv: KVDeviation


@dataclass(frozen=True)
class Outcome:
    """One scanned item: where its answer sits and who answered it right."""

    item: str
    answer_chunk: int  # placed index (0 = the system prefix)
    prefill_right: bool
    linked_right: bool


@dataclass(frozen=True)
class Diagnosis:
    model: str
    strategy: str
    baseline: str  # prefill with the strategy's placement
    sink_tokens: int
    max_new_tokens: int
    scanned: int  # items answered by both
    prefill_right: int
    linked_right: int
    failed: int  # prefill right, link wrong, among the scanned
    items: list[ItemDiagnosis]  # the diagnosed: up to max_items failed, up to `controls` kept
    outcomes: list[Outcome]  # every scanned item


# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class LayerQueries:
    """One layer's question-token queries, as its attention function received them."""

    query: torch.Tensor  # [heads, question tokens, head_dim], after RoPE
    scale: float
    key_bias: torch.Tensor | None  # added to every score on key j (APE's scale), or None


def prepare_traced(
    lm: LoadedModel, chunks: list[ChunkKV], question_ids: list[int], strategy: Strategy
) -> tuple[Prepared, list[LayerQueries]]:
    """`prepare` with each layer's queries captured: the prepared context and, per layer,
    the question tokens' queries (the last forward's: cacheblend runs a partial one first)."""
    with capture_queries() as captured:
        prepared = prepare(lm, chunks, question_ids, strategy)
    n = len(question_ids)
    last = {layer: LayerQueries(q[0, :, -n:], scale, bias) for layer, q, scale, bias in captured}
    if sorted(last) != list(range(lm.num_layers)):
        raise RuntimeError(f"captured queries of layers {sorted(last)}, not all {lm.num_layers}")
    return prepared, [last[i] for i in range(lm.num_layers)]


def question_attention(
    lm: LoadedModel, prepared: Prepared, layers: list[LayerQueries]
) -> torch.Tensor:
    """Attention weights [layers, heads, question tokens, context + question] of the last
    tokens (the question) over a prepared cache: softmax(q k^T * scale + key bias), causal,
    computed in float32 at least; query head h reads kv head h // groups (as HF's GQA)."""
    length = prepared.position
    dtype = torch.promote_types(lm.dtype, torch.float32)
    out = []
    for (keys, _), layer in zip(unpack_cache(prepared.cache), layers, strict=True):
        heads, n, _ = layer.query.shape
        k = keys[0, :, :length].to(dtype).repeat_interleave(heads // keys.shape[1], 0)
        scores = layer.query.to(dtype) @ k.transpose(1, 2) * layer.scale  # [heads, n, length]
        if layer.key_bias is not None:  # shorter than the keys: those past it are unbiased
            bias = layer.key_bias[:length].to(dtype)
            scores[..., : len(bias)] += bias
        rows = torch.arange(length - n, length, device=k.device)
        allowed = torch.arange(length, device=k.device)[None, :] <= rows[:, None]
        out.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1))
    return torch.stack(out)


def attention_stats(
    weights: torch.Tensor,
    chunk_tokens: Sequence[int],
    answer_chunk: int,
    bridge_chunk: int | None,
    sink_tokens: int = SINK_TOKENS,
) -> AttentionStats:
    """Masses and entropy of question attention weights [layers, heads, n, T] (see
    AttentionStats); chunk i covers chunk_tokens[i] positions, the question the rest."""
    total = weights.shape[-1]
    starts = np.cumsum([0, *chunk_tokens]).tolist()

    def where(spans: list[tuple[int, int]]) -> torch.Tensor:
        mask = torch.zeros(total, dtype=torch.bool, device=weights.device)
        for a, b in spans:
            mask[a:b] = True
        return mask

    def mass(spans: list[tuple[int, int]]) -> list[list[float]]:
        return _rows(weights[..., where(spans)].sum(-1).mean(-1))

    docs = range(1, len(chunk_tokens))
    chunk = lambda i: (starts[i], starts[i + 1])  # noqa: E731
    answer = chunk(answer_chunk)
    top = weights.masked_fill(~where([chunk(i) for i in docs]), -1.0).argmax(-1)  # [L, H, n]
    return AttentionStats(
        sink=mass([(starts[i], min(starts[i] + sink_tokens, starts[i + 1])) for i in docs]),
        end=mass([(starts[i + 1] - 1, starts[i + 1]) for i in docs]),
        prefix=mass([chunk(0)]),
        answer=mass([answer]),
        bridge=mass([chunk(bridge_chunk)] if bridge_chunk is not None else []),
        distractors=mass([chunk(i) for i in docs if i not in (answer_chunk, bridge_chunk)]),
        question=mass([(starts[-1], total)]),
        entropy=_rows(torch.special.entr(weights).sum(-1).mean(-1)),
        answer_top=_rows(((top >= answer[0]) & (top < answer[1])).double().mean(-1)),
        chunks=[[sum(row) / len(row) for row in mass([chunk(i)])] for i in range(len(docs) + 1)],
    )


def departure(linked: torch.Tensor, prefill: torch.Tensor) -> list[list[float]]:
    """Total variation distance [layers][heads] between two sets of attention weights
    [layers, heads, n, T], a mean over the n rows (0: the same, 1: disjoint)."""
    return _rows(0.5 * (linked - prefill).abs().sum(-1).mean(-1))


def kv_deviation(a: Prepared, b: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative L2 distance ||a - b|| / ||b|| of two caches' keys and of their values, per
    layer and position: two [layers, positions] tensors (float64; norms over kv heads x
    head_dim). The caches must hold the same tokens at the same positions."""
    if a.position != b.position:
        raise ValueError(f"caches of {a.position} and {b.position} tokens")
    n = a.position
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for (ka, va), (kb, vb) in zip(unpack_cache(a.cache), unpack_cache(b.cache), strict=True):
        for out, x, y in ((keys, ka, kb), (values, va, vb)):
            x, y = x[0, :, :n].double(), y[0, :, :n].double()
            diff = torch.linalg.vector_norm(x - y, dim=(0, 2))
            out.append(diff / torch.linalg.vector_norm(y, dim=(0, 2)).clamp_min(1e-30))
    return torch.stack(keys), torch.stack(values)


def by_position_in_chunk(deviation: torch.Tensor, chunk_tokens: Sequence[int]) -> list[list[float]]:
    """[layers, positions] -> [layers][POSITION_BINS]: the document chunks' tokens (not chunk
    0, not the question) averaged by their position in their chunk (nan: no token there)."""
    first, end = chunk_tokens[0], sum(chunk_tokens)
    documents = deviation[:, first:end]
    in_chunk = torch.cat([torch.arange(n) for n in chunk_tokens[1:]]).to(deviation.device)
    columns = []
    for a, b in POSITION_BINS:
        picked = (in_chunk >= a) & (in_chunk < b)
        nan = torch.full(
            (len(deviation),), math.nan, dtype=deviation.dtype, device=documents.device
        )
        columns.append(documents[:, picked].mean(-1) if picked.any() else nan)
    return _rows(torch.stack(columns, dim=1))


def _rows(x: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in x.double().cpu().tolist()]


def placed_index(strategy: Strategy, documents: int, document: int) -> int:
    """Where the strategy places a document (index in the dataset's order): its chunk index,
    counting the system prefix as chunk 0."""
    return 1 + strategy.arrange(list(range(documents))).index(document)


# ----------------------------------------------------------------------------- one item


def diagnose_item(
    engine: RagKVCache,
    item: EvalItem,
    cache_ids: list[str],
    gold: Gold,
    strategy: Strategy,
    answers: tuple[Answer, Answer],
    group: str,
    sink_tokens: int = SINK_TOKENS,
) -> ItemDiagnosis:
    """Compute prefill (with the strategy's placement) and the strategy over one item's cached
    documents and compare them (see the module docstring). `answers`: (prefill's, linked)."""
    lm = engine.lm
    baseline = Strategy("prefill", order=strategy.order)
    question_ids = engine.template.question_ids(lm.tokenizer, item.question)
    chunks = engine.store.get([engine.prefix_id, *strategy.arrange(cache_ids)])
    base, base_q = prepare_traced(lm, chunks, question_ids, baseline)
    link, link_q = prepare_traced(lm, chunks, question_ids, strategy)
    base_w = question_attention(lm, base, base_q)
    link_w = question_attention(lm, link, link_q)
    tokens = [c.num_tokens for c in chunks]
    answer_chunk = placed_index(strategy, len(cache_ids), gold.answer)
    bridge = None if gold.bridge is None else placed_index(strategy, len(cache_ids), gold.bridge)
    keys, values = kv_deviation(link, base)
    n = len(question_ids)
    ends = np.cumsum(tokens)[1:] - 1  # each document chunk's last token
    return ItemDiagnosis(
        item=item.id,
        group=group,
        question=item.question,
        answers=list(item.answers),
        prefill_answer=answers[0].text,
        linked_answer=answers[1].text,
        answer_chunk=answer_chunk,
        bridge_chunk=bridge,
        chunk_tokens=tokens,
        question_tokens=n,
        prefill=attention_stats(base_w, tokens, answer_chunk, bridge, sink_tokens),
        linked=attention_stats(link_w, tokens, answer_chunk, bridge, sink_tokens),
        departure=departure(link_w, base_w),
        kv=KVDeviation(
            keys=by_position_in_chunk(keys, tokens),
            values=by_position_in_chunk(values, tokens),
            last_keys=[float(v) for v in keys[:, ends].mean(-1)],
            last_values=[float(v) for v in values[:, ends].mean(-1)],
            question_keys=[float(v) for v in keys[:, -n:].mean(-1)],
            question_values=[float(v) for v in values[:, -n:].mean(-1)],
        ),
    )


# ----------------------------------------------------------------------------- the run


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
    baseline = Strategy("prefill", order=strategy.order)
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
    JSONL lines (`rag-kvcache dataset` writes it; `load_dataset` does not keep it)."""
    gold = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            meta = raw.get("meta") or {}
            if "answer_document" in meta:
                gold[str(raw["id"])] = Gold(meta["answer_document"], meta.get("bridge_document"))
    return gold


# ----------------------------------------------------------------------------- summary, output


def mean_of(items: list[ItemDiagnosis], field: str) -> np.ndarray:
    """The mean over items of an array field (a dotted path, e.g. "linked.sink"), nan where
    every item has nan (an empty position bin)."""
    stacked = np.array([attrgetter(field)(d) for d in items], dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns stay nan
        return np.asarray(np.nanmean(stacked, axis=0))


def delta(items: list[ItemDiagnosis], name: str) -> np.ndarray:
    """Linked minus prefill of one AttentionStats field, [layers, heads], mean over items."""
    linked = mean_of(items, f"linked.{name}")
    return linked - mean_of(items, f"prefill.{name}")


FIGURES = (
    "sink",
    "end",
    "prefix",
    "answer",
    "bridge",
    "distractors",
    "question",
    "entropy",
    "answer_top",
)


def summary(diagnosis: Diagnosis, top: int = 10) -> dict[str, Any]:
    """Who answered right by where the answer's chunk is placed (all scanned items); per
    group (failed, kept, all diagnosed): each attention figure for prefill and linked - linked
    minus prefill, as a mean over items, layers and heads and per layer (mean over heads) -,
    the mass on each placed chunk, the departure (total variation) and the KV deviation by
    layer and by position in the chunk; the (layer, head) pairs that depart most."""
    skip = ("items", "outcomes")
    out: dict[str, Any] = {k: v for k, v in asdict(diagnosis).items() if k not in skip}
    out["diagnosed"] = {g: sum(d.group == g for d in diagnosis.items) for g in (FAILED, KEPT)}
    out["by_answer_chunk"] = {
        chunk: {
            "scanned": len(rows),
            "prefill_right": sum(o.prefill_right for o in rows),
            "linked_right": sum(o.linked_right for o in rows),
            "both_right": sum(o.prefill_right and o.linked_right for o in rows),
        }
        for chunk in sorted({o.answer_chunk for o in diagnosis.outcomes})
        for rows in [[o for o in diagnosis.outcomes if o.answer_chunk == chunk]]
    }
    out["position_bins"] = POSITION_BINS
    for group in (FAILED, KEPT, ALL):
        items = [d for d in diagnosis.items if group in (d.group, ALL)]
        if not items:
            continue
        figures: dict[str, Any] = {"items": len(items)}
        deltas = {name: delta(items, name) for name in FIGURES}
        for name in FIGURES:
            prefill = mean_of(items, f"prefill.{name}")
            figures[name] = {
                "prefill": prefill.mean(),
                "delta": deltas[name].mean(),
                "prefill_by_layer": prefill.mean(axis=1),
                "delta_by_layer": deltas[name].mean(axis=1),
            }
        same = same_shape(items)
        base_chunks = mean_of(same, "prefill.chunks")  # [chunks, layers]
        chunk_deltas = mean_of(same, "linked.chunks") - base_chunks
        figures["chunk_mass"] = {  # per placed chunk, system prefix first
            "items": len(same),
            "prefill": base_chunks.mean(axis=1),
            "delta": chunk_deltas.mean(axis=1),
            "delta_by_layer": chunk_deltas,
        }
        tv = mean_of(items, "departure")
        figures["departure"] = tv.mean()
        figures["departure_by_layer"] = tv.mean(axis=1)
        for part in ("keys", "values"):
            grid = mean_of(items, f"kv.{part}")  # [layers, bins]
            figures[f"kv_{part}"] = {
                "by_position": _nanmean(grid, axis=0),
                "by_layer": _nanmean(grid, axis=1),
                "chunk_end_by_layer": mean_of(items, f"kv.last_{part}"),
                "question_by_layer": mean_of(items, f"kv.question_{part}"),
            }
        figures["top_departures"] = [
            {
                "layer": int(i // tv.shape[1]),
                "head": int(i % tv.shape[1]),
                "departure": tv.flat[i],
                **{f"delta_{name}": deltas[name].flat[i] for name in FIGURES},
            }
            for i in np.argsort(-tv, axis=None)[:top]
        ]
        out[group] = figures
    return dict(_clean(out))


def same_shape(items: list[ItemDiagnosis]) -> list[ItemDiagnosis]:
    """The items with the most common number of chunks (per-chunk figures average over
    those)."""
    counts = [len(d.chunk_tokens) for d in items]
    common = max(set(counts), key=counts.count)
    return [d for d in items if len(d.chunk_tokens) == common]


def _nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(np.nanmean(x, axis=axis))


def _clean(x: Any, digits: int = 3) -> Any:
    """JSON-ready: numpy to Python, floats to `digits` significant digits, nan to None."""
    if isinstance(x, dict):
        return {k: _clean(v, digits) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v, digits) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist(), digits)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        x = float(x)
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    return x


def write(diagnosis: Diagnosis, out_dir: Path) -> None:
    """diagnosis.json (every record, compact), summary.json and the plots (the heatmaps and
    the KV deviation over the failed items, or the kept ones where none failed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = _clean(asdict(diagnosis)) | {"position_bins": [list(b) for b in POSITION_BINS]}
    (out_dir / "diagnosis.json").write_text(json.dumps(records, separators=(",", ":")))
    (out_dir / "summary.json").write_text(readable_json(summary(diagnosis)) + "\n")
    items = [d for d in diagnosis.items if d.group == FAILED] or diagnosis.items
    if items:
        title = f"{diagnosis.strategy} - {diagnosis.baseline}, {len(items)} {items[0].group} items"
        plot_heatmaps(items, out_dir / "attention_heatmaps.png", title)
        plot_by_layer(
            diagnosis.items,
            out_dir / "attention_by_layer.png",
            diagnosis.strategy,
            diagnosis.sink_tokens,
        )
        plot_kv(items, out_dir / "kv_deviation.png", diagnosis.strategy)
        plot_by_chunk(diagnosis.items, out_dir / "attention_by_chunk.png", diagnosis.strategy)


def readable_json(x: Any) -> str:
    """Indented JSON with each list of numbers on one line."""
    flat = r"\[\s+((?:-?[0-9.eE+-]+|null)(?:,\s+(?:-?[0-9.eE+-]+|null))*)\s+\]"
    return re.sub(
        flat, lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", json.dumps(x, indent=2)
    )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


HEATMAPS = {
    "sink": "chunk-start mass Δ",
    "answer": "answer-chunk mass Δ",
    "distractors": "distractor mass Δ",
    "entropy": "entropy Δ (nats)",
}


def plot_heatmaps(items: list[ItemDiagnosis], path: Path, title: str) -> None:
    """Layer x head maps of linked - prefill: mass on chunk starts, on the answer's chunk, on
    the distractors, entropy; and the total variation between the two attentions."""
    plt = _pyplot()
    panels = [(label, delta(items, name), True) for name, label in HEATMAPS.items()]
    panels.append(("departure (total variation)", mean_of(items, "departure"), False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 7.5))
    for ax, (label, grid, diverging) in zip(axes, panels, strict=True):
        if diverging:
            bound = float(np.abs(grid).max()) or 1.0
            image = ax.imshow(grid, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        else:
            image = ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(grid.shape[1]))
        fig.colorbar(image, ax=ax, shrink=0.6)
    axes[0].set_ylabel("layer")
    fig.suptitle(f"question-token attention, {title} (mean over question tokens and items)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


TITLES = {
    "sink": "mass on chunk starts (first {sink} tokens)",
    "end": "mass on chunk ends (last token)",
    "prefix": "mass on the system prefix",
    "answer": "mass on the answer's chunk",
    "bridge": "mass on the two-hop bridge chunk",
    "distractors": "mass on distractor chunks",
    "question": "mass on the question",
    "entropy": "entropy (nats)",
    "answer_top": "top document token in the answer's chunk",
}


def plot_by_layer(
    items: list[ItemDiagnosis], path: Path, strategy: str, sink_tokens: int = SINK_TOKENS
) -> None:
    """Per layer (mean over heads and items): each figure of AttentionStats for prefill and
    the link, and their departure; failed items solid, kept ones (controls) dotted."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 5, figsize=(20, 7))
    groups = [(g, s, [d for d in items if d.group == g]) for g, s in ((FAILED, "-"), (KEPT, ":"))]
    for ax, name in zip(axes.flat, TITLES, strict=False):
        for group, style, chosen in groups:
            for side, color in (("prefill", "C0"), ("linked", "C3")):
                if chosen:
                    y = mean_of(chosen, f"{side}.{name}").mean(axis=1)
                    label = f"{side if side == 'prefill' else strategy} ({group}, {len(chosen)})"
                    ax.plot(y, style, color=color, label=label)
        ax.set_title(TITLES[name].format(sink=sink_tokens), fontsize=10)
    last = axes.flat[-1]
    for group, style, chosen in groups:
        if chosen:
            y = mean_of(chosen, "departure").mean(axis=1)
            last.plot(y, style, color="k", label=f"{group} ({len(chosen)})")
    last.set_title("departure: total variation linked vs prefill", fontsize=10)
    last.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("question-token attention per layer (mean over heads, question tokens, items)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_by_chunk(items: list[ItemDiagnosis], path: Path, strategy: str) -> None:
    """Per placed chunk (system prefix first): the question tokens' mass on it per layer
    (mean over heads and items), prefill and the link; failed items solid, kept dotted."""
    plt = _pyplot()
    same = same_shape(items)
    count = len(same[0].chunk_tokens)
    fig, axes = plt.subplots(1, count, figsize=(3.6 * count, 3.8), sharey=True)
    for chunk, ax in enumerate(axes):
        for group, style in ((FAILED, "-"), (KEPT, ":")):
            chosen = [d for d in same if d.group == group]
            for side, color in (("prefill", "C0"), ("linked", "C3")):
                if chosen:
                    y = mean_of(chosen, f"{side}.chunks")[chunk]
                    label = f"{side if side == 'prefill' else strategy} ({group}, {len(chosen)})"
                    ax.plot(y, style, color=color, label=label)
        ax.set_title("system prefix" if chunk == 0 else f"document chunk {chunk}", fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("question-token attention mass")
    axes[0].legend(fontsize=7)
    fig.suptitle("attention mass per placed chunk (mean over heads, question tokens, items)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_kv(items: list[ItemDiagnosis], path: Path, strategy: str) -> None:
    """Relative K and V deviation from prefill against position in the chunk, one line per
    few layers (mean over the document chunks and items)."""
    plt = _pyplot()
    centers = np.array([(a + min(b, 1024) - 1) / 2 for a, b in POSITION_BINS])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("keys", "values"), strict=True):
        grid = mean_of(items, f"kv.{name}")  # [layers, bins]
        seen = np.isfinite(grid).any(axis=0)
        layers = len(grid)
        for layer in sorted({*range(0, layers, max(1, layers // 6)), layers - 1}):
            ax.plot(centers[seen], grid[layer, seen], "o-", ms=2, label=f"layer {layer}")
        ax.set_xscale("symlog", linthresh=16)
        ax.set_xlabel("position in the chunk (tokens; linear to 16, then log)")
        ax.set_ylabel(f"||{name} linked - prefill|| / ||prefill||")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"KV deviation of {strategy} from prefill, document chunks, {len(items)} items")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rag_kvcache.tools.diagnose", description=__doc__.split("\n")[0]
    )
    parser.add_argument("dataset", type=Path, help="JSONL QA set (with meta.answer_document)")
    parser.add_argument("--strategy", default="legolink:2", help="(default legolink:2)")
    parser.add_argument("--out", type=Path, default=Path("diagnosis"), help="(default diagnosis)")
    parser.add_argument("--limit", type=int, default=None, help="scan at most N items")
    parser.add_argument("--max-items", type=int, default=15, help="failed items (default 15)")
    parser.add_argument("--controls", type=int, default=5, help="kept items too (default 5)")
    parser.add_argument("--sink-tokens", type=int, default=SINK_TOKENS)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    lm = load_model(ModelConfig(path=args.model, dtype=args.dtype, threads=args.threads))
    items = load_dataset(args.dataset)[: args.limit]
    gold = load_gold(args.dataset)

    def progress(item: str, base: bool, link: bool) -> None:
        print(
            f"{item}: prefill {'right' if base else 'wrong'}, link {'right' if link else 'wrong'}"
        )

    result = diagnose(
        lm,
        items,
        args.strategy,
        args.out,
        max_items=args.max_items,
        gold=gold,
        controls=args.controls,
        sink_tokens=args.sink_tokens,
        max_new_tokens=args.max_new_tokens,
        on_item=progress,
    )
    print(
        f"scanned {result.scanned}: prefill right {result.prefill_right}, "
        f"{result.strategy} right {result.linked_right}, prefill right and {result.strategy} "
        f"wrong {result.failed}; diagnosed {len(result.items)} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
