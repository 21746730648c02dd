"""Cached chunks placed into the linked buffer layer by layer, as the forward reaches each layer.

When the chunks' KV lives on another device than the model (CPU-pinned memory feeding a CUDA
model), copying all of it before the link's forward leaves the GPU idle for the whole
transfer. `LayerFeed` instead queues every layer's host-to-device copies on a side stream at
once, in layer order, and the forward waits only for the layer it is about to use: layer i
computes while layers i+1.. are still in flight. The keys arrive raw in a staging buffer and
are rotated into place on the compute stream; values need no rotation and land directly.
The staging buffer holds all layers' raw keys at once (a ring of a few layers' buffers
would do, at the cost of the copy stream waiting on the compute stream; worth it only if
the GPU runs show memory, not transfer, is what limits).

Off CUDA, the same per-layer placement runs synchronously, which is how the CPU tests check it
against `placement.place_into` (the eager reference); there, what it overlaps is the reading of
chunks still arriving from disk (`ChunkKV.arrival`): placing layer i waits only for layer i.
"""

from __future__ import annotations

from functools import partial

import torch

from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.rope import delta_angles, rotate_into


class LayerFeed:
    """Fill keys / values [layers, kv_heads, >= offset + L, head_dim] with `chunks` back to
    back from position `offset`, layer i when `place(i)` is called (see `calls`)."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunks: list[ChunkKV],
        inv_freq: torch.Tensor,
        offset: int = 0,
    ):
        if keys.device.type == "cuda":  # copies are queued at once: chunks read whole first
            chunks = [c.whole() for c in chunks]
        self.keys, self.values, self.chunks, self.inv_freq = keys, values, chunks, inv_freq
        self.spans: list[slice] = []  # where each chunk goes in the buffers
        self.staged_spans: list[slice] = []  # where it is staged (from 0, CUDA only)
        self.angles: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = offset
        for c in chunks:
            self.spans.append(slice(at, at + c.num_tokens))
            self.staged_spans.append(slice(at - offset, at - offset + c.num_tokens))
            self.angles.append(delta_angles(at - c.start, inv_freq, keys.dtype, keys.device))
            at += c.num_tokens
        # reads still filling the chunks' tensors, layer by layer (each waited for once)
        self.arrivals = list({id(c.arrival): c.arrival for c in chunks if c.arrival}.values())
        self.placed = 0  # layers placed so far
        self.events: list[torch.cuda.Event] = []
        self.staged: torch.Tensor | None = None  # raw keys on the model's device (CUDA only)
        if keys.device.type == "cuda":
            self._queue_copies()

    def _queue_copies(self) -> None:
        device = self.keys.device
        layers, kv_heads, _, dim = self.keys.shape
        length = self.staged_spans[-1].stop if self.staged_spans else 0
        staged = torch.empty(layers, kv_heads, length, dim, dtype=self.keys.dtype, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the buffers exist first
        with torch.cuda.stream(stream):
            for layer in range(layers):
                for c, span, local in zip(self.chunks, self.spans, self.staged_spans, strict=True):
                    staged[layer, :, local].copy_(c.keys[layer], non_blocking=True)
                    self.values[layer, :, span].copy_(c.values[layer], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self.events.append(event)
        staged.record_stream(stream)  # freed memory is reused only after these copies
        self.values.record_stream(stream)
        self.staged = staged

    def place(self, layer: int) -> None:
        """Layer `layer` of every chunk into the buffers (waits for its copies on CUDA). Off
        CUDA, chunks arriving from disk have often brought more layers meanwhile: those are
        placed in the same operations, and their own calls then do nothing."""
        if layer < self.placed:
            return
        for arrival in self.arrivals:
            arrival.wait(layer)
        if self.events:
            torch.cuda.current_stream(self.keys.device).wait_event(self.events[layer])
        upto = min((a.arrived() for a in self.arrivals), default=layer + 1)
        if self.staged is not None:  # CUDA: one layer per call, as its copies land
            upto = layer + 1
        layers = slice(layer, upto)
        for c, span, local, angles in zip(
            self.chunks, self.spans, self.staged_spans, self.angles, strict=True
        ):
            if self.staged is not None:
                raw = self.staged[layers, :, local]
            else:
                raw = c.keys[layers].to(self.keys.device)
                self.values[layers, :, span] = c.values[layers]
            delta = span.start - c.start
            rotate_into(self.keys[layers, :, span], raw, delta, self.inv_freq, angles)
        self.placed = upto

    def calls(self) -> list[partial[None]]:
        """One call per layer, for `model.before_layer_update`."""
        return [partial(self.place, layer) for layer in range(self.keys.shape[0])]
