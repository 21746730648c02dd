"""A request's KV buffers, kept on the CPU for the next request to reuse.

A 4K-token answer's linked KV is ~190 MB (SmolLM2-135M, float32). Memory that large comes
fresh from the OS, which zeroes it a page at a time as it is first written: placing the
chunks into a new buffer took ~45 ms more than into one written before (a 4K `legolink:2`
link, 388 against 345 ms, 11%). So a finished answer hands its buffers back (`release`) and
the next request's buffers are views of them (`take`). CUDA's caching allocator does this for
GPU memory already; on other devices `take` is `torch.empty`.

A buffer is reused only after `release`, which the answer path calls once its decoding is
over; a buffer never released (e.g. a `link` called directly) is freed as usual when its last
view dies (the pool holds lent buffers weakly). Up to `keep_bytes` of released buffers are
kept, the most recent first. A request takes a released buffer at most twice its size, so a
short request does not hold a long one's buffer while the next long request allocates anew.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque

import torch

KEEP_BYTES = 1 << 30  # released buffers kept for reuse, at most
SPARE = 8  # a new buffer is 1/SPARE larger than asked, so slightly longer requests reuse it
LARGER = 2  # a released buffer is reused for a request of at least 1/LARGER its size


class BufferPool:
    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # flat buffers, most recently released last
        self._lent: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )  # by data pointer
        # handed back, not yet sorted in: `release` never waits for the lock, since it runs in
        # generators' `finally`, which the garbage collector may run inside `take` itself
        self._returned: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialized contiguous tensor of `shape`, in a released buffer if one fits
        (the smallest, the most recently released of equals, at most LARGER times as big)."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        with self._lock:
            self._sort_in()
            sizes = [f.numel() if f.dtype == dtype else 0 for f in self._free]
            fits = [i for i, n in enumerate(sizes) if count <= n <= LARGER * count]
            if fits:
                flat = self._free.pop(min(reversed(fits), key=sizes.__getitem__))
            else:
                flat = torch.empty(count + count // SPARE, dtype=dtype, device=device)
            self._lent[flat.data_ptr()] = flat
        return flat[:count].view(shape)

    def release(self, *buffers: torch.Tensor) -> None:
        """Hand back buffers `take` gave out (others are ignored), once: the caller and
        everything it gave them to are done with them."""
        self._returned.extend(buffers)
        if self._lock.acquire(blocking=False):  # else sorted in by the lock's holder or later
            try:
                self._sort_in()
            finally:
                self._lock.release()

    def _sort_in(self) -> None:
        """Move handed-back buffers to the free list, keeping at most keep_bytes (lock held)."""
        while self._returned:
            flat = self._lent.pop(self._returned.popleft().data_ptr(), None)
            if flat is not None:
                self._free.append(flat)
        kept, total = [], 0
        for flat in reversed(self._free):
            size = flat.numel() * flat.element_size()
            if total + size <= self.keep_bytes:
                kept.append(flat)
                total += size
        self._free = kept[::-1]

    def clear(self) -> None:
        """Drop every released buffer (the memory goes back to the OS)."""
        with self._lock:
            self._sort_in()
            self._free = []

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._sort_in()
            return sum(f.numel() * f.element_size() for f in self._free)


POOL = BufferPool()
