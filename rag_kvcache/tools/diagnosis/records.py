"""What a diagnosis records: the answer's documents (`Gold`), the question tokens' attention
over one context (`AttentionStats`), the cached K/V's deviation from prefill (`KVDeviation`),
one diagnosed item, one scanned item's outcome, and the whole run (`Diagnosis`)."""

from __future__ import annotations

from dataclasses import dataclass

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
