"""Blob bytes: the zero-copy safetensors parse against safetensors' own loader, checksums old
and new, and malformed bytes as clear errors."""

import hashlib
import json
import struct

import pytest
import torch
from helpers import random_chunks
from safetensors.torch import load, save

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.blob import (
    CorruptBlobError,
    checksum,
    checksum_matches,
    from_blob,
    parse_safetensors,
    to_blob,
)
from rag_kvcache.storage.store import TieredStore


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 4, 5, generator=g),
        "bf16": torch.randn(2, 7, generator=g).bfloat16(),
        "f16": torch.randn(9, generator=g).half(),
        "i8": torch.randint(-127, 128, (4, 4), generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 3),
    }


def test_parse_equals_safetensors_load_and_copies_nothing() -> None:
    data = bytearray(save(_tensors(), metadata={"cache_id": "abc", "start": "4"}))
    tensors, meta = parse_safetensors(data)
    expected = load(bytes(data))
    assert meta == {"cache_id": "abc", "start": "4"}
    assert tensors.keys() == expected.keys()
    for name, x in expected.items():
        assert tensors[name].dtype == x.dtype and torch.equal(tensors[name], x), name
    # views of the buffer: writing the buffer shows through (so nothing was copied)
    view = tensors["i8"]
    start = view.data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert 0 < start < len(data)
    data[start] = (data[start] + 1) % 256
    assert not torch.equal(view, expected["i8"])


def _with_header(header: dict, payload: bytes) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(raw)) + raw + payload)


@pytest.mark.parametrize(
    "data",
    [
        bytearray(b""),
        bytearray(b"\x05\x00"),
        bytearray(struct.pack("<Q", 10**9) + b"{}"),  # header longer than the blob
        bytearray(struct.pack("<Q", 4) + b"nope"),  # not JSON
        _with_header([1, 2], b""),  # type: ignore[arg-type]  # header not an object
        _with_header({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234"),
        _with_header({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"12345678"),
        _with_header({"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"12345678"),
        _with_header({"x": {"dtype": "F32", "shape": [2]}}, b"12345678"),
        _with_header({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [8, 0]}}, b"1234"),
        _with_header({"x": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}, b"1" * 8),
        _with_header({"x": {"dtype": "F32", "shape": [float("inf")], "data_offsets": [0, 8]}}, b""),
        _with_header(
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"1" * 12,
        ),
    ],
    ids=[
        "empty",
        "short",
        "header-too-long",
        "not-json",
        "header-not-object",
        "data-past-end",
        "size-not-shape",
        "unknown-dtype",
        "no-offsets",
        "negative",
        "fractional-dim",
        "infinite-dim",
        "overlapping",
    ],
)
def test_malformed_safetensors_is_a_corrupt_blob(data: bytearray) -> None:
    with pytest.raises(CorruptBlobError, match="not a valid safetensors"):
        parse_safetensors(data)


def test_a_misaligned_tensor_is_copied_out_right() -> None:
    """Blobs we write are aligned; one from elsewhere may not be: it is read through a copy."""
    values = torch.tensor([1.5, -2.25], dtype=torch.float32)
    data = _with_header(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}},
        b"\0" + values.numpy().tobytes(),
    )
    header_end = len(data) - 9
    assert (header_end + 1) % 4  # the tensor really starts off a 4-byte boundary
    tensors, _ = parse_safetensors(data)
    assert torch.equal(tensors["x"], values)


def test_checksums_new_and_legacy() -> None:
    data = bytearray(b"kv bytes" * 100)
    digest = checksum(data)
    assert digest.startswith("xxh3-128:") and len(digest) == len("xxh3-128:") + 32
    assert checksum_matches(data, digest)
    assert checksum_matches(data, hashlib.sha256(data).hexdigest())  # blobs from before xxh3
    data[3] ^= 1
    assert not checksum_matches(data, digest)
    assert not checksum_matches(data, hashlib.sha256(b"kv bytes" * 100).hexdigest())


def test_from_blob_round_trips_and_rejects_a_flipped_byte(tiny32) -> None:
    kv = encode_chunks(tiny32, random_chunks([6]))[0]
    data = bytearray(to_blob(kv))
    back = from_blob(data, checksum(data), kv.cache_id, kv.fingerprint, kv.token_ids, ())
    assert torch.equal(back.keys, kv.keys) and torch.equal(back.values, kv.values)
    digest = checksum(data)
    frozen = from_blob(bytes(data), digest, kv.cache_id, kv.fingerprint, kv.token_ids, ())
    assert torch.equal(frozen.values, kv.values)  # immutable bytes (Redis) work too
    data[-1] ^= 0x40
    with pytest.raises(CorruptBlobError, match="fails its checksum"):
        from_blob(data, digest, kv.cache_id, kv.fingerprint, kv.token_ids, ())


def test_a_store_written_with_sha256_checksums_still_serves(tmp_path, tiny32) -> None:
    """Catalog rows from before xxh3 hold sha256 digests: their blobs are checked with it."""
    store = TieredStore(tmp_path / "kv")
    store.register_model(tiny32.fingerprint, "tiny", "float32", 3, 2, 16)
    kv = encode_chunks(tiny32, random_chunks([5]))[0]
    store.put(kv, "test")
    blob = store.durable.get(kv.cache_id)
    assert blob is not None
    store.catalog.commit_chunk(kv.cache_id, len(blob), hashlib.sha256(blob).hexdigest(), "disk")
    for tier in store.hot:
        tier.remove(kv.cache_id)
    (served,) = store.get([kv.cache_id])
    assert torch.equal(served.keys, kv.keys)
    report = store.verify()
    assert report.corrupt == [] and report.upgraded == 1  # now xxh3-128
    row = store.catalog.chunk(kv.cache_id)
    assert row is not None and row.checksum == checksum(blob)
    assert store.verify().upgraded == 0
    store.close()
