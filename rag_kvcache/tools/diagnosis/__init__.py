"""Where a linked context's attention departs from prefill's, per layer and head.

Linked answers (e.g. `legolink:2`) go wrong on items a plain prefill answers right, and the
fixes on offer act on different things: recomputing chunk-start tokens acts on each chunk's
own sink, an attention temperature (APE) on how much mass the context gets, recomputing whole
chunks on the distractors' stale KV. To choose, we look at where the departure is. For items
prefill answers right and the link wrong (and, as controls, some both answer right) this
package computes both contexts and compares, per layer and head, the question tokens'
attention (recomputed exactly from their captured queries and each cache's keys): its mass on
the chunks' first tokens, on the answer's chunk and on the distractors, its entropy, the total
variation between the two; and per layer and position in a chunk, the cached K/V themselves.

    rag-kvcache diagnose QA.jsonl --strategy legolink:2 --out DIR --limit N

(or `python -m rag_kvcache.tools.diagnosis ...`) writes `diagnosis.json` (every record),
`summary.json` (group means, the layers and heads that depart most) and PNG plots into DIR.

`records.py` holds the result records, `measure.py` measures one item, `run.py` scans items,
selects the failed and control ones and writes (and `load`s) a run, `summary.py` summarises
it and `plots.py` draws the figures.
"""

from rag_kvcache.tools.diagnosis.measure import (
    LayerQueries,
    attention_stats,
    by_position_in_chunk,
    departure,
    diagnose_item,
    kv_deviation,
    placed_index,
    prepare_traced,
    question_attention,
)
from rag_kvcache.tools.diagnosis.plots import plot_by_chunk, plot_by_layer, plot_heatmaps, plot_kv
from rag_kvcache.tools.diagnosis.records import (
    ALL,
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
from rag_kvcache.tools.diagnosis.run import diagnose, load, load_gold, write
from rag_kvcache.tools.diagnosis.summary import (
    FIGURES,
    delta,
    json_ready,
    mean_of,
    readable_json,
    same_shape,
    summary,
)

__all__ = [
    "ALL",
    "FAILED",
    "FIGURES",
    "KEPT",
    "POSITION_BINS",
    "SINK_TOKENS",
    "AttentionStats",
    "Diagnosis",
    "Gold",
    "ItemDiagnosis",
    "KVDeviation",
    "LayerQueries",
    "Outcome",
    "attention_stats",
    "by_position_in_chunk",
    "delta",
    "departure",
    "diagnose",
    "diagnose_item",
    "json_ready",
    "kv_deviation",
    "load",
    "load_gold",
    "mean_of",
    "placed_index",
    "plot_by_chunk",
    "plot_by_layer",
    "plot_heatmaps",
    "plot_kv",
    "prepare_traced",
    "question_attention",
    "readable_json",
    "same_shape",
    "summary",
    "write",
]
