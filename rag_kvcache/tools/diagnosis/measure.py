"""Measuring one item: both contexts prepared with each layer's queries captured, the question
tokens' attention recomputed from them (`question_attention`), its masses and entropy
(`attention_stats`), the departure between two attentions, the K/V deviation by position in
the chunk; `diagnose_item` does all of it for one item."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rag_kvcache.answer import Answer, Prepared, prepare
from rag_kvcache.engine import RagKVCache
from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.adapter import capture_queries, release_buffers, unpack_cache
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.diagnosis.records import (
    POSITION_BINS,
    SINK_TOKENS,
    AttentionStats,
    Gold,
    ItemDiagnosis,
    KVDeviation,
)
from rag_kvcache.tools.eval.dataset import EvalItem


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
    documents and compare them (see the package docstring). `answers`: (prefill's, linked)."""
    lm = engine.lm
    baseline = strategy.baseline
    question_ids = engine.template.question_ids(lm.tokenizer, item.question)
    chunks = engine.store.get([engine.prefix_id, *strategy.arrange(cache_ids)])
    base, base_q = prepare_traced(lm, chunks, question_ids, baseline)
    link, link_q = prepare_traced(lm, chunks, question_ids, strategy)
    try:  # compared, then handed back (on a GPU, slabs lent one request at a time)
        base_w = question_attention(lm, base, base_q)
        link_w = question_attention(lm, link, link_q)
        keys, values = kv_deviation(link, base)
    finally:
        release_buffers(base.cache)
        release_buffers(link.cache)
    tokens = [c.num_tokens for c in chunks]
    answer_chunk = placed_index(strategy, len(cache_ids), gold.answer)
    bridge = None if gold.bridge is None else placed_index(strategy, len(cache_ids), gold.bridge)
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
