"""Summarising diagnosed items: means over items of any recorded field, linked minus prefill,
the summary written as `summary.json`, and JSON-ready numbers (rounded, nan as null)."""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import asdict
from operator import attrgetter
from typing import Any

import numpy as np

from rag_kvcache.tools.diagnosis.records import (
    ALL,
    FAILED,
    KEPT,
    POSITION_BINS,
    Diagnosis,
    ItemDiagnosis,
)


def mean_of(items: list[ItemDiagnosis], field: str) -> np.ndarray:
    """The mean over items of an array field (a dotted path, e.g. "linked.sink"), nan where
    every item has nan (an empty position bin)."""
    stacked = np.array([attrgetter(field)(d) for d in items], dtype=float)
    return _nanmean(stacked, axis=0)


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
    return dict(json_ready(out))


def same_shape(items: list[ItemDiagnosis]) -> list[ItemDiagnosis]:
    """The items with the most common number of chunks (per-chunk figures average over
    those)."""
    counts = [len(d.chunk_tokens) for d in items]
    common = max(set(counts), key=counts.count)
    return [d for d in items if len(d.chunk_tokens) == common]


def _nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns stay nan
        return np.asarray(np.nanmean(x, axis=axis))


def json_ready(x: Any, digits: int = 3) -> Any:
    """JSON-ready: numpy to Python, floats to `digits` significant digits, nan to None."""
    if isinstance(x, dict):
        return {k: json_ready(v, digits) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_ready(v, digits) for v in x]
    if isinstance(x, np.ndarray):
        return json_ready(x.tolist(), digits)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        x = float(x)
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    return x


def readable_json(x: Any) -> str:
    """Indented JSON with each list of numbers on one line."""
    flat = r"\[\s+((?:-?[0-9.eE+-]+|null)(?:,\s+(?:-?[0-9.eE+-]+|null))*)\s+\]"
    return re.sub(
        flat, lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", json.dumps(x, indent=2)
    )
