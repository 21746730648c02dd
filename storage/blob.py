"""A chunk's KV as bytes: safetensors (never pickle), with a checksum.

The blob holds `keys` and `values` ([layers, kv_heads, tokens, head_dim]) and, as metadata,
the cache ID, model fingerprint and start position, so a blob describes itself.

Reading is on the TTFT path of every chunk not held hot, so it copies nothing it need not:
the checksum is xxh3-128 (integrity against bit rot and torn writes, ~30 GB/s; blobs from
before it carry sha256 and are still checked with it), and the tensors are views of the
buffer the blob was read into (`parse_safetensors`), where safetensors' own `load` copies
every tensor out of it first.

What a blob holds is in its metadata, so blobs of every encoding live side by side in one
store (`compression`, `COMPRESSIONS`): none (the KV as computed, the model's dtype), "bfloat16"
(float32 KV rounded to bfloat16, half the bytes, cast back on read) or "int8" (per-channel 8-bit
codes and scales). A blob without the key is one written as computed, as every store before the
lossy encodings was. `as_stored` is what reading a blob gives back, for the hot tiers to keep.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import replace
from typing import Any

import torch
import xxhash
from safetensors.torch import save

from rag_kvcache.config import COMPRESSIONS
from rag_kvcache.config import DTYPES as DTYPES_BY_NAME
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.storage.compress import dequantize, quantize

XXH3 = "xxh3-128:"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


class CorruptBlobError(RagKVCacheError):
    """A blob's bytes do not match its checksum or do not parse as a chunk's KV."""


def checksum(data: bytes | bytearray | memoryview) -> str:
    """'xxh3-128:' and 32 hex digits."""
    return XXH3 + xxhash.xxh3_128_hexdigest(data)


def checksum_matches(data: bytes | bytearray | memoryview, expected: str) -> bool:
    """Check against a checksum from `checksum`, or a bare sha256 hex digest (older blobs)."""
    if expected.startswith(XXH3):
        return checksum(data) == expected
    return hashlib.sha256(data).hexdigest() == expected


def parse_safetensors(
    data: bytearray | memoryview,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (views of `data`, no copies) and `__metadata__` of a safetensors buffer.

    Every header entry is checked against the buffer (known dtype, offsets inside the data,
    size matching the shape), so malformed bytes raise CorruptBlobError, never read out of
    bounds. `safetensors.torch.load` is the oracle in the tests.
    """
    try:
        (length,) = struct.unpack_from("<Q", data)
        if length > len(data) - 8:
            raise ValueError(f"header of {length} bytes in a {len(data)}-byte blob")
        header: dict[str, Any] = json.loads(bytes(data[8 : 8 + length]))
        start, size = 8 + length, len(data) - 8 - length
        metadata = {str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()}
        buffer = memoryview(data)  # while views of it live, the bytearray cannot be resized
        tensors, spans = {}, []
        for name, entry in header.items():
            dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
            begin, end = entry["data_offsets"]
            if not all(type(d) is int and d >= 0 for d in (*shape, begin, end)):
                raise ValueError(f"tensor {name!r}: shape and offsets must be integers >= 0")
            count = math.prod(shape)
            if not begin <= end <= size or end - begin != count * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit {shape}")
            spans.append((begin, end))
            if count == 0:
                flat = torch.empty(0, dtype=dtype)
            elif (start + begin) % dtype.itemsize:  # not from our writer: copy, aligned
                flat = torch.frombuffer(bytearray(buffer[start + begin : start + end]), dtype=dtype)
            else:
                flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin)
            tensors[name] = flat.view(shape)
        spans.sort()
        if any(b < a_end for (_, a_end), (b, _) in zip(spans, spans[1:])):
            raise ValueError("tensors overlap")
        return tensors, metadata
    except (
        struct.error,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        RuntimeError,
        OverflowError,
    ) as err:
        raise CorruptBlobError(f"not a valid safetensors buffer: {err}") from err


def encoding(kv: ChunkKV, compress: str | None) -> str | None:
    """How kv's blob is written under the store's `compress`: "bfloat16" rounds float32 KV
    only (KV already 16-bit is stored as it is; float64 is the tests' exact oracle)."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"unknown KV compression {compress!r}; use one of {COMPRESSIONS}")
    if compress == "bfloat16" and kv.keys.dtype != torch.float32:
        return None
    return compress


def to_blob(kv: ChunkKV, compress: str | None = None) -> bytes:
    """Serialize kv as `encoding(kv, compress)` says: as computed, as bfloat16, or int8."""
    meta = {"cache_id": kv.cache_id, "fingerprint": kv.fingerprint, "start": str(kv.start)}
    how = encoding(kv, compress)
    if how is None:
        tensors = {"keys": kv.keys.contiguous().cpu(), "values": kv.values.contiguous().cpu()}
        return save(tensors, metadata=meta)
    tensors = {}
    for name, x in (("keys", kv.keys), ("values", kv.values)):
        if how == "bfloat16":  # own names: a reader that predates them sees no keys, re-encodes
            tensors[f"{name}.bf16"] = x.to(torch.bfloat16).contiguous().cpu()
        else:
            codes, scale = quantize(x.cpu())
            tensors[f"{name}.int8"], tensors[f"{name}.scale"] = codes, scale.contiguous()
    meta.update(compression=how, dtype=str(kv.keys.dtype).removeprefix("torch."))
    return save(tensors, metadata=meta)


def as_stored(kv: ChunkKV, compress: str | None) -> ChunkKV:
    """The KV that reading kv's blob gives back (kv itself when the encoding is lossless),
    bit for bit: what the hot tiers keep, so an answer never depends on the tier serving it."""
    how = encoding(kv, compress)
    if how is None:
        return kv
    if how == "bfloat16":  # rounding to nearest even: the same on every device
        keys, values = (x.to(torch.bfloat16).to(x.dtype) for x in (kv.keys, kv.values))
    else:  # quantized on the CPU, as to_blob does
        keys, values = (
            dequantize(*quantize(x.cpu()), x.dtype).to(x.device) for x in (kv.keys, kv.values)
        )
    return replace(kv, keys=keys, values=values)


FLOATS = {name: getattr(torch, name) for name in DTYPES_BY_NAME}  # what KV is computed in
PARTS = {None: ("",), "bfloat16": (".bf16",), "int8": (".int8", ".scale")}  # tensor name endings


def _decoded(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], cache_id: str, widen: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values in the dtype they were computed in, whatever the blob's encoding
    (`widen=False`: bfloat16 blobs' as stored, views of the blob; they widen exactly)."""
    how, dtype = meta.get("compression"), FLOATS.get(meta.get("dtype", "float32"))
    if how not in PARTS or dtype is None:
        raise CorruptBlobError(
            f"blob of chunk {cache_id} holds KV encoded as {how!r} from {meta.get('dtype')!r}: "
            f"not one of {COMPRESSIONS} from one of {sorted(FLOATS)}"
        )
    out = []
    for name in ("keys", "values"):
        if any(name + end not in tensors for end in PARTS[how]):
            raise CorruptBlobError(f"blob of chunk {cache_id} lacks {name}")
        parts = [tensors[name + end] for end in PARTS[how]]
        if how is None:
            out.append(parts[0])
        elif how == "bfloat16":
            if parts[0].dtype != torch.bfloat16:
                raise CorruptBlobError(f"blob of chunk {cache_id}: {name}.bf16 is not bfloat16")
            out.append(parts[0].to(dtype) if widen else parts[0])
        else:
            out.append(dequantize(parts[0], parts[1], dtype))
    return out[0], out[1]


def from_blob(
    data: bytes | bytearray,
    expected_checksum: str,
    cache_id: str,
    fingerprint: str,
    token_ids: tuple[int, ...],
    sink_ids: tuple[int, ...],
) -> ChunkKV:
    """Parse a blob after checking its checksum; any mismatch is a CorruptBlobError.

    The tensors are views of `data` when it is a bytearray (as the disk tier reads it);
    immutable bytes (from Redis) are copied once first."""
    if not checksum_matches(data, expected_checksum):
        raise CorruptBlobError(f"blob of chunk {cache_id} fails its checksum")
    try:
        tensors, meta = parse_safetensors(data if isinstance(data, bytearray) else bytearray(data))
    except CorruptBlobError as err:
        raise CorruptBlobError(f"blob of chunk {cache_id}: {err}") from err
    return blob_chunk(tensors, meta, cache_id, fingerprint, token_ids, sink_ids)


def blob_chunk(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    cache_id: str,
    fingerprint: str,
    token_ids: tuple[int, ...],
    sink_ids: tuple[int, ...],
    widen: bool = True,
) -> ChunkKV:
    """The chunk a parsed blob holds (`parse_safetensors`), checked against its catalog row's
    token count; a blob of another encoding or shape is a CorruptBlobError. `widen=False`
    leaves a bfloat16 blob's KV as stored (see `_decoded`)."""
    keys, values = _decoded(tensors, meta, cache_id, widen)
    if keys.shape != values.shape:
        raise CorruptBlobError(f"blob of chunk {cache_id} lacks keys/values of one shape")
    if keys.shape[2] != len(token_ids):
        raise CorruptBlobError(
            f"blob of chunk {cache_id} holds {keys.shape[2]} tokens, the catalog {len(token_ids)}"
        )
    return ChunkKV(cache_id, fingerprint, token_ids, keys, values, len(sink_ids), sink_ids)
