"""Encode chunks alone, at local positions, into per-chunk KV (ingestion's one heavy step).

Chunks are batched by similar length and right-padded: with a causal mask a real token never
sees the padding after it, so batched encoding equals encoding each chunk by itself.
With sink tokens (LegoLink-0) every chunk is encoded as `sinks + chunk`; the sinks' KV is
dropped and the chunk's keys stay RoPE'd at positions `len(sinks)..`, recorded as `start`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from rag_kvcache.errors import ContextTooLongError, EmptyChunkError
from rag_kvcache.kv import ChunkKV, EncodeSettings, make_cache_id
from rag_kvcache.model.adapter import forward, unpack_cache
from rag_kvcache.model.loading import LoadedModel


def encode_chunks(
    lm: LoadedModel,
    chunks: list[list[int]],
    settings: EncodeSettings = EncodeSettings(),
    batch_size: int = 8,
    on_encoded: Callable[[int], None] | None = None,
) -> list[ChunkKV]:
    """Token id lists -> one ChunkKV each, in input order.

    `on_encoded(n)` is called after each batch with the number of chunks it encoded (progress).
    """
    for i, ids in enumerate(chunks):
        if not ids:
            raise EmptyChunkError(f"chunk {i} has no tokens; drop empty chunks before encoding")
        if len(ids) + len(settings.sink_ids) > lm.max_context:
            raise ContextTooLongError(
                f"chunk {i} has {len(ids)} tokens; the model's window is {lm.max_context}"
            )
    out: dict[int, ChunkKV] = {}
    for batch in _batches_by_length(chunks, batch_size):
        for index, kv in zip(batch, _encode_batch(lm, [chunks[i] for i in batch], settings)):
            out[index] = kv
        if on_encoded:
            on_encoded(len(batch))
    return [out[i] for i in range(len(chunks))]


def _batches_by_length(chunks: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i]))
    for i in range(0, len(order), batch_size):
        yield order[i : i + batch_size]


def _encode_batch(
    lm: LoadedModel, chunks: list[list[int]], settings: EncodeSettings
) -> list[ChunkKV]:
    sinks = list(settings.sink_ids)
    rows = [sinks + ids for ids in chunks]
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T], right-padded
    padding = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T], 1 = real token
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = torch.tensor(row)
        padding[b, : len(row)] = 1
    _, cache = forward(lm, input_ids.to(lm.device), mask=padding.to(lm.device), logits_to_keep=1)
    layers = unpack_cache(cache)
    keys = torch.stack([k for k, _ in layers])  # [layers, B, kv_heads, T, head_dim]
    values = torch.stack([v for _, v in layers])
    s = len(sinks)
    return [
        ChunkKV(
            cache_id=make_cache_id(lm.fingerprint, settings, ids),
            fingerprint=lm.fingerprint,
            token_ids=tuple(ids),
            keys=keys[:, b, :, s : s + len(ids)].clone(),
            values=values[:, b, :, s : s + len(ids)].clone(),
            start=s,
            sink_ids=settings.sink_ids,
        )
        for b, ids in enumerate(chunks)
    ]
