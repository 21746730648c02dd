"""Cold chunks read from disk layer by layer while the link's forward runs.

A blob holds a chunk's keys and values ([layers, kv_heads, tokens, head_dim]) as two tensors,
so one layer's keys, or values, are one contiguous range of the file. Reading every chunk's
layer 0, then every chunk's layer 1, and so on, lets the forward start on layer 0 as soon as
it is there (`LayerFeed` waits layer by layer) instead of after the whole context was read:
the disk's time hides behind the forward's instead of adding to it.

The reads go around the OS page cache (O_DIRECT) where the system allows, into page-aligned
buffers: a copy out of the page cache would cost the CPU that the forward is using. O_DIRECT
reads whole 4 KiB blocks, so each range is widened to blocks; the buffer mirrors the file,
so the extra bytes land where they belong (neighbouring ranges read them twice, identically).
Where O_DIRECT is refused (tmpfs, macOS), the same ranges are read through the page cache.

A blob's checksum can only be checked once it is whole, so the forward computes with KV not
yet checked: `LayerReads.settle` (after the forward, before the first token is handed out)
checks every blob and says whether the request must be computed again from a plain `get`,
which re-reads and repairs. Blobs kept as computed and bfloat16 blobs of float32 KV stream (the
link widens the latter as it places them, exactly); int8 ones are decoded whole after reading.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy
import torch

from rag_kvcache.kv import ChunkKV, EncodeSettings
from rag_kvcache.storage.blob import (
    FLOATS,
    CorruptBlobError,
    blob_chunk,
    checksum_matches,
    parse_safetensors,
)
from rag_kvcache.storage.disk import open_regular
from rag_kvcache.storage.records import ChunkRow

BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and memory on common file systems
DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none
KEEP_BYTES = 512 << 20  # read buffers kept for reuse, at most


class ReadBuffers:
    """Page-aligned buffers for blobs, handed back after a request for the next to reuse.

    Memory fresh from the OS is zeroed a page at a time as it is first written, and that
    cost lands on the CPU while the forward runs: reading a 4K context's blobs into new
    buffers made the overlapped forward as slow as reading first (measured at 4K tokens on a
    2-core machine, legolink:2: 0.46-0.65 s streamed against 0.31-0.40 s from memory; into
    reused buffers, 0.39 s). A buffer comes back only once nothing can read it: when the last
    tensor viewing it is gone (`open_blob` ties the release to the array every view holds),
    i.e. after its request if no hot tier kept the chunk, else when the tier evicts it.
    `release` takes no lock: the garbage collector may run it in the middle of `take`."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._free: list[mmap.mmap] = []  # most recently released last
        self._returned: deque[mmap.mmap] = deque()  # released, not sorted in yet
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        """A buffer of `size` bytes or more, in whole blocks (a released one if one fits)."""
        length = -(-size // BLOCK) * BLOCK
        with self._lock:
            self._sort_in()
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) == length:
                    return self._free.pop(i)
        return mmap.mmap(-1, length)

    def release(self, buffer: mmap.mmap) -> None:
        self._returned.append(buffer)

    def _sort_in(self) -> None:
        """Move released buffers to the free list, keeping at most keep_bytes (lock held)."""
        while self._returned:
            self._free.append(self._returned.popleft())
        while sum(len(b) for b in self._free) > self.keep_bytes:
            self._free.pop(0)

    def clear(self) -> None:
        """Drop every released buffer (the memory goes back to the OS)."""
        with self._lock:
            self._returned.clear()
            self._free = []

    @property
    def free(self) -> list[mmap.mmap]:
        """The released buffers, ready for reuse (oldest first)."""
        with self._lock:
            self._sort_in()
            return list(self._free)


BUFFERS = ReadBuffers()


@dataclass
class _Blob:
    """One chunk's blob being read: its file, the buffer mirroring it, and its layer ranges."""

    row: ChunkRow
    fd: int
    direct: bool  # fd reads around the page cache (falls back to buffered on EINVAL)
    size: int  # the file's bytes (the buffer is rounded up to whole blocks)
    buffer: mmap.mmap
    layer_ranges: list[list[tuple[int, int]]]  # per layer: (file offset, bytes) of K and V
    chunk: ChunkKV  # its tensors: views of buffer, as stored (bfloat16 blobs: bfloat16)
    computed: torch.dtype  # what the KV was computed in (the hot tiers keep it widened)
    left: int  # layers still to read
    ok: bool = True  # no read failed; then, once left == 0, the checksum matched


def open_blob(path: Path, row: ChunkRow) -> _Blob | None:
    """Open a blob for layer-by-layer reading: its header read and parsed, its tensors views
    of a buffer still to be filled. None when it cannot stream (missing, unreadable, int8,
    odd layout): the caller reads it whole, which also tells missing from corrupt."""
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size != row.nbytes:  # damage: read whole, it is reported as corrupt unread
            raise CorruptBlobError("size")
        head = os.pread(fd, 8, 0)
        if len(head) < 8 or row.checksum is None:
            raise CorruptBlobError("short")
        (length,) = struct.unpack("<Q", head)
        header = os.pread(fd, length, 8) if 0 < length <= size - 8 else b""
        if len(header) != length or length == 0:
            raise CorruptBlobError("header past the end")
        buffer = BUFFERS.take(size)
        # every view of the buffer holds this array: it goes back for reuse when they are gone
        array = numpy.frombuffer(buffer, dtype=numpy.uint8)
        weakref.finalize(array, BUFFERS.release, buffer)
        array[: 8 + length] = numpy.frombuffer(head + header, dtype=numpy.uint8)
        tensors, meta = parse_safetensors(array.data[:size])
        del array
        if meta.get("compression") not in (None, "bfloat16"):
            raise CorruptBlobError("int8: decoded whole")
        sinks = EncodeSettings.from_key(row.encode_settings).sink_ids
        ids = row.token_ids
        chunk = blob_chunk(tensors, meta, row.cache_id, row.fingerprint, ids, sinks, widen=False)
        ranges = [_layer_ranges(buffer, chunk.keys), _layer_ranges(buffer, chunk.values)]
        covered = sorted([(0, 8 + length), *ranges[0], *ranges[1]])
        if (
            any(a + n != b for (a, n), (b, _) in zip(covered, covered[1:]))
            or sum(n for _, n in covered) != size
        ):  # bytes no range reads would stay stale and fail the checksum
            raise ValueError("the blob holds more than its keys and values")
    except (CorruptBlobError, OSError, ValueError, IndexError):
        os.close(fd)
        return None
    direct = _reopen_direct(path, fd)
    fd = direct if direct is not None else fd
    layers = [[ranges[0][i], ranges[1][i]] for i in range(chunk.keys.shape[0])]
    # what the KV was computed in: a compressed blob says (checked by blob_chunk); another
    # holds it as computed
    computed = FLOATS[meta["dtype"]] if meta.get("compression") else chunk.keys.dtype
    return _Blob(row, fd, direct is not None, size, buffer, layers, chunk, computed, len(layers))


def _layer_ranges(buffer: mmap.mmap, x: torch.Tensor) -> list[tuple[int, int]]:
    """(offset, bytes) of each layer of x, a view of `buffer` (raises if it is a copy)."""
    base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    offset = x.data_ptr() - base
    per_layer = x[0].numel() * x.element_size()
    if not x.is_contiguous() or offset < 0 or offset + per_layer * x.shape[0] > len(buffer):
        raise ValueError("not a view of the blob")
    return [(offset + i * per_layer, per_layer) for i in range(x.shape[0])]


def _reopen_direct(path: Path, fd: int) -> int | None:
    """An O_DIRECT descriptor of the file in place of `fd` (closed), or None (fd kept)."""
    if not DIRECT:
        return None
    try:
        direct = os.open(path, os.O_RDONLY | DIRECT)
    except OSError:  # EINVAL: the file system has no direct I/O
        return None
    os.close(fd)
    return direct


class LayerReads:
    """The cold chunks of one request, read layer-major on `pool`: the `Arrival` the store
    gives each of them (`blob.chunk` with `arrival=` this).

    Their shapes and token ids are there at once; their bytes arrive layer by layer (`wait`).
    `settle()` waits for every read and checksum, hands each good chunk to `keep` (the
    store's hot tiers) and says whether all were good."""

    def __init__(self, blobs: list[_Blob], pool: Executor, keep: Callable[[ChunkKV], None]):
        self._blobs = blobs
        self._keep, self._pool = keep, pool
        layers = max((len(b.layer_ranges) for b in blobs), default=0)
        # blobs holding layer i (chunks of another model may have other counts: each is
        # waited for only on its own layers; linking them is refused, reading them is not)
        self._having = [sum(len(b.layer_ranges) > i for b in blobs) for i in range(layers)]
        self._arrived = [0] * layers  # blobs whose layer i is in
        self._checked = 0
        self._ok = True
        self._done = threading.Condition()
        for group in layer_groups(layers):  # the pool runs them in this order
            for blob in blobs:
                mine = range(group.start, min(group.stop, len(blob.layer_ranges)))
                if mine:
                    pool.submit(self._read, blob, mine)

    def _read(self, blob: _Blob, layers: range) -> None:
        try:
            for part in range(2):  # keys, values: each a run of consecutive layers in the file
                offset = blob.layer_ranges[layers[0]][part][0]
                length = sum(blob.layer_ranges[i][part][1] for i in layers)
                _read_range(blob, offset, length)
        except Exception:  # noqa: BLE001 - any failure is a bad read, answered again
            blob.ok = False
        finally:
            with self._done:
                blob.left -= len(layers)
                last = blob.left == 0
                for layer in layers:
                    self._arrived[layer] += 1
                self._done.notify_all()
        if last:  # the blob is whole: check it (off the caller's thread), then close it
            try:
                os.close(blob.fd)
                view = memoryview(blob.buffer)[: blob.size]
                blob.ok = blob.ok and checksum_matches(view, blob.row.checksum or "")
            except Exception:  # noqa: BLE001 - never leave `settle` waiting
                blob.ok = False
            finally:
                with self._done:
                    self._checked += 1
                    self._done.notify_all()

    def _keep_widened(self, chunk: ChunkKV, dtype: torch.dtype) -> None:
        self._keep(replace(chunk, keys=chunk.keys.to(dtype), values=chunk.values.to(dtype)))

    def wait(self, layer: int) -> None:
        if layer < len(self._arrived):
            with self._done:
                self._done.wait_for(lambda: self._arrived[layer] == self._having[layer])

    def arrived(self) -> int:
        with self._done:
            whole = [n == m for n, m in zip(self._arrived, self._having, strict=True)]
        return whole.index(False) if False in whole else len(whole)

    def wait_all(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self._checked == len(self._blobs))

    def settle(self) -> bool:
        """True when every blob read whole and matched its checksum (each good one kept)."""
        self.wait_all()
        for blob in self._blobs:
            if not blob.ok:
                continue
            if blob.chunk.keys.dtype == blob.computed:
                self._keep(blob.chunk)
                continue
            # bfloat16 blobs are kept widened, as `get` reads them: off the first token
            with contextlib.suppress(RuntimeError):  # the store was closed meanwhile
                self._pool.submit(self._keep_widened, blob.chunk, blob.computed)
        self._ok = self._ok and all(b.ok for b in self._blobs)
        self._blobs = []  # their buffers go back once the request is done with its chunks
        return self._ok


def layer_groups(layers: int) -> list[range]:
    """Layers read together: 1, 1, 2, 4, 8, ... The forward needs the first ones first; by the
    later ones the reads are ahead of it, and fewer, longer reads cost the CPU less."""
    groups, start, size = [], 0, 1
    while start < layers:
        groups.append(range(start, min(start + size, layers)))
        start += size
        size = size if len(groups) < 2 else 2 * size
    return groups


def _read_range(blob: _Blob, offset: int, length: int) -> None:
    """Fill buffer[offset : offset + length] from the file, in whole blocks when direct."""
    start, end = offset, min(offset + length, blob.size)
    if blob.direct:
        start, end = start // BLOCK * BLOCK, -(-end // BLOCK) * BLOCK
    view = memoryview(blob.buffer)
    while start < min(end, blob.size):
        try:
            got = os.preadv(blob.fd, [view[start:end]], start)
        except OSError as err:
            if err.errno != errno.EINVAL or not blob.direct:
                raise
            # refused after all: read through the page cache from now on, exact ranges
            flags = fcntl.fcntl(blob.fd, fcntl.F_GETFL)
            fcntl.fcntl(blob.fd, fcntl.F_SETFL, flags & ~DIRECT)
            blob.direct = False
            return _read_range(blob, offset, length)
        if got == 0:  # the file shrank: its checksum fails
            raise OSError(errno.EIO, "blob ended early")
        start += got
    return None
