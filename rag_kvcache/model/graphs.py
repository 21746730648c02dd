"""Replayed forwards: a link's new tokens and each decode step as captured CUDA graphs.

Why: a forward of one to a few hundred new tokens through an 8B model is ~5 ms of GPU work
(reading the weights once), but eager PyTorch launches ~15 kernels per layer from Python, so
the GPU waits for the host: ~30 ms whatever the context length. Captured once per shape and
replayed, the forward costs its GPU work (gpt-fast and the serving engines do the same).

A captured forward must read and write the same addresses every time, with no Python value
that changes between requests baked in. So:
- a request's KV lives in a `Slab`, one per capacity bucket (`SLAB_STEP`), zeroed once and
  lent to one request at a time (`lend`; a request that finds none free within the budget
  gets plain buffers and the eager forward). A slab goes back only when its cache is released
  (`adapter.release_buffers`, which the answer path always calls): views of its KV may outlive
  the cache object, so a cache dropped unreleased keeps its slab;
- the inputs are static tensors padded to a rows bucket (`ROW_BUCKETS`): token ids,
  positions, the slab slot each row writes its K/V to (by index, not by slice), the additive
  mask over the whole slab, and the row whose logits are kept. Padded rows write to the slab's
  last slot, which no real row's mask shows, and see key 0 only, so they stay finite (a NaN
  there would poison every row through its zero attention weight).

The model side (the cache layer that writes by index, the forward itself) is in
`rag_kvcache.model.adapter`; this module keeps slabs and replays and knows nothing of
transformers. On the CPU the same static forward runs eagerly (`capture=False`): that is how
CI holds the static forward, token for token, to the plain one; on CUDA the tests hold the
replayed graph to it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# new tokens per replayed forward, padded up (each bucket is one capture per slab)
ROW_BUCKETS = (1, 8, 32, 64, 128, 192, 256, 320, 384, 448, 512)
SLAB_STEP = 2048  # slab capacities are multiples of this (and one slot more than asked)
BUDGET_SHARE = 0.25  # slabs may take this share of the GPU's memory (CPU: CPU_BUDGET)
CPU_BUDGET = 1 << 30
ENV = "RAG_KVCACHE_CUDA_GRAPHS"  # "0": never replay (every forward eager)
log = logging.getLogger("rag_kvcache.graphs")


@dataclass
class Replay:
    """One captured forward of `rows` new tokens over a slab: its static inputs and output."""

    ids: torch.Tensor  # [1, rows]
    positions: torch.Tensor  # [1, rows]
    slots: torch.Tensor  # [rows]: the slab slot each row's K/V is written to
    mask: torch.Tensor  # [1, 1, rows, capacity] additive
    keep: torch.Tensor  # [1]: the row whose logits are computed
    logits: torch.Tensor | None = None  # [1, 1, vocab], the graph's output
    graph: Any = None  # torch.cuda.CUDAGraph, or None: run eagerly


@dataclass(eq=False)
class Slab:
    """KV buffers [layers, 1, kv_heads, capacity, head_dim] at fixed addresses."""

    keys: torch.Tensor
    values: torch.Tensor
    lent: bool = False  # until `give_back`: views of it may outlive the cache built on it
    replays: dict[int, Replay] = field(default_factory=dict)  # by rows bucket
    failed: set[int] = field(default_factory=set)  # rows buckets whose capture failed: eager

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    @property
    def trash(self) -> int:
        """The slot padded rows write to; never lent to a request."""
        return self.capacity - 1


def rows_bucket(rows: int) -> int | None:
    """The smallest rows bucket holding `rows` new tokens, or None (too many: eager)."""
    return next((b for b in ROW_BUCKETS if rows <= b), None)


class ForwardGraphs:
    """The slabs and captured forwards of one model on one device."""

    def __init__(self, device: torch.device, capture: bool, budget_bytes: int):
        self.device, self.capture, self.budget_bytes = device, capture, budget_bytes
        self.slabs: list[Slab] = []  # least recently lent first
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.lock = threading.RLock()  # lending and replaying (static inputs are shared)

    def lend(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> Slab | None:
        """A free slab of at least `capacity` + 1 slots (the last is the padded rows'), made
        if need be within the budget (free slabs are dropped, oldest first); None if none can
        be had. `shape` is the slab's without the capacity: (layers, 1, kv_heads, head_dim)."""
        size = -(-(capacity + 1) // SLAB_STEP) * SLAB_STEP
        full = (*shape[:3], size, shape[3])
        with self.lock:
            for slab in self.slabs:
                if not slab.lent and slab.keys.shape == full and slab.keys.dtype == dtype:
                    self.slabs.remove(slab)
                    self.slabs.append(slab)
                    slab.lent = True
                    return slab
            need = 2 * torch.Size(full).numel() * dtype.itemsize
            while self.used_bytes() + need > self.budget_bytes:
                free = next((s for s in self.slabs if not s.lent), None)
                if free is None:
                    return None
                self.slabs.remove(free)  # its graphs go with it
            slab = Slab(
                torch.zeros(full, dtype=dtype, device=self.device),
                torch.zeros(full, dtype=dtype, device=self.device),
                lent=True,
            )
            self.slabs.append(slab)
            return slab

    def used_bytes(self) -> int:
        return sum(2 * s.keys.numel() * s.keys.element_size() for s in self.slabs)

    def slab_at(self, key_buffer: torch.Tensor) -> Slab | None:
        """The lent slab whose keys start where `key_buffer` (a layer's, or all layers') does."""
        with self.lock:
            ptr = key_buffer.data_ptr()
            return next((s for s in self.slabs if s.lent and s.keys.data_ptr() == ptr), None)

    def give_back(self, slab: Slab) -> None:
        with self.lock:
            slab.lent = False

    def replay(
        self,
        slab: Slab,
        rows: int,
        fill: Callable[[Replay], None],
        run: Callable[[Replay], torch.Tensor],
    ) -> torch.Tensor | None:
        """Fill the static inputs of the `rows`-bucket forward over `slab` (`fill`), run it and
        return a copy of its logits. `run(replay)` is the forward itself: captured the first
        time a (slab, bucket) is seen (after two warm-up runs that write only the trash slot),
        then replayed. None (the caller runs the eager forward) where the capture failed: a
        model whose forward cannot be captured still answers, and the log says why."""
        with self.lock:
            if rows in slab.failed:
                return None
            replay = slab.replays.get(rows)
            if replay is None:
                try:
                    replay = self._capture(slab, rows, run)
                except RuntimeError as error:  # a host sync in the model's forward, no memory
                    slab.failed.add(rows)
                    log.warning("CUDA graph capture of %d rows failed, eager: %s", rows, error)
                    return None
                slab.replays[rows] = replay
            fill(replay)
            if replay.graph is None:
                replay.logits = run(replay)
            else:
                replay.graph.replay()
            assert replay.logits is not None
            return replay.logits.clone()

    def _capture(self, slab: Slab, rows: int, run: Callable[[Replay], torch.Tensor]) -> Replay:
        dtype, device = slab.keys.dtype, self.device
        replay = Replay(
            ids=torch.zeros(1, rows, dtype=torch.long, device=device),
            positions=torch.zeros(1, rows, dtype=torch.long, device=device),
            slots=torch.full((rows,), slab.trash, dtype=torch.long, device=device),
            mask=torch.full(
                (1, 1, rows, slab.capacity), torch.finfo(dtype).min, dtype=dtype, device=device
            ),
            keep=torch.zeros(1, dtype=torch.long, device=device),
        )
        replay.mask[..., 0] = 0
        if not self.capture:
            return replay
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles, workspaces, lazy inits
            for _ in range(2):
                run(replay)
        torch.cuda.current_stream(device).wait_stream(side)
        replay.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' requests may run eagerly meanwhile
        with torch.cuda.graph(replay.graph, pool=self.pool, capture_error_mode="thread_local"):
            replay.logits = run(replay)
        return replay


_GRAPHS: weakref.WeakKeyDictionary[Any, ForwardGraphs | None] = weakref.WeakKeyDictionary()
_GRAPHS_LOCK = threading.Lock()


def graphs_of(model: Any, device: torch.device) -> ForwardGraphs | None:
    """The model's replayed forwards: on by default on CUDA (unless RAG_KVCACHE_CUDA_GRAPHS=0),
    off elsewhere unless `use_graphs` turned them on."""
    with _GRAPHS_LOCK:
        if model not in _GRAPHS:
            on = device.type == "cuda" and os.environ.get(ENV, "1") != "0"
            _GRAPHS[model] = ForwardGraphs(device, True, cuda_budget(device)) if on else None
        return _GRAPHS[model]


def use_graphs(model: Any, device: torch.device, on: bool, capture: bool | None = None) -> None:
    """Turn the static forward on or off for `model` (between requests). `capture` (default:
    on CUDA) replays captured graphs; without it the static forward runs eagerly, which is
    how the CPU tests check it."""
    capture = device.type == "cuda" if capture is None else capture
    budget = cuda_budget(device) if device.type == "cuda" else CPU_BUDGET
    with _GRAPHS_LOCK:
        _GRAPHS[model] = ForwardGraphs(device, capture, budget) if on else None


@contextmanager
def paused(model: Any, device: torch.device) -> Iterator[None]:
    """Every forward of `model` eager inside (its slabs and captured graphs kept for after):
    the benchmarks' eager side, measured in the same process."""
    with _GRAPHS_LOCK:
        kept = _GRAPHS.get(model, _UNSET)
        _GRAPHS[model] = None
    try:
        yield
    finally:
        with _GRAPHS_LOCK:
            if kept is _UNSET:
                del _GRAPHS[model]
            else:
                _GRAPHS[model] = kept


_UNSET: Any = object()


def cuda_budget(device: torch.device) -> int:
    return int(BUDGET_SHARE * torch.cuda.get_device_properties(device).total_memory)
