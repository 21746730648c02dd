"""A chunk's KV as bytes: safetensors (never pickle), with a sha256 checksum.

The blob holds `keys` and `values` ([layers, kv_heads, tokens, head_dim]) and, as metadata,
the cache ID, model fingerprint and start position, so a blob describes itself.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.storage.compress import dequantize, quantize


class CorruptBlobError(RagKVCacheError):
    """A blob's bytes do not match its checksum or do not parse as a chunk's KV."""


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safe_open_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (an 8-byte length, then a JSON header)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})


def to_blob(kv: ChunkKV, compress: str | None = None) -> bytes:
    """Serialize kv; compress "int8" stores per-channel 8-bit codes and scales instead."""
    meta = {"cache_id": kv.cache_id, "fingerprint": kv.fingerprint, "start": str(kv.start)}
    if compress is None:
        tensors = {"keys": kv.keys.contiguous().cpu(), "values": kv.values.contiguous().cpu()}
        return save(tensors, metadata=meta)
    if compress != "int8":
        raise ValueError(f"unknown KV compression {compress!r}; use None or 'int8'")
    tensors = {}
    for name, x in (("keys", kv.keys), ("values", kv.values)):
        codes, scale = quantize(x.cpu())
        tensors[f"{name}.int8"], tensors[f"{name}.scale"] = codes.contiguous(), scale.contiguous()
    meta.update(compression="int8", dtype=str(kv.keys.dtype).removeprefix("torch."))
    return save(tensors, metadata=meta)


def from_blob(
    data: bytes,
    expected_checksum: str,
    cache_id: str,
    fingerprint: str,
    token_ids: tuple[int, ...],
    sink_ids: tuple[int, ...],
) -> ChunkKV:
    """Parse a blob after checking its checksum; any mismatch is a CorruptBlobError."""
    if checksum(data) != expected_checksum:
        raise CorruptBlobError(f"blob of chunk {cache_id} fails its sha256 checksum")
    try:
        tensors = load(data)
        meta = safe_open_metadata(data)
    except SafetensorError as err:
        raise CorruptBlobError(f"blob of chunk {cache_id} is not valid safetensors: {err}") from err
    if meta.get("compression") == "int8":
        dtype = getattr(torch, meta.get("dtype", "float32"))
        keys = dequantize(tensors["keys.int8"], tensors["keys.scale"], dtype)
        values = dequantize(tensors["values.int8"], tensors["values.scale"], dtype)
    else:
        keys, values = tensors.get("keys"), tensors.get("values")
    if keys is None or values is None or keys.shape != values.shape:
        raise CorruptBlobError(f"blob of chunk {cache_id} lacks keys/values of one shape")
    if keys.shape[2] != len(token_ids):
        raise CorruptBlobError(
            f"blob of chunk {cache_id} holds {keys.shape[2]} tokens, the catalog {len(token_ids)}"
        )
    return ChunkKV(cache_id, fingerprint, token_ids, keys, values, len(sink_ids), sink_ids)
